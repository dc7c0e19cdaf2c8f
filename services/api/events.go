package api

import (
	"context"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// WatchPath serves events.watch as Server-Sent Events.
const WatchPath = "/api/compute/events/watch"

// Bounds of event filters.
const (
	maxEventTypes  = 32
	maxSubjectLen  = 128
	watchBatch     = 500
	watchPoll      = 2 * time.Second
	watchPollNoBus = 250 * time.Millisecond
	sseKeepAlive   = 15 * time.Second
)

// eventsAPI implements computev1.EventsServiceServer.
type eventsAPI struct {
	*Server
	computev1.UnimplementedEventsServiceServer
}

// eventPB renders an event as the API shows it.
func eventPB(e events.Event) *computev1.Event {
	data := &structpb.Struct{}
	if len(e.Payload) > 0 {
		if err := protojson.Unmarshal(e.Payload, data); err != nil {
			data, _ = structpb.NewStruct(map[string]any{"value": string(e.Payload)})
		}
	}
	return &computev1.Event{
		Id: events.EventID(e.ID), Cursor: events.Cursor(e.Seq), TenantId: e.TenantID, Type: e.Type,
		Subject: e.Resource, Time: ts(e.At), Data: data,
	}
}

// eventFilter validates a list or watch request's filter.
func eventFilter(tenant string, types []string, subject, after string, descendants bool) (events.Filter, error) {
	if len(types) > maxEventTypes {
		return events.Filter{}, fault.New(fault.InvalidInput, "types", "at most %d, got %d", maxEventTypes, len(types))
	}
	for _, t := range types {
		if err := events.CheckPattern(t); err != nil {
			return events.Filter{}, fault.New(fault.InvalidInput, "types", "%v", err)
		}
	}
	if len(subject) > maxSubjectLen {
		return events.Filter{}, fault.New(fault.InvalidInput, "subject", "at most %d characters", maxSubjectLen)
	}
	if !utf8.ValidString(subject) || strings.ContainsFunc(subject, unicode.IsControl) {
		return events.Filter{}, fault.New(fault.InvalidInput, "subject", "expected a resource id: no control characters, valid UTF-8")
	}
	seq, err := events.ParseCursor(after)
	if err != nil {
		return events.Filter{}, fault.New(fault.InvalidInput, "after", "%v", err)
	}
	return events.Filter{TenantID: tenant, Descendants: descendants, Types: types, Resource: subject, After: seq}, nil
}

func (s *eventsAPI) List(ctx context.Context, req *computev1.EventsServiceListRequest) (*computev1.EventsServiceListResponse, error) {
	size, err := pageSize(req.GetPageSize())
	if err != nil {
		return nil, err
	}
	f, err := eventFilter(req.GetTenantId(), req.GetTypes(), req.GetSubject(), req.GetAfter(), req.GetIncludeDescendants())
	if err != nil {
		return nil, err
	}
	f.Limit = size
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	evs, err := events.List(ctx, s.db, f)
	if err != nil {
		return nil, err
	}
	p, _ := iam.PrincipalFrom(ctx)
	visible := s.descendantDecider(p, authz.EventsList, f.TenantID)
	out := &computev1.EventsServiceListResponse{}
	for _, e := range evs {
		ok, err := visible(ctx, e.TenantID)
		if err != nil {
			return nil, err
		}
		if ok {
			out.Events = append(out.Events, eventPB(e))
		}
	}
	if len(evs) == size {
		// The page is cut by size, whatever a descendant's policies hid.
		out.NextPageToken = events.Cursor(evs[len(evs)-1].Seq)
	}
	return out, nil
}

// descendantDecider returns a function that says whether p may see the
// events of a tenant below tenant (whose own decision the caller made):
// includeDescendants decides action on each descendant included, with its
// policies, so a descendant's forbid hides its events. Decisions are
// remembered until reset.
func (s *Server) descendantDecider(p iam.Principal, action authz.Action, tenant string) func(ctx context.Context, t string) (bool, error) {
	seen := map[string]bool{}
	return func(ctx context.Context, t string) (bool, error) {
		if t == tenant {
			return true, nil
		}
		if ok, done := seen[t]; done {
			return ok, nil
		}
		err := s.authz.Authorize(ctx, nil, p, action, authz.TenantResource(t))
		switch {
		case err == nil:
			seen[t] = true
		case fault.CodeOf(err) == fault.AccessDenied:
			seen[t] = false
		default:
			return false, err
		}
		return seen[t], nil
	}
}

func (s *eventsAPI) Watch(req *computev1.EventsServiceWatchRequest, stream computev1.EventsService_WatchServer) error {
	ctx := stream.Context()
	p, ok := iam.PrincipalFrom(ctx)
	if !ok {
		return fault.New(fault.Unauthenticated, "authorization", "no credential")
	}
	if err := precheck(p, req.GetTenantId()); err != nil {
		return err
	}
	f, err := eventFilter(req.GetTenantId(), req.GetTypes(), req.GetSubject(), req.GetAfter(), req.GetIncludeDescendants())
	if err != nil {
		return err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return err
	}
	md, _ := metadata.FromIncomingContext(ctx)
	token, err := bearer(first(md, "authorization"))
	if err != nil {
		return err
	}
	w, err := s.tail.admit(p, f)
	if err != nil {
		return err
	}
	defer s.tail.release(w)
	return s.runWatch(ctx, w, token, req.GetAfter() == "", func(e events.Event) error {
		return stream.Send(&computev1.EventsServiceWatchResponse{Event: eventPB(e)})
	}, nil)
}

// runWatch sends the events w's filter selects, in commit order, until ctx
// ends or the server closes its streams: first those after f.After (from
// PostgreSQL, however old, within retention, in bounded chunks), then each
// new one the process's tailer hands it. With fromNow the watch starts at
// the newest event instead. idle, when set, is called every sseKeepAlive
// (SSE keep-alives).
//
// A watch is authorized again — token authenticated, the decision made
// again — every authentication-cache TTL, at once when an event revokes
// its key or identity (looked up afresh) or policies change, and the
// stream ends with that error (UNAUTHENTICATED, ACCESS_DENIED) when it no
// longer is. It ends UNAVAILABLE after events.maxStreamLifetime, naming the
// cursor to resume after.
func (s *Server) runWatch(ctx context.Context, w *watch, token string, fromNow bool, send func(events.Event) error, idle func() error) error {
	lifetime := time.NewTimer(s.tail.limits.MaxLifetime)
	defer lifetime.Stop()
	ttl := time.NewTicker(s.authn.TTL())
	defer ttl.Stop()
	var keepAlive <-chan time.Time
	if idle != nil {
		k := time.NewTicker(sseKeepAlive)
		defer k.Stop()
		keepAlive = k.C
	}
	tenant := w.f.TenantID
	visible := s.descendantDecider(w.p, authz.EventsWatch, tenant)
	reauth := func(fresh bool) error {
		auth := s.authn.Authenticate
		if fresh {
			auth = s.authn.Recheck
		}
		p, err := auth(ctx, token)
		if err != nil {
			return err
		}
		if err := precheck(p, tenant); err != nil {
			return err
		}
		if err := s.authz.Authorize(ctx, nil, p, authz.EventsWatch, authz.TenantResource(tenant)); err != nil {
			return err
		}
		visible = s.descendantDecider(p, authz.EventsWatch, tenant)
		return nil
	}
	cursor := w.f.After
	emit := func(e events.Event) error {
		if e.Seq <= cursor {
			return nil
		}
		cursor = e.Seq
		ok, err := visible(ctx, e.TenantID)
		if err != nil || !ok {
			return err
		}
		return send(e)
	}
	ended := func() error {
		return fault.New(fault.Unavailable, "", "this stream reached its lifetime (events.maxStreamLifetime); resume after cursor %d", cursor)
	}
	// between handles, without waiting, what may end or re-authorize the
	// watch during a replay; done says the stream ends.
	between := func() (done bool, err error) {
		select {
		case <-ctx.Done():
			return true, nil
		case <-s.closing:
			return true, nil
		case <-lifetime.C:
			return true, ended()
		case <-w.recheck:
			err = reauth(true)
		case <-ttl.C:
			err = reauth(false)
		case <-keepAlive:
			err = idle()
		default:
		}
		return err != nil, err
	}
	first := true
	for {
		head, err := s.tail.join(ctx, w)
		if err != nil {
			return err
		}
		if first && fromNow {
			cursor = head
		}
		first = false
		for cursor < head {
			f := w.f
			f.After, f.Limit = cursor, watchBatch
			evs, next, err := events.Scan(ctx, s.db, f, head, replayWindow)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			for _, e := range evs {
				if err := emit(e); err != nil {
					return err
				}
			}
			cursor = max(cursor, next)
			if done, err := between(); done {
				return err
			}
		}
		if err := s.follow(ctx, w, &cursor, emit, lifetime.C, ttl.C, keepAlive, ended, reauth, idle); err != nil || ctx.Err() != nil {
			return err
		}
		select {
		case <-s.closing:
			return nil
		default:
		}
	}
}

// follow sends what the tailer hands w until the stream ends (an error,
// or nil with ctx done or the server closing) or w is cut loose for
// lagging (nil, after sending what it had buffered and moving cursor past
// what the tailer handed over).
func (s *Server) follow(ctx context.Context, w *watch, cursor *int64, emit func(events.Event) error,
	lifetime, ttl, keepAlive <-chan time.Time, ended func() error, reauth func(fresh bool) error, idle func() error,
) error {
	for {
		var err error
		select {
		case e := <-w.ch:
			err = emit(e)
		case <-w.lagged:
			for len(w.ch) > 0 {
				if err := emit(<-w.ch); err != nil {
					return err
				}
			}
			*cursor = max(*cursor, w.lagAt)
			return nil
		case <-ctx.Done():
			return nil
		case <-s.closing:
			return nil
		case <-lifetime:
			return ended()
		case <-w.recheck:
			err = reauth(true)
		case <-ttl:
			err = reauth(false)
		case <-keepAlive:
			err = idle()
		}
		if err != nil {
			return err
		}
	}
}

// watchCall is the admission call of an SSE watch, which does not pass
// through gRPC.
func (s *Server) watchCall(ctx context.Context, p iam.Principal, tenant string) admission.Call {
	return admission.Call{
		Principal: p, Method: computev1.EventsService_Watch_FullMethodName, Action: authz.EventsWatch,
		TenantID: tenant, RequestID: RequestID(ctx),
	}
}

// CloseStreams ends every watch, so a server shutting down does not wait
// for streams that never go idle. Register it with
// http.Server.RegisterOnShutdown.
func (s *Server) CloseStreams() { s.closeOnce.Do(func() { close(s.closing) }) }
