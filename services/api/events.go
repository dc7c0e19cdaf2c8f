package api

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/wake"
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
	out := &computev1.EventsServiceListResponse{}
	for _, e := range evs {
		out.Events = append(out.Events, eventPB(e))
	}
	if len(evs) == size {
		out.NextPageToken = events.Cursor(evs[len(evs)-1].Seq)
	}
	return out, nil
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
	return s.watchEvents(ctx, f, req.GetAfter() == "", func(e events.Event) error {
		return stream.Send(&computev1.EventsServiceWatchResponse{Event: eventPB(e)})
	}, nil)
}

// watchEvents sends the events f selects, in commit order, until ctx ends:
// first those after f.After (from PostgreSQL, however old, within
// retention), then each new one as the event stream announces it. With
// fromNow the watch starts at the newest event instead. idle, when set, is
// called when nothing happened for a while (SSE keep-alives).
//
// The stream only wakes the watcher: events are always read from the
// database after the cursor, so a watcher sees exactly the committed,
// sequenced events, in order, whatever the bus dropped.
func (s *Server) watchEvents(ctx context.Context, f events.Filter, fromNow bool, send func(events.Event) error, idle func() error) error {
	wake := s.watchHub().subscribe()
	defer s.watchHub().unsubscribe(wake)
	if fromNow {
		head, err := events.Head(ctx, s.db)
		if err != nil {
			return err
		}
		f.After = head
	}
	f.Limit = watchBatch
	lastSent := time.Now()
	for {
		evs, err := events.List(ctx, s.db, f)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		for _, e := range evs {
			if err := send(e); err != nil {
				return err
			}
			f.After = e.Seq
			lastSent = time.Now()
		}
		if len(evs) == watchBatch {
			continue
		}
		poll := watchPoll
		if s.nc == nil || !s.nc.IsConnected() {
			poll = watchPollNoBus
		}
		t := time.NewTimer(poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-s.closing:
			t.Stop()
			return nil
		case <-wake:
		case <-t.C:
		}
		t.Stop()
		if idle != nil && time.Since(lastSent) > sseKeepAlive {
			if err := idle(); err != nil {
				return err
			}
			lastSent = time.Now()
		}
	}
}

// watchHub fans the event stream's messages out to watchers as wake-ups.
type watchHub struct {
	mu   sync.Mutex
	subs map[chan struct{}]bool
	sub  *nats.Subscription
}

func (s *Server) watchHub() *watchHub {
	s.watchOnce.Do(func() {
		h := &watchHub{subs: map[chan struct{}]bool{}}
		if s.nc != nil {
			sub, err := wake.SubscribeEvents(s.nc, h.wake)
			if err != nil {
				s.logger.Warn("subscribe to the event stream; watches poll the database", "err", err)
			} else {
				h.sub = sub
			}
		}
		s.watch = h
	})
	return s.watch
}

func (h *watchHub) subscribe() chan struct{} {
	c := make(chan struct{}, 1)
	h.mu.Lock()
	h.subs[c] = true
	h.mu.Unlock()
	return c
}

func (h *watchHub) unsubscribe(c chan struct{}) {
	h.mu.Lock()
	delete(h.subs, c)
	h.mu.Unlock()
}

func (h *watchHub) wake() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for c := range h.subs {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

func (h *watchHub) stop() {
	if h != nil && h.sub != nil {
		_ = h.sub.Unsubscribe()
	}
}

// ServeWatch serves GET /api/compute/events/watch as Server-Sent Events:
// query tenantId (required), types (comma-separated or repeated), subject,
// includeDescendants; the Last-Event-ID header (or the after parameter)
// resumes after that cursor, else the stream starts with new events. Each
// event is one SSE message: id is the event's cursor, data its JSON.
func (s *Server) ServeWatch(w http.ResponseWriter, r *http.Request) {
	ctx := withRequestID(r.Context(), r.Header.Get(RequestIDHeader))
	fail := func(err error) { writeEnvelope(w, fault.ToStatus(err)) }
	p, err := s.authenticate(ctx, s.proxies.FromRequest(r), r.Header.Get("Authorization"))
	if err != nil {
		fail(err)
		return
	}
	q := r.URL.Query()
	tenant := q.Get("tenantId")
	if err := precheck(p, tenant); err != nil {
		fail(err)
		return
	}
	var types []string
	for _, v := range q["types"] {
		for t := range strings.SplitSeq(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				types = append(types, t)
			}
		}
	}
	after := r.Header.Get("Last-Event-ID")
	if after == "" {
		after = q.Get("after")
	}
	f, err := eventFilter(tenant, types, q.Get("subject"), after, q.Get("includeDescendants") == "true")
	if err != nil {
		fail(err)
		return
	}
	ctx = iam.WithPrincipal(ctx, p)
	if err := s.adm.Read(ctx, s.watchCall(ctx, p, tenant), authz.TenantResource(tenant)); err != nil {
		fail(err)
		return
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		fail(fault.New(fault.Unsupported, "", "this connection cannot stream"))
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	_, _ = fmt.Fprint(w, ": better-compute events\n\n")
	flusher.Flush()
	rc := http.NewResponseController(w)
	_ = s.watchEvents(ctx, f, after == "", func(e events.Event) error {
		b, err := protojson.Marshal(eventPB(e))
		if err != nil {
			return err
		}
		_ = rc.SetWriteDeadline(time.Now().Add(30 * time.Second))
		if _, err := fmt.Fprintf(w, "id: %d\ndata: %s\n\n", e.Seq, b); err != nil {
			return err
		}
		flusher.Flush()
		return nil
	}, func() error {
		_ = rc.SetWriteDeadline(time.Now().Add(30 * time.Second))
		if _, err := fmt.Fprint(w, ": keep-alive\n\n"); err != nil {
			return err
		}
		flusher.Flush()
		return nil
	})
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
