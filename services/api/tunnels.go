package api

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/secret"
	"github.com/bettercompute/bettercompute/pkg/tunnels"
)

// Tunnels (docs/tunnels.md). tunnels.open records the tunnel and returns a
// one-time connect token; the caller's Connect (gRPC) or WebSocket spends
// it in the API process that relays: it asks the gateway holding the node
// (TunnelDialer) to open the node's side, then copies bytes both ways,
// counting them. A watcher in that process closes its relays that must
// end (tunnels.close from any process, expiry, the opener's key or identity
// revoked, the node retired), flushes the byte counts, and closes tunnels
// nobody connected to in time. Each close is one tunnel.closed event and
// one audit row, written by whoever closed the row.

// TunnelConn is the gateway's end of an open tunnel (gateway.Tunnel).
type TunnelConn interface {
	io.Reader
	io.Writer
	// CloseWrite says the caller sent all it will.
	CloseWrite() error
	// Close ends the tunnel at both ends.
	Close(cause error)
	// Done is closed when the tunnel ended; Cause says why when the
	// gateway or the node ended it.
	Done() <-chan struct{}
	Cause() error
}

// TunnelDialer opens the node's side of a tunnel through the gateway that
// holds the node's session (gatewayID, nodes.gateway_id).
type TunnelDialer interface {
	DialTunnel(ctx context.Context, nodeID, gatewayID, tunnelID, target string) (TunnelConn, error)
}

// TunnelLimits bound tunnels; zero values take the defaults.
type TunnelLimits struct {
	// PerNode and PerTenant bound the tunnels not yet closed
	// (tunnels.DefaultPerNode, tunnels.DefaultPerTenant).
	PerNode, PerTenant int
	// CheckInterval is how often a relaying process checks its tunnels
	// and flushes their byte counts; 1 s by default.
	CheckInterval time.Duration
	// NodeBytesPerSecond and TenantBytesPerSecond shape what this process
	// relays for one node's tunnels, and one tenant's, each direction
	// apart; 0 shapes nothing (config tunnels.*BytesPerSecond).
	NodeBytesPerSecond, TenantBytesPerSecond int64
}

// shapers are the byte-rate limiters of one process's relays, by node and
// by tenant, one per direction.
type shapers struct {
	mu sync.Mutex
	m  map[string]*rate.Limiter
}

// maxShapers bounds the limiters kept; at the bound all are forgotten
// (only ever letting more through for a moment).
const maxShapers = 100_000

