package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// watchParams are the query parameters of the SSE form of events.watch.
var watchParams = map[string]bool{"tenantId": true, "types": true, "subject": true, "after": true, "includeDescendants": true}

// watchRequest reads the SSE form's query into the gRPC form's request and
// holds it to the same field limits, refusing what the gRPC form could not
// say: an unknown parameter, one given twice, includeDescendants other
// than true or false.
func watchRequest(r *http.Request) (*computev1.EventsServiceWatchRequest, error) {
	q := r.URL.Query()
	for k, vs := range q {
		switch {
		case !watchParams[k]:
			return nil, fault.New(fault.InvalidInput, k, "unknown parameter: expected tenantId, types, subject, after or includeDescendants")
		case k != "types" && len(vs) > 1:
			return nil, fault.New(fault.InvalidInput, k, "given %d times, expected once", len(vs))
		}
	}
	req := &computev1.EventsServiceWatchRequest{TenantId: q.Get("tenantId"), Subject: q.Get("subject")}
	switch q.Get("includeDescendants") {
	case "", "false":
	case "true":
		req.IncludeDescendants = true
	default:
		return nil, fault.New(fault.InvalidInput, "includeDescendants", "expected true or false")
	}
	for _, v := range q["types"] {
		for t := range strings.SplitSeq(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				req.Types = append(req.Types, t)
			}
		}
	}
	req.After = r.Header.Get("Last-Event-ID")
	if req.After == "" {
		req.After = q.Get("after")
	}
	if err := checkLimits(req); err != nil {
		return nil, err
	}
	return req, nil
}

// ServeWatch serves GET /api/compute/events/watch as Server-Sent Events:
// query tenantId (required), types (comma-separated or repeated), subject,
// includeDescendants; the Last-Event-ID header (or the after parameter)
// resumes after that cursor, else the stream starts with new events. Each
// event is one SSE message: id is the event's cursor, data its JSON.
//
// Everything is checked before the first byte: a bad request answers its
// status with the {"code","message","field"} envelope. A stream that ends
// for a reason (its key or identity revoked, its permission gone, its
// lifetime reached) ends with an SSE message of event type "error" whose
// data is that envelope.
func (s *Server) ServeWatch(w http.ResponseWriter, r *http.Request) {
	ctx := withRequestID(r.Context(), r.Header.Get(RequestIDHeader))
	fail := func(err error) { writeEnvelope(w, fault.ToStatus(err)) }
	header := r.Header.Get("Authorization")
	p, err := s.authenticate(ctx, s.proxies.FromRequest(r), header)
	if err != nil {
		fail(err)
		return
	}
	req, err := watchRequest(r)
	if err != nil {
		fail(err)
		return
	}
	tenant := req.GetTenantId()
	if err := precheck(p, tenant); err != nil {
		fail(err)
		return
	}
	f, err := eventFilter(tenant, req.GetTypes(), req.GetSubject(), req.GetAfter(), req.GetIncludeDescendants())
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
	token, err := bearer(header)
	if err != nil {
		fail(err)
		return
	}
	watch, err := s.tail.admit(p, f)
	if err != nil {
		fail(err)
		return
	}
	defer s.tail.release(watch)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	_, _ = fmt.Fprint(w, ": better-compute events\n\n")
	flusher.Flush()
	rc := http.NewResponseController(w)
	write := func(format string, args ...any) error {
		_ = rc.SetWriteDeadline(time.Now().Add(30 * time.Second))
		if _, err := fmt.Fprintf(w, format, args...); err != nil {
			return err
		}
		flusher.Flush()
		return nil
	}
	err = s.runWatch(ctx, watch, token, req.GetAfter() == "", func(e events.Event) error {
		b, err := protojson.Marshal(eventPB(e))
		if err != nil {
			return err
		}
		return write("id: %d\ndata: %s\n\n", e.Seq, b)
	}, func() error { return write(": keep-alive\n\n") })
	if err == nil || ctx.Err() != nil {
		return
	}
	env := FromStatus(fault.ToStatus(err))
	s.logger.Info("events watch ended", "request_id", RequestID(ctx), "identity", p.IdentityID, "tenant", tenant, "code", env.Code, "err", err)
	b, _ := json.Marshal(env)
	_ = write("event: error\ndata: %s\n\n", b)
}
