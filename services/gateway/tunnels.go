package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Tunnels (docs/tunnels.md). OpenTunnel sends OpenTunnel on the node's
// session and waits for the daemon to open a NodeService.Tunnel stream
// naming the tunnel, on the same connection; the daemon decides from its
// own allowlist whether to connect, and a refusal is that stream's first
// frame. The gateway's end of an open tunnel is a *Tunnel: an
// io.ReadWriteCloser whoever relays the caller's bytes (the API) reads and
// writes. A tunnel ends when either side closes it, when the node's session
// ends (superseded, revoked, expired, the gateway stopping), or when the
// daemon's stream fails.

// TunnelOpenTimeout bounds the wait for the daemon's Tunnel stream.
const TunnelOpenTimeout = 15 * time.Second

// Tunnel is the gateway's end of one open tunnel. Read returns the target's
// bytes (io.EOF once the target closed its side), Write sends the caller's,
// CloseWrite says the caller sent all, Close ends the tunnel at both ends.
// Read and Write may be called concurrently with each other, not with
// themselves.
type Tunnel struct {
	id, nodeID string
	stream     agentv1.NodeService_TunnelServer
	sendMu     sync.Mutex
	pending    []byte // received and not yet read
	eof        bool
	done       chan struct{} // closed by Close: the stream's handler returns
	once       sync.Once
	cause      error
}

// ID is the tunnel's id.
func (t *Tunnel) ID() string { return t.id }

// Read reads the target's next bytes.
func (t *Tunnel) Read(p []byte) (int, error) {
	for len(t.pending) == 0 {
		if t.eof {
			return 0, io.EOF
		}
		f, err := t.stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				t.eof = true
				continue
			}
			return 0, t.closedErr(err)
		}
		if len(f.GetData()) > tunnelspec.MaxFrame {
			t.Close(errors.New("the node sent a frame over the maximum size"))
			return 0, t.closedErr(nil)
		}
		t.pending = f.GetData()
		if f.GetCloseWrite() {
			t.eof = true
		}
	}
	n := copy(p, t.pending)
	t.pending = t.pending[n:]
	return n, nil
}

// Write sends p to the target, in frames of at most tunnelspec.MaxFrame;
// it blocks while the node does not read (gRPC's flow control).
func (t *Tunnel) Write(p []byte) (int, error) {
	t.sendMu.Lock()
	defer t.sendMu.Unlock()
	written := 0
	for len(p) > 0 {
		n := min(len(p), tunnelspec.MaxFrame)
		if err := t.stream.Send(&agentv1.TunnelResponse{Data: p[:n]}); err != nil {
			return written, t.closedErr(err)
		}
		written += n
		p = p[n:]
	}
	return written, nil
}

// CloseWrite tells the node the caller sent all it will; the node
// half-closes the target.
func (t *Tunnel) CloseWrite() error {
	t.sendMu.Lock()
	defer t.sendMu.Unlock()
	if err := t.stream.Send(&agentv1.TunnelResponse{CloseWrite: true}); err != nil {
		return t.closedErr(err)
	}
	return nil
}

// Close ends the tunnel at both ends with cause (nil: closed by the caller).
func (t *Tunnel) Close(cause error) {
	t.once.Do(func() {
		t.cause = cause
		close(t.done)
	})
}

// Done is closed once the tunnel ends.
func (t *Tunnel) Done() <-chan struct{} { return t.done }

// Cause is why the tunnel ended (nil while open, or closed by the caller).
func (t *Tunnel) Cause() error {
	select {
	case <-t.done:
		return t.cause
	default:
		return nil
	}
}

func (t *Tunnel) closedErr(err error) error {
	select {
	case <-t.done:
		if t.cause != nil {
			return fmt.Errorf("tunnel %s closed: %w", t.id, t.cause)
		}
		return fmt.Errorf("tunnel %s closed", t.id)
	default:
	}
	return fmt.Errorf("tunnel %s: %w", t.id, err)
}

// pendingTunnel is an OpenTunnel waiting for the daemon's stream.
type pendingTunnel struct {
	nodeID string
	ready  chan *Tunnel  // the node's stream, once opened
	refuse chan string   // the node's refusal
	sess   *session      // the session that was asked
	gone   chan struct{} // closed when the waiter gives up
}

// tunnelTable holds the pending and open tunnels.
type tunnelTable struct {
	mu      sync.Mutex
	pending map[string]*pendingTunnel
}