func (sh *shapers) get(key string, bps int64) *rate.Limiter {
	if bps <= 0 {
		return nil
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.m == nil || len(sh.m) >= maxShapers {
		sh.m = map[string]*rate.Limiter{}
	}
	l, ok := sh.m[key]
	if !ok {
		l = rate.NewLimiter(rate.Limit(bps), int(max(bps, tunnelspec.MaxFrame)))
		sh.m[key] = l
	}
	return l
}

// shape waits until every limiter allows n bytes.
func shape(ctx context.Context, n int, ls ...*rate.Limiter) error {
	for _, l := range ls {
		if l == nil {
			continue
		}
		if err := l.WaitN(ctx, n); err != nil {
			return err
		}
	}
	return nil
}

// Bounds of tunnels.open.
const (
	maxTunnelReason = 1024
	// tunnelDrain bounds the wait for a relay's last bytes after it was
	// told to close.
	tunnelDrain = 5 * time.Second
)

func tunnelPB(t tunnels.Tunnel) *computev1.Tunnel {
	return &computev1.Tunnel{
		Id: t.ID, TenantId: t.TenantID, NodeId: t.NodeID, Target: t.Target, Reason: t.Reason, OpenedBy: t.OpenedBy,
		CreateTime: ts(t.CreatedAt), ConnectTime: tsp(t.ConnectedAt), ExpireTime: ts(t.NotAfter), CloseTime: tsp(t.ClosedAt),
		CloseReason: t.CloseReason, BytesIn: t.BytesIn, BytesOut: t.BytesOut,
	}
}

func tunnelJSON(t tunnels.Tunnel) (json.RawMessage, error) {
	return protojson.Marshal(tunnelPB(t))
}

// tunnelsAPI implements computev1.TunnelsServiceServer.
type tunnelsAPI struct {
	*Server
	computev1.UnimplementedTunnelsServiceServer
}

func (s *tunnelsAPI) Open(ctx context.Context, req *computev1.TunnelsServiceOpenRequest) (*computev1.TunnelsServiceOpenResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	if _, err := tunnelspec.ParseTarget(req.GetTarget()); err != nil {
		return nil, fault.New(fault.InvalidInput, "target", "%v", err)
	}
	secs := req.GetNotAfterSeconds()
	if secs < 0 || secs > int64(tunnels.MaxNotAfter/time.Second) {
		return nil, fault.New(fault.InvalidInput, "notAfterSeconds", "expected 0 (meaning %d) to %d, got %d",
			int64(tunnels.DefaultNotAfter/time.Second), int64(tunnels.MaxNotAfter/time.Second), secs)
	}
	if secs == 0 {
		secs = int64(tunnels.DefaultNotAfter / time.Second)
	}
	if len(req.GetReason()) > maxTunnelReason {
		return nil, fault.New(fault.InvalidInput, "reason", "at most %d characters, got %d", maxTunnelReason, len(req.GetReason()))
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	p, _ := iam.PrincipalFrom(ctx)
	now := s.now()
	out := &computev1.TunnelsServiceOpenResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, _ *reconcile.Queue) (admission.Outcome, error) {
			n, err := nodestore.Get(ctx, tx, req.GetTenantId(), req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			if n.State == nodestore.StateRetired {
				return admission.Outcome{}, fault.New(fault.Conflict, "nodeId", "node %s is retired", n.ID)
			}
			o, err := tunnels.Open(ctx, tx, tunnels.OpenArgs{
				TenantID: req.GetTenantId(), NodeID: req.GetNodeId(), Target: req.GetTarget(), Reason: req.GetReason(),
				OpenedBy: p.IdentityID, OpenedByKey: p.KeyID, NotAfter: now.Add(time.Duration(secs) * time.Second),
				PerNode: s.tunnelLimits.PerNode, PerTenant: s.tunnelLimits.PerTenant,
			}, now)
			if err != nil {
				return admission.Outcome{}, err
			}
			payload, err := tunnelJSON(o.Tunnel)
			if err != nil {
				return admission.Outcome{}, err
			}
			b, err := protojson.Marshal(&computev1.TunnelsServiceOpenResponse{Tunnel: tunnelPB(o.Tunnel), ConnectToken: o.Token, TokenExpireTime: ts(o.TokenNotAfter)})
			if err != nil {
				return admission.Outcome{}, err
			}
			return admission.Outcome{Response: b, Event: outbox.Event{Type: "tunnel.opened", Resource: n.ID, Payload: payload},
				Detail: map[string]any{"tunnelId": o.Tunnel.ID, "target": o.Tunnel.Target, "reason": o.Tunnel.Reason, "notAfter": o.Tunnel.NotAfter}}, nil
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *tunnelsAPI) List(ctx context.Context, req *computev1.TunnelsServiceListRequest) (*computev1.TunnelsServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ts, err := tunnels.List(ctx, s.db, tunnels.ListFilter{TenantID: req.GetTenantId(), NodeID: req.GetNodeId(), All: req.GetIncludeClosed(), After: pg.after, Limit: pg.size})
	if err != nil {
		return nil, err
	}
	out := &computev1.TunnelsServiceListResponse{}
	for _, t := range ts {
		pb := tunnelPB(t)
		if r := s.relays.get(t.ID); r != nil { // live counts of a relay held here
			pb.BytesIn, pb.BytesOut = r.in.Load(), r.out.Load()
		}
		out.Tunnels = append(out.Tunnels, pb)
	}
	out.NextPageToken = nextPage(pg, ts, func(t tunnels.Tunnel) string { return t.ID })
	return out, nil
}

// Close closes a tunnel: a relay this process holds is stopped and closes
// the row with its exact byte counts; otherwise the row is closed here and
// the process relaying it stops within its check interval.
func (s *tunnelsAPI) Close(ctx context.Context, req *computev1.TunnelsServiceCloseRequest) (*computev1.TunnelsServiceCloseResponse, error) {
	if err := required("tunnelId", req.GetTunnelId()); err != nil {
		return nil, err
	}
	t, err := tunnels.Get(ctx, s.db, req.GetTenantId(), req.GetTunnelId())
	if err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, t.NodeID, "tunnelId")
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	p, _ := iam.PrincipalFrom(ctx)
	if r := s.relays.get(t.ID); r != nil {
		r.stop(tunnels.ClosedAPI, p.IdentityID)
		select {
		case <-r.finished:
		case <-time.After(tunnelDrain):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if t.Live() {
		if err := s.closeTunnel(ctx, t.ID, tunnels.ClosedAPI, p.IdentityID, RequestID(ctx), 0, 0); err != nil {
			return nil, err
		}
	}
	if t, err = tunnels.Get(ctx, s.db, req.GetTenantId(), req.GetTunnelId()); err != nil {
		return nil, err
	}
	return &computev1.TunnelsServiceCloseResponse{Tunnel: tunnelPB(t)}, nil
}

// closeTunnel closes the row with why, adding the last bytes; whoever
// closes it writes tunnel.closed and the audit row, in the same
// transaction.
func (s *Server) closeTunnel(ctx context.Context, id, why, actor, requestID string, in, out int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	return db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		t, closed, err := tunnels.Close(ctx, tx, id, why, in, out, s.now())
		if err != nil || !closed {
			return err
		}
		payload, err := tunnelJSON(t)
		if err != nil {
			return err
		}
		if _, err := outbox.Write(ctx, tx, outbox.Event{TenantID: t.TenantID, Type: "tunnel.closed", Resource: t.NodeID, Payload: payload}); err != nil {
			return err
		}
		if actor == "" {
			actor = "system:tunnels"
		}
		return audit.Write(ctx, tx, audit.Record{
			TenantID: t.TenantID, Actor: actor, Action: string(authz.TunnelsClose),
			Resource: authz.Resource{Type: authz.TypeNode, ID: t.NodeID, TenantID: t.TenantID}.UID(), RequestID: requestID,
			Method: computev1.TunnelsService_Close_FullMethodName,
			Detail: map[string]any{"tunnelId": t.ID, "target": t.Target, "closeReason": why, "bytesIn": t.BytesIn, "bytesOut": t.BytesOut,
				"openedBy": t.OpenedBy},
		})
	})
}

// relay is one tunnel this process relays.
type relay struct {
	t    tunnels.Tunnel
	conn TunnelConn
	// in counts bytes caller to target, out target to caller.
	in, out atomic.Int64
	// flushMu guards what was already added to the row.
	flushMu               sync.Mutex
	flushedIn, flushedOut int64
	// end carries why it must close (and who closed it) to the relay.
	end      chan [2]string
	finished chan struct{}
}

func (r *relay) stop(why, actor string) {
	select {
	case r.end <- [2]string{why, actor}:
	default: // already told
	}
}

// unflushed takes the bytes not yet added to the row.
func (r *relay) unflushed() (in, out int64) {
	r.flushMu.Lock()
	defer r.flushMu.Unlock()
	in, out = r.in.Load()-r.flushedIn, r.out.Load()-r.flushedOut
	r.flushedIn += in
	r.flushedOut += out
	return in, out
}

// relaySet is this process's relays and their watcher.
type relaySet struct {
	mu    sync.Mutex
	m     map[string]*relay
	rates shapers
	// watched is closed when watchTunnels returns.
	watched chan struct{}
}

func (rs *relaySet) get(id string) *relay {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.m[id]
}

func (rs *relaySet) all() []*relay {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := make([]*relay, 0, len(rs.m))
	for _, r := range rs.m {
		out = append(out, r)
	}
	return out
}

// watchTunnels runs until the server stops: every check interval it
// closes the relays that must end, flushes byte counts, and closes tunnels
// whose token expired unused (any process's: every API process runs it).
func (s *Server) watchTunnels() {
	defer close(s.relays.watched)
	t := time.NewTicker(s.tunnelLimits.CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-s.closing:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), s.tunnelLimits.CheckInterval+5*time.Second)
		if err := s.checkTunnels(ctx); err != nil {
			s.logger.Warn("tunnels: check", "err", err)
		}
		cancel()
	}
}

