package gateway

import (
	"context"
	"errors"
	"io"
	"strings"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/spiffepath"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// RelayService is the gateway's GatewayService: an API process in
// another process relays a tunnel's bytes through it to the node it holds
// (docs/tunnels.md). Callers present a gateway-class certificate of the
// trust domain (spiffe://<td>/gateway/<name>); a node certificate is
// refused.
func (g *Gateway) RelayService() agentv1.GatewayServiceServer { return relayService{g: g} }

type relayService struct {
	agentv1.UnimplementedGatewayServiceServer
	g *Gateway
}

// verifiedControlPlane checks the caller holds a gateway-class
// certificate of the trust domain.
func (g *Gateway) verifiedControlPlane(ctx context.Context) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return status.Error(codes.Unauthenticated, "no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return status.Error(codes.Unauthenticated, "a control-plane certificate is required")
	}
	id, err := x509svid.IDFromCert(ti.State.VerifiedChains[0][0])
	if err != nil {
		return status.Errorf(codes.Unauthenticated, "certificate has no SPIFFE ID: %v", err)
	}
	if id.TrustDomain().Name() != g.cfg.TrustDomain || !strings.HasPrefix(id.Path(), spiffepath.GatewayPrefix) {
		return status.Errorf(codes.PermissionDenied, "%s is not a control-plane identity of %s", id, g.cfg.TrustDomain)
	}
	return nil
}

// Relay opens the tunnel the first message names on the node this gateway
// holds and copies both ways until both sides are done, either fails, or
// the caller or the node ends it.
func (r relayService) Relay(stream agentv1.GatewayService_RelayServer) error {
	ctx := stream.Context()
	if err := r.g.verifiedControlPlane(ctx); err != nil {
		return err
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	t, err := r.g.OpenTunnel(ctx, first.GetNodeId(), first.GetTunnelId(), first.GetTarget())
	if err != nil {
		msg := err.Error()
		if len(msg) > tunnelspec.MaxError {
			msg = msg[:tunnelspec.MaxError]
		}
		return stream.Send(&agentv1.RelayResponse{ErrorCode: string(fault.CodeOf(err)), Error: msg})
	}
	defer t.Close(nil)
	if err := stream.Send(&agentv1.RelayResponse{Opened: true}); err != nil {
		return err
	}
	halves := make(chan struct{}, 2)
	failed := make(chan error, 2)
	go func() { // caller to node
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				m, err = &agentv1.RelayRequest{CloseWrite: true}, nil
			}
			if err != nil {
				failed <- err
				return
			}
			if len(m.GetData()) > tunnelspec.MaxFrame {
				failed <- errors.New("a relay frame over the maximum size")
				return
			}
			if len(m.GetData()) > 0 {
				if _, err := t.Write(m.GetData()); err != nil {
					failed <- err
					return
				}
			}
			if m.GetCloseWrite() {
				if err := t.CloseWrite(); err != nil {
					failed <- err
					return
				}
				halves <- struct{}{}
				return
			}
		}
	}()
	go func() { // node to caller
		buf := make([]byte, tunnelspec.MaxFrame)
		for {
			n, err := t.Read(buf)
			if n > 0 {
				if serr := stream.Send(&agentv1.RelayResponse{Data: buf[:n]}); serr != nil {
					failed <- serr
					return
				}
			}
			if errors.Is(err, io.EOF) {
				if serr := stream.Send(&agentv1.RelayResponse{CloseWrite: true}); serr != nil {
					failed <- serr
					return
				}
				halves <- struct{}{}
				return
			}
			if err != nil {
				failed <- err
				return
			}
		}
	}()
	for done := 0; done < 2; {
		select {
		case <-halves:
			done++
		case err := <-failed:
			t.Close(err)
			return status.Error(codes.Aborted, err.Error())
		case <-t.Done():
			return status.Error(codes.Aborted, "the node's tunnel ended")
		case <-ctx.Done():
			t.Close(errors.New("the relaying API process ended the tunnel"))
			return ctx.Err()
		}
	}
	return nil
}