// OpenTunnel asks nodeID's daemon, through its session on this gateway, to
// open tunnel id to target, and returns the gateway's end once the daemon
// connected. A node with no session here is fault.Unavailable; a ramdisk
// session fault.Conflict; a node that refused (its allowlist, its own
// limit, a target that did not answer) fault.AccessDenied with the node's
// reason.
func (g *Gateway) OpenTunnel(ctx context.Context, nodeID, id, target string) (*Tunnel, error) {
	if _, err := tunnelspec.ParseTarget(target); err != nil {
		return nil, fault.New(fault.InvalidInput, "target", "%v", err)
	}
	g.mu.Lock()
	s, ok := g.sessions[nodeID]
	g.mu.Unlock()
	if !ok || !s.ready.Load() {
		return nil, fault.New(fault.Unavailable, "nodeId", "node %s holds no session on gateway %s", nodeID, g.cfg.ID)
	}
	if s.ramdisk {
		return nil, fault.New(fault.Conflict, "nodeId", "node %s is in commissioning (bcd ramdisk): a ramdisk opens no tunnels", nodeID)
	}
	p := &pendingTunnel{nodeID: nodeID, ready: make(chan *Tunnel, 1), refuse: make(chan string, 1), sess: s, gone: make(chan struct{})}
	g.tunnels.mu.Lock()
	if g.tunnels.pending == nil {
		g.tunnels.pending = map[string]*pendingTunnel{}
	}
	if _, dup := g.tunnels.pending[id]; dup {
		g.tunnels.mu.Unlock()
		return nil, fault.New(fault.Conflict, "tunnelId", "tunnel %s is already opening", id)
	}
	g.tunnels.pending[id] = p
	g.tunnels.mu.Unlock()
	defer func() {
		g.tunnels.mu.Lock()
		delete(g.tunnels.pending, id)
		close(p.gone)
		g.tunnels.mu.Unlock()
	}()
	if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_OpenTunnel{OpenTunnel: &agentv1.OpenTunnel{TunnelId: id, Target: target}}}); err != nil {
		return nil, fault.New(fault.Unavailable, "nodeId", "node %s: the session ended: %v", nodeID, err)
	}
	timer := time.NewTimer(TunnelOpenTimeout)
	defer timer.Stop()
	select {
	case t := <-p.ready:
		return t, nil
	case why := <-p.refuse:
		return nil, fault.New(fault.AccessDenied, "target", "node %s refused the tunnel: %s", nodeID, why)
	case <-s.ctx.Done():
		return nil, fault.New(fault.Unavailable, "nodeId", "node %s: the session ended", nodeID)
	case <-timer.C:
		return nil, fault.New(fault.Unavailable, "nodeId", "node %s did not open the tunnel within %s", nodeID, TunnelOpenTimeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Tunnel holds one daemon's tunnel stream: its first frame names a tunnel
// this gateway asked that node to open.
func (g *Gateway) Tunnel(stream agentv1.NodeService_TunnelServer) error {
	ctx := stream.Context()
	_, nodeID, err := g.verifiedNode(ctx)
	if err != nil {
		return err
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	id := first.GetTunnelId()
	g.tunnels.mu.Lock()
	p, ok := g.tunnels.pending[id]
	if ok && p.nodeID != nodeID {
		ok = false // another node cannot answer for it
	}
	if ok {
		delete(g.tunnels.pending, id) // one stream per tunnel
	}
	g.tunnels.mu.Unlock()
	if !ok {
		return status.Errorf(codes.NotFound, "no tunnel %q is opening for node %s", id, nodeID)
	}
	if why := first.GetError(); why != "" {
		if len(why) > tunnelspec.MaxError {
			why = why[:tunnelspec.MaxError]
		}
		select {
		case p.refuse <- why:
		case <-p.gone:
		}
		return nil
	}
	if len(first.GetData()) > 0 || first.GetCloseWrite() {
		return status.Error(codes.InvalidArgument, "the first tunnel frame carries no data")
	}
	t := &Tunnel{id: id, nodeID: nodeID, stream: stream, done: make(chan struct{})}
	select {
	case p.ready <- t:
	case <-p.gone:
		return status.Error(codes.DeadlineExceeded, "the tunnel was given up")
	}
	select {
	case <-t.done:
		if t.cause != nil {
			return status.Error(codes.Aborted, t.cause.Error())
		}
		return nil
	case <-p.sess.ctx.Done():
		t.Close(fmt.Errorf("the node's session ended: %w", context.Cause(p.sess.ctx)))
		return status.Error(codes.Aborted, "the node's session ended")
	case <-ctx.Done():
		t.Close(errors.New("the node's tunnel stream ended"))
		return ctx.Err()
	}
}