// checkTunnels is one pass of watchTunnels.
func (s *Server) checkTunnels(ctx context.Context) error {
	rs := s.relays.all()
	ids := make([]string, 0, len(rs))
	for _, r := range rs {
		ids = append(ids, r.t.ID)
	}
	doomed, err := tunnels.Doomed(ctx, s.db, ids, s.now())
	if err != nil {
		return err
	}
	var errs []error
	for _, r := range rs {
		if why, ok := doomed[r.t.ID]; ok {
			r.stop(why, "")
			continue
		}
		in, out := r.unflushed()
		if err := tunnels.AddBytes(ctx, s.db, r.t.ID, in, out); err != nil {
			errs = append(errs, err)
		}
	}
	unused, err := tunnels.Unused(ctx, s.db, s.now(), 100)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, id := range unused {
		if err := s.closeTunnel(ctx, id, tunnels.ClosedUnused, "", "", 0, 0); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// tunnelPeer is the caller's side of a relay: a gRPC Connect stream or a
// WebSocket.
type tunnelPeer interface {
	Recv() (data []byte, closeWrite bool, err error)
	Send(data []byte, closeWrite bool) error
	// Opened tells the caller the node connected.
	Opened(t *computev1.Tunnel) error
}

// serveTunnel spends token, opens the node's side through the gateway
// holding the node, and relays until the tunnel ends.
func (s *Server) serveTunnel(ctx context.Context, token string, peer tunnelPeer) error {
	if s.tunnels == nil {
		return fault.New(fault.Unsupported, "", "tunnels are not built into this process (no gateway to relay to)")
	}
	t, err := tunnels.Connect(ctx, s.db, token, s.proc, s.now())
	if fault.CodeOf(err) == fault.Unauthenticated && !s.failedAuth.Allow(clientAddrOf(ctx)) {
		return fault.New(fault.RateLimited, "", "too many failed authentications from this address; retry later")
	}
	if err != nil {
		return err
	}
	n, err := nodestore.Get(ctx, s.db, t.TenantID, t.NodeID)
	if err != nil {
		_ = s.closeTunnel(ctx, t.ID, tunnels.ClosedUnroutable, "", RequestID(ctx), 0, 0)
		return err
	}
	if n.GatewayID == "" {
		_ = s.closeTunnel(ctx, t.ID, tunnels.ClosedUnroutable, "", RequestID(ctx), 0, 0)
		return fault.New(fault.Unavailable, "nodeId", "node %s holds no session", t.NodeID)
	}
	dctx, cancel := context.WithCancel(ctx)
	stopDial := context.AfterFunc(ctx, cancel)
	conn, err := s.tunnels.DialTunnel(dctx, t.NodeID, n.GatewayID, t.ID, t.Target)
	stopDial()
	cancel()
	if err != nil {
		why := tunnels.ClosedRefused
		switch fault.CodeOf(err) {
		case fault.Unsupported, fault.Unavailable:
			why = tunnels.ClosedUnroutable
		}
		_ = s.closeTunnel(ctx, t.ID, why, "", RequestID(ctx), 0, 0)
		return err
	}
	r := &relay{t: t, conn: conn, end: make(chan [2]string, 1), finished: make(chan struct{})}
	s.relays.mu.Lock()
	if s.relays.m == nil {
		s.relays.m = map[string]*relay{}
	}
	s.relays.m[t.ID] = r
	s.relays.mu.Unlock()
	defer func() {
		s.relays.mu.Lock()
		delete(s.relays.m, t.ID)
		s.relays.mu.Unlock()
		close(r.finished)
	}()
	why, actor := s.relayTunnel(ctx, r, peer)
	in, out := r.unflushed()
	if err := s.closeTunnel(ctx, t.ID, why, actor, RequestID(ctx), in, out); err != nil {
		s.logger.Warn("tunnels: close", "tunnel", t.ID, "err", err)
	}
	if why == tunnels.ClosedByCaller {
		return nil
	}
	return fault.New(fault.Unavailable, "", "tunnel %s closed: %s", t.ID, why)
}

// relayTunnel copies both ways until both sides sent all (closed), either
// fails, or the tunnel is told to end; it returns why and who closed it.
func (s *Server) relayTunnel(ctx context.Context, r *relay, peer tunnelPeer) (why, actor string) {
	c := r.conn
	tpb := tunnelPB(r.t)
	lim := s.tunnelLimits
	inRates := []*rate.Limiter{s.relays.rates.get("in/node/"+r.t.NodeID, lim.NodeBytesPerSecond), s.relays.rates.get("in/tenant/"+r.t.TenantID, lim.TenantBytesPerSecond)}
	outRates := []*rate.Limiter{s.relays.rates.get("out/node/"+r.t.NodeID, lim.NodeBytesPerSecond), s.relays.rates.get("out/tenant/"+r.t.TenantID, lim.TenantBytesPerSecond)}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if err := peer.Opened(tpb); err != nil {
		c.Close(errors.New("the caller went away"))
		return tunnels.ClosedByCaller, r.t.OpenedBy
	}
	ended := make(chan string, 2)
	halves := make(chan struct{}, 2)
	connWhy := func() string {
		select {
		case <-c.Done():
			if c.Cause() != nil {
				return tunnels.ClosedSession
			}
		default:
		}
		return tunnels.ClosedError
	}
	go func() { // caller to node
		for {
			data, cw, err := peer.Recv()
			if err != nil {
				ended <- tunnels.ClosedByCaller
				return
			}
			if len(data) > tunnelspec.MaxFrame {
				ended <- tunnels.ClosedError
				return
			}
			if len(data) > 0 {
				if shape(rctx, len(data), inRates...) != nil {
					return // the relay ended
				}
				n, err := c.Write(data)
				r.in.Add(int64(n))
				if err != nil {
					ended <- connWhy()
					return
				}
			}
			if cw {
				if err := c.CloseWrite(); err != nil {
					ended <- connWhy()
					return
				}
				halves <- struct{}{}
				return
			}
		}
	}()
	down := make(chan struct{})
	go func() { // node to caller
		defer close(down)
		buf := make([]byte, tunnelspec.MaxFrame)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				if shape(rctx, n, outRates...) != nil {
					return // the relay ended
				}
				if serr := peer.Send(buf[:n], false); serr != nil {
					ended <- tunnels.ClosedByCaller
					return
				}
				r.out.Add(int64(n))
			}
			if errors.Is(err, io.EOF) {
				if serr := peer.Send(nil, true); serr != nil {
					ended <- tunnels.ClosedByCaller
					return
				}
				halves <- struct{}{}
				return
			}
			if err != nil {
				ended <- connWhy()
				return
			}
		}
	}()
	actor = r.t.OpenedBy
	for done := 0; done < 2 && why == ""; {
		select {
		case <-halves:
			done++
			if done == 2 {
				why = tunnels.ClosedByCaller
			}
		case why = <-ended:
		case e := <-r.end:
			why, actor = e[0], e[1]
		case <-c.Done():
			why = connWhy()
		case <-s.closing:
			why = tunnels.ClosedAPIStopped
		case <-ctx.Done():
			why = tunnels.ClosedByCaller
		}
	}
	if why != tunnels.ClosedByCaller && why != tunnels.ClosedAPI {
		actor = ""
	}
	c.Close(errors.New(why))
	cancel() // a shaped direction stops waiting
	select { // the last bytes the node sent, counted
	case <-down:
	case <-time.After(tunnelDrain):
	}
	return why, actor
}

