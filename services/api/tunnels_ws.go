package api

import (
	"context"
	"errors"
	"net/http"

	"github.com/coder/websocket"
	"google.golang.org/protobuf/encoding/protojson"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// TunnelConnectPath is the WebSocket form of TunnelsService.Connect.
const TunnelConnectPath = Prefix + "tunnels/connect"

// TunnelTokenHeader carries the connect token on the WebSocket upgrade (the
// token query parameter is accepted too, for clients that cannot set
// headers).
const TunnelTokenHeader = "X-Tunnel-Token"

// ServeTunnel serves GET /api/compute/tunnels/connect: a WebSocket carrying
// one tunnel. The connect token (header X-Tunnel-Token, or the token query
// parameter) is the credential; a wrong one spends the address's
// failed-authentication budget, as a wrong API key does. Once the node connected, the server sends
// one text message, the Tunnel as JSON; then binary messages carry the
// bytes both ways, at most 32 KiB each, and an empty binary message says
// its sender sent all it will (the TCP half-close). The server closes the
// WebSocket when the tunnel ends: status 1000 when both sides finished,
// else 1011 with why (a spent or unknown token too). A request without a
// token answers the error envelope.
func (s *Server) ServeTunnel(w http.ResponseWriter, r *http.Request) {
	ctx := withClientAddr(withRequestID(r.Context(), r.Header.Get(RequestIDHeader)), s.proxies.FromRequest(r))
	token := r.Header.Get(TunnelTokenHeader)
	if token == "" {
		token = r.URL.Query().Get("token")
	}
	if token == "" || len(token) > 128 {
		writeEnvelope(w, fault.ToStatus(fault.New(fault.Unauthenticated, "token", "a connect token (tunnels.open) is required")))
		return
	}
	c, err := websocket.Accept(w, r, &websocket.AcceptOptions{})
	if err != nil {
		return // Accept answered the client
	}
	c.SetReadLimit(tunnelspec.MaxFrame + 1024)
	err = s.serveTunnel(ctx, token, wsPeer{ctx: ctx, c: c})
	if err == nil {
		_ = c.Close(websocket.StatusNormalClosure, "")
		return
	}
	msg := err.Error()
	if len(msg) > 120 { // a close reason fits in a control frame
		msg = msg[:120]
	}
	_ = c.Close(websocket.StatusInternalError, msg)
}

// wsPeer is a WebSocket as a tunnelPeer.
type wsPeer struct {
	ctx context.Context
	c   *websocket.Conn
}

func (p wsPeer) Recv() ([]byte, bool, error) {
	typ, b, err := p.c.Read(p.ctx)
	if err != nil {
		return nil, false, err
	}
	if typ != websocket.MessageBinary {
		return nil, false, errors.New("tunnel: the caller sent a text message")
	}
	return b, len(b) == 0, nil
}

func (p wsPeer) Send(data []byte, closeWrite bool) error {
	if closeWrite {
		return p.c.Write(p.ctx, websocket.MessageBinary, nil)
	}
	return p.c.Write(p.ctx, websocket.MessageBinary, data)
}

func (p wsPeer) Opened(t *computev1.Tunnel) error {
	b, err := protojson.Marshal(t)
	if err != nil {
		return err
	}
	return p.c.Write(p.ctx, websocket.MessageText, b)
}
