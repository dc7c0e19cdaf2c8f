package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"
)

// Tunnels: the session's OpenTunnel opens a NodeService.Tunnel stream on
// the session's own connection (the node still only dials out). The node
// connects to the target only when its applied tunnels section allows it
// (converge.Converger.AllowsTunnel, tunnelspec.Allows) — whatever the
// control plane asked — and never from bcd ramdisk. A refusal is the
// stream's first and only frame. Every tunnel ends with the session that
// opened it.
const (
	// MaxTunnels bounds the tunnels one node holds open at once; an open
	// beyond it is refused.
	MaxTunnels = 256
	// tunnelDialTimeout bounds the connect to the target.
	tunnelDialTimeout = 10 * time.Second
)

// errTunnelFrame ends a tunnel whose peer sent a frame over the maximum.
var errTunnelFrame = errors.New("tunnel: a frame over the maximum size")

// openTunnel runs the tunnel m asks for until it ends or ctx (the session)
// does.
func (r *runner) openTunnel(ctx context.Context, conn *grpc.ClientConn, m *agentv1.OpenTunnel) {
	id, target := m.GetTunnelId(), m.GetTarget()
	log := r.log.With("tunnel", id, "target", target)
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := agentv1.NewNodeServiceClient(conn).Tunnel(tctx)
	if err != nil {
		log.WarnContext(ctx, "tunnel: open stream", "err", err)
		return
	}
	if n := r.tunnelCount.Add(1); n > MaxTunnels {
		r.tunnelCount.Add(-1)
		r.refuseTunnel(stream, id, fmt.Sprintf("this node holds %d tunnels, at most %d", n-1, MaxTunnels))
		return
	}
	defer r.tunnelCount.Add(-1)
	why := r.tunnelRefusal(target)
	var c net.Conn
	if why == "" {
		t, _ := tunnelspec.ParseTarget(target) // AllowsTunnel parsed it
		d := net.Dialer{Timeout: tunnelDialTimeout}
		if c, err = d.DialContext(tctx, t.Network, t.Addr()); err != nil {
			why = "connect: " + err.Error()
		}
	}
	if why != "" {
		log.WarnContext(ctx, "tunnel refused", "why", why)
		r.refuseTunnel(stream, id, why)
		return
	}
	stop := context.AfterFunc(tctx, func() { _ = c.Close() })
	defer stop()
	defer func() { _ = c.Close() }()
	if err := stream.Send(&agentv1.TunnelRequest{TunnelId: id}); err != nil {
		return
	}
	log.InfoContext(ctx, "tunnel opened")
	up, down, err := relayNode(stream, c)
	log.InfoContext(ctx, "tunnel closed", "bytes_up", up, "bytes_down", down, "err", err)
}

// tunnelRefusal says why the node refuses target ("" when it does not).
func (r *runner) tunnelRefusal(target string) string {
	if r.cfg.Ramdisk != nil {
		return "bcd ramdisk opens no tunnels"
	}
	if err := r.conv.AllowsTunnel(target); err != nil {
		return err.Error()
	}
	return ""
}

func (r *runner) refuseTunnel(stream agentv1.NodeService_TunnelClient, id, why string) {
	if len(why) > tunnelspec.MaxError {
		why = why[:tunnelspec.MaxError]
	}
	if err := stream.Send(&agentv1.TunnelRequest{TunnelId: id, Error: why}); err == nil {
		_ = stream.CloseSend()
		// Wait for the gateway to end the stream, so the refusal arrives.
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	}
}

// relayNode copies between the target and the stream until both
// directions are done or one fails; up counts bytes from the target, down
// bytes to it.
func relayNode(stream agentv1.NodeService_TunnelClient, c net.Conn) (up, down int64, err error) {
	var wg sync.WaitGroup
	var upErr error
	wg.Go(func() {
		buf := make([]byte, tunnelspec.MaxFrame)
		for {
			n, rerr := c.Read(buf)
			if n > 0 {
				if serr := stream.Send(&agentv1.TunnelRequest{Data: buf[:n]}); serr != nil {
					upErr = serr
					return
				}
				up += int64(n)
			}
			if rerr != nil {
				if errors.Is(rerr, io.EOF) {
					if serr := stream.Send(&agentv1.TunnelRequest{CloseWrite: true}); serr != nil {
						upErr = serr
						return
					}
					upErr = stream.CloseSend()
					return
				}
				upErr = rerr
				return
			}
		}
	})
	for {
		f, rerr := stream.Recv()
		if rerr != nil {
			if !errors.Is(rerr, io.EOF) {
				err = rerr
			}
			break
		}
		if len(f.GetData()) > tunnelspec.MaxFrame {
			err = errTunnelFrame
			break
		}
		if len(f.GetData()) > 0 {
			if _, werr := c.Write(f.GetData()); werr != nil {
				err = werr
				break
			}
			down += int64(len(f.GetData()))
		}
		if f.GetCloseWrite() {
			if cw, ok := c.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			}
		}
	}
	// The gateway ended the stream (or it failed): the target goes too,
	// which ends the reader above.
	_ = c.Close()
	wg.Wait()
	if err == nil && upErr != nil && !errors.Is(upErr, net.ErrClosed) && !errors.Is(upErr, io.EOF) {
		err = upErr
	}
	return up, down, err
}