// tunnelRulesOf reads a tunnels allowlist ({"allow": [rules]}) as
// pools.update and nodes.update take it, checked with the node's own rules
// (proto/tunnelspec); nil or empty is no rules.
func tunnelRulesOf(st *structpb.Struct, field string) ([]*agentv1.TunnelRule, error) {
	ts := &agentv1.TunnelSettings{}
	if _, err := specSection(st, ts, field); err != nil {
		return nil, err
	}
	if len(ts.GetNarrow()) > 0 {
		return nil, fault.New(fault.InvalidInput, field+".narrow", "give the rules as allow; a node's rules narrow its pool's")
	}
	if bad := tunnelspec.Validate(ts); len(bad) > 0 {
		return nil, fault.New(fault.InvalidInput, field, "%s", bad[0])
	}
	return ts.GetAllow(), nil
}

type clientAddrKey struct{}

// withClientAddr and clientAddrOf carry the caller's address (the key of
// the failed-authentication budget) to serveTunnel.
func withClientAddr(ctx context.Context, addr string) context.Context {
	return context.WithValue(ctx, clientAddrKey{}, addr)
}

func clientAddrOf(ctx context.Context) string {
	a, _ := ctx.Value(clientAddrKey{}).(string)
	return a
}

// processID names this API process in tunnels.relay_process.
func processID() string {
	h, _ := os.Hostname()
	return h + "/" + secret.Random(5)
}

// Connect serves TunnelsService.Connect (anonymous: the connect token is
// the credential).
func (s *tunnelsAPI) Connect(stream computev1.TunnelsService_ConnectServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	if first.GetConnectToken() == "" || len(first.GetData()) > 0 || first.GetCloseWrite() {
		return fault.New(fault.InvalidInput, "connectToken", "the first message carries the connect token and nothing else")
	}
	return s.serveTunnel(stream.Context(), first.GetConnectToken(), grpcPeer{stream: stream})
}

// grpcPeer is a Connect stream as a tunnelPeer.
type grpcPeer struct {
	stream computev1.TunnelsService_ConnectServer
}

func (p grpcPeer) Recv() ([]byte, bool, error) {
	m, err := p.stream.Recv()
	if errors.Is(err, io.EOF) {
		return nil, true, nil // CloseSend is the half-close too
	}
	if err != nil {
		return nil, false, err
	}
	return m.GetData(), m.GetCloseWrite(), nil
}

func (p grpcPeer) Send(data []byte, closeWrite bool) error {
	return p.stream.Send(&computev1.TunnelsServiceConnectResponse{Data: data, CloseWrite: closeWrite})
}

func (p grpcPeer) Opened(t *computev1.Tunnel) error {
	return p.stream.Send(&computev1.TunnelsServiceConnectResponse{Tunnel: t})
}
