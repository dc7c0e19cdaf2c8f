package console

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// List page bounds.
const (
	// maxScanPages bounds the pages of listPage one list walks: events.list
	// reads forward from the start of the log, so a page of the newest
	// events reads at most this many pages and keeps the last ones.
	maxScanPages = 20
	// pageEvents is how many events the events page lists.
	pageEvents = 200
	// pageCommands is how many commands the commands page lists.
	pageCommands = 100
	// pageReservations is how many reservations the reservations page lists.
	pageReservations = 500
	// pageAudit is how many audit records the audit page lists.
	pageAudit = 200
	// maxGPUs bounds the create form's GPU count (the API's own maximum
	// decides below it).
	maxGPUs = 4096
	// maxSlices bounds the slice count with a MIG profile (the API's).
	maxSlices = 1024
	// maxProfile bounds the form's MIG profile.
	maxProfile = 64
	// maxDataChars bounds the JSON of an event or result the pages print.
	maxDataChars = 4000
)

// streamURL is the console's events stream for the session's tenant.
func streamURL(s *session, types, subject, after string) string {
	v := url.Values{"tenantId": {s.Tenant}}
	if types != "" {
		v.Set("types", types)
	}
	if subject != "" {
		v.Set("subject", subject)
	}
	if after != "" {
		v.Set("after", after)
	}
	return Prefix + "events/stream?" + v.Encode()
}

// scanEvents reads events.list forward from req.After, at most
// maxScanPages pages, and returns the last keep events (oldest first), the
// cursor of the last one read, and whether the log goes on past the pages
// read.
func (c *Console) scanEvents(s *session, req *computev1.EventsServiceListRequest, keep int) (evs []*computev1.Event, last string, truncated bool, err error) {
	ec := computev1.NewEventsServiceClient(c.cfg.Conn)
	req.PageSize = listPage
	for range maxScanPages {
		resp, err := ec.List(s.ctx, req)
		if err != nil {
			return evs, last, false, err
		}
		got := resp.GetEvents()
		if len(got) > 0 {
			last = got[len(got)-1].GetCursor()
		}
		evs = append(evs, got...)
		if len(evs) > keep {
			evs = slices.Delete(evs, 0, len(evs)-keep)
		}
		if resp.GetNextPageToken() == "" {
			return evs, last, false, nil
		}
		req.After = resp.GetNextPageToken()
	}
	return evs, last, true, nil
}

func reverse[T any](s []T) { slices.Reverse(s) }

// eventJSON is an event's data as compact JSON, bounded.
func eventJSON(e *computev1.Event) string {
	if e.GetData() == nil {
		return ""
	}
	b, err := protojson.MarshalOptions{}.Marshal(e.GetData())
	if err != nil {
		return ""
	}
	return clip(compact(b), maxDataChars)
}

func compact(b []byte) string {
	var v any
	if json.Unmarshal(b, &v) != nil {
		return string(b)
	}
	out, _ := json.Marshal(v)
	return string(out)
}

// clip cuts s to at most n bytes on a rune boundary.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

func utf8RuneStart(b byte) bool { return b&0xC0 != 0x80 }

// eventPattern turns the events page's type filter into a watch pattern:
// an exact type, a pattern (node.*, *), or a prefix (node → node.*).
func eventPattern(v string) (string, error) {
	if v == "" {
		return "", nil
	}
	if v == "*" || strings.HasSuffix(v, ".*") {
		return v, events.CheckPattern(v)
	}
	if _, ok := events.Lookup(v); ok {
		return v, nil
	}
	p := strings.TrimSuffix(v, ".") + ".*"
	return p, events.CheckPattern(p)
}

type eventsData struct {
	Type, Subject string
	Events        []*computev1.Event
	Truncated     bool
}

func (c *Console) eventsPage(_ http.ResponseWriter, r *http.Request, s *session, p *page) (string, error) {
	p.Title, p.Active = "Events", "events"
	d := &eventsData{}
	p.Data = d
	var err error
	if d.Type, err = query(r, "type", 128); err != nil {
		return "events", err
	}
	if d.Subject, err = query(r, "subject", maxField); err != nil {
		return "events", err
	}
	pattern, err := eventPattern(d.Type)
	if err != nil {
		return "events", fault.New(fault.InvalidInput, "type", "%v", err)
	}
	req := &computev1.EventsServiceListRequest{TenantId: s.Tenant, Subject: d.Subject}
	if pattern != "" {
		req.Types = []string{pattern}
	}
	evs, last, truncated, err := c.scanEvents(s, req, pageEvents)
	if err != nil {
		return "events", err
	}
	reverse(evs)
	d.Events, d.Truncated = evs, truncated
	after := cursorOr(last, "0")
	if truncated {
		after = "" // live from now: replaying the rest would be too much
	}
	p.Stream = streamURL(s, pattern, d.Subject, after)
	return "events", nil
}

// commandRow is a command as the commands page shows it, from its events.
type commandRow struct {
	ID, NodeID, Kind, State, Reason, Time string
}

type commandsData struct {
	Commands  []commandRow
	Truncated bool
}

// commandsPage lists the tenant's recent commands: commands.list is per
// node, so the list is the tenant's command.* events folded by command.
func (c *Console) commandsPage(_ http.ResponseWriter, _ *http.Request, s *session, p *page) (string, error) {
	p.Title, p.Active = "Commands", "commands"
	d := &commandsData{}
	p.Data = d
	evs, _, truncated, err := c.scanEvents(s, &computev1.EventsServiceListRequest{TenantId: s.Tenant, Types: []string{"command.*"}}, 20*pageCommands)
	if err != nil {
		return "commands", err
	}
	d.Truncated = truncated
	at := map[string]int{}
	for _, e := range evs {
		id := e.GetSubject()
		i, ok := at[id]
		if !ok {
			i = len(d.Commands)
			at[id] = i
			d.Commands = append(d.Commands, commandRow{ID: id})
		}
		row := &d.Commands[i]
		row.Time = e.GetTime().AsTime().UTC().Format("2006-01-02 15:04:05")
		f := e.GetData().GetFields()
		if cmd := f["command"].GetStructValue().GetFields(); cmd != nil { // command.requested, command.cancel_requested
			f = cmd
		}
		row.NodeID, row.Kind = cmp.Or(f["nodeId"].GetStringValue(), row.NodeID), cmp.Or(f["kind"].GetStringValue(), row.Kind)
		switch e.GetType() {
		case "command.requested":
			row.State = cmp.Or(row.State, f["state"].GetStringValue())
		case "command.cancel_requested":
		default:
			row.State, row.Reason = strings.TrimPrefix(e.GetType(), "command."), f["reason"].GetStringValue()
		}
	}
	reverse(d.Commands)
	d.Commands = d.Commands[:min(len(d.Commands), pageCommands)]
	p.Stream = streamURL(s, "command.*", "", "")
	return "commands", nil
}

type commandData struct {
	Command *computev1.Command
	State   string
	Payload string
	Result  string
	Final   bool
}

// terminal are the command states that do not change again.
var terminal = []string{"succeeded", "failed", "expired", "cancelled"}

func (c *Console) commandPage(_ http.ResponseWriter, r *http.Request, s *session, p *page) (string, error) {
	id := r.PathValue("id")
	p.Title, p.Active = "Command "+id, "commands"
	d := &commandData{}
	p.Data = d
	if len(id) > maxField {
		return "command", fault.New(fault.InvalidInput, "commandId", "at most %d characters, got %d", maxField, len(id))
	}
	node, err := query(r, "node", maxField)
	if err != nil {
		return "command", err
	}
	evs, last, _, err := c.scanEvents(s, &computev1.EventsServiceListRequest{TenantId: s.Tenant, Subject: id, Types: []string{"command.*"}}, 50)
	if err != nil {
		return "command", err
	}
	if node == "" { // find it in the command's events
		for _, e := range evs {
			f := e.GetData().GetFields()
			node = cmp.Or(f["nodeId"].GetStringValue(), f["command"].GetStructValue().GetFields()["nodeId"].GetStringValue())
			if node != "" {
				break
			}
		}
		if node == "" {
			return "command", fault.New(fault.NotFound, "commandId", "no command %q in tenant %s (or its events are not published yet: add ?node=<node id>)", id, s.Tenant)
		}
	}
	got, err := computev1.NewCommandsServiceClient(c.cfg.Conn).Get(s.ctx, &computev1.CommandsServiceGetRequest{TenantId: s.Tenant, NodeId: node, CommandId: id})
	if err != nil {
		return "command", err
	}
	cmd := got.GetCommand()
	d.Command, d.State = cmd, cmd.GetState()
	d.Final = slices.Contains(terminal, d.State)
	if cmd.GetPayload() != nil {
		b, _ := protojson.Marshal(cmd.GetPayload())
		d.Payload = clip(compact(b), maxDataChars)
	}
	if cmd.GetResult() != nil {
		b, _ := protojson.Marshal(cmd.GetResult())
		d.Result = clip(compact(b), maxDataChars)
	}
	if !d.Final {
		p.Stream = streamURL(s, "command.*", id, cursorOr(last, "0"))
	}
	return "command", nil
}

type reservationsData struct {
	Reservations []*computev1.Reservation
	Pools        []*computev1.Pool
	Idem         string
	Form         struct{ Pool, GPUs, Name, Model, MigProfile string }
	Truncated    bool
}

func (c *Console) reservationsPage(_ http.ResponseWriter, _ *http.Request, s *session, p *page) (string, error) {
	return "reservations", c.loadReservations(s, p)
}

func (c *Console) loadReservations(s *session, p *page) error {
	p.Title, p.Active = "Reservations", "reservations"
	d, _ := p.Data.(*reservationsData)
	if d == nil {
		d = &reservationsData{}
		p.Data = d
	}
	d.Idem = newIdem()
	pools, err := c.listPools(s)
	if err != nil {
		return err
	}
	d.Pools = pools
	rc := computev1.NewReservationsServiceClient(c.cfg.Conn)
	token := ""
	var all []*computev1.Reservation
	for range maxScanPages {
		resp, err := rc.List(s.ctx, &computev1.ReservationsServiceListRequest{TenantId: s.Tenant, PageSize: listPage, PageToken: token})
		if err != nil {
			return err
		}
		all = append(all, resp.GetReservations()...)
		if len(all) > pageReservations {
			all = slices.Delete(all, 0, len(all)-pageReservations)
		}
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	d.Truncated = token != ""
	slices.SortStableFunc(all, func(a, b *computev1.Reservation) int {
		return b.GetCreateTime().AsTime().Compare(a.GetCreateTime().AsTime())
	})
	d.Reservations = all
	p.Stream = streamURL(s, "reservation.*", "", "")
	return nil
}

// placement is a reservation's bookings by node: "node: GPU, GPU".
type placement struct {
	Node    string
	Devices []placed
}

// placed is one booked device: a GPU, or a MIG slice with its profile and
// parent GPU.
type placed struct{ ID, Profile, Parent string }

func placementOf(r *computev1.Reservation) []placement {
	var out []placement
	at := map[string]int{}
	for _, b := range r.GetBookings() {
		i, ok := at[b.GetNodeId()]
		if !ok {
			i = len(out)
			at[b.GetNodeId()] = i
			out = append(out, placement{Node: b.GetNodeId()})
		}
		out[i].Devices = append(out[i].Devices, placed{ID: b.GetDeviceId(), Profile: b.GetMigProfile(), Parent: b.GetParentDeviceId()})
	}
	return out
}

func (c *Console) reservationsURL(s *session) string {
	u := Prefix + "reservations"
	if s.Selected() {
		u += "?tenant=" + url.QueryEscape(s.Tenant)
	}
	return u
}

func (c *Console) createReservation(w http.ResponseWriter, r *http.Request, s *session) {
	d := &reservationsData{}
	err := func() error {
		var err error
		if d.Form.Pool, err = field(r, "pool", maxField); err != nil {
			return err
		}
		if d.Form.GPUs, err = field(r, "gpus", 8); err != nil {
			return err
		}
		if d.Form.Name, err = field(r, "name", 64); err != nil {
			return err
		}
		if d.Form.Model, err = field(r, "model", maxField); err != nil {
			return err
		}
		if d.Form.MigProfile, err = field(r, "migProfile", maxProfile); err != nil {
			return err
		}
		if d.Form.Pool == "" {
			return fault.New(fault.InvalidInput, "pool", "choose a pool")
		}
		n, err := strconv.Atoi(d.Form.GPUs)
		if err != nil || n < 1 || n > maxGPUs {
			return fault.New(fault.InvalidInput, "gpus", "expected a GPU count from 1 to %d, got %q", maxGPUs, d.Form.GPUs)
		}
		if d.Form.MigProfile != "" && n > maxSlices {
			return fault.New(fault.InvalidInput, "gpus", "expected a slice count from 1 to %d with a MIG profile, got %d", maxSlices, n)
		}
		if d.Form.Name != "" && !idemRE.MatchString(d.Form.Name) {
			return fault.New(fault.InvalidInput, "name", "expected 1 to 64 letters, digits, _ or -")
		}
		idem, err := field(r, "idem", maxField)
		if err != nil {
			return err
		}
		if idem != "" && !idemRE.MatchString(idem) {
			return fault.New(fault.InvalidInput, "idem", "expected 1 to 64 letters, digits, _ or -")
		}
		pools, err := c.listPools(s)
		if err != nil {
			return err
		}
		req := &computev1.ReservationsServiceCreateRequest{TenantId: s.Tenant, PoolId: resolvePool(pools, d.Form.Pool), GpuCount: int32(n)}
		if d.Form.MigProfile != "" {
			// Slices: the count goes in count, as the API takes it.
			req.GpuCount, req.MigProfile, req.Count = 0, d.Form.MigProfile, int32(n)
		}
		if d.Form.Model != "" {
			req.Constraints = &computev1.Constraints{Model: d.Form.Model}
		}
		// A name makes the create idempotent by name; without one, the
		// form's own key makes a double submit one reservation.
		switch {
		case d.Form.Name != "":
			req.IdempotencyKey = "console-name-" + d.Form.Name
		case idem != "":
			req.IdempotencyKey = "console-" + idem
		}
		_, err = computev1.NewReservationsServiceClient(c.cfg.Conn).Create(s.ctx, req)
		return err
	}()
	if err != nil {
		p := &page{S: s, Data: d}
		if lerr := c.loadReservations(s, p); lerr != nil {
			err = lerr
		}
		c.render(w, p, "reservations", err)
		return
	}
	http.Redirect(w, r, c.reservationsURL(s), http.StatusSeeOther)
}

func (c *Console) releaseReservation(w http.ResponseWriter, r *http.Request, s *session) {
	id := r.PathValue("id")
	_, err := computev1.NewReservationsServiceClient(c.cfg.Conn).Release(s.ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: s.Tenant, ReservationId: id})
	if err != nil {
		p := &page{S: s}
		if lerr := c.loadReservations(s, p); lerr != nil {
			err = lerr
		}
		c.render(w, p, "reservations", err)
		return
	}
	http.Redirect(w, r, c.reservationsURL(s), http.StatusSeeOther)
}

type auditData struct {
	Records []*computev1.AuditRecord
	Action  string
	Verify  *computev1.AuditServiceVerifyResponse
	// VerifyError is why audit.verify failed, when it did.
	VerifyError *note
}

func (c *Console) auditPage(_ http.ResponseWriter, r *http.Request, s *session, p *page) (string, error) {
	return "audit", c.loadAudit(r, s, p)
}

func (c *Console) loadAudit(r *http.Request, s *session, p *page) error {
	p.Title, p.Active = "Audit", "audit"
	d, _ := p.Data.(*auditData)
	if d == nil {
		d = &auditData{}
		p.Data = d
	}
	var err error
	if d.Action, err = query(r, "action", maxField); err != nil {
		return err
	}
	resp, err := computev1.NewAuditServiceClient(c.cfg.Conn).List(s.ctx, &computev1.AuditServiceListRequest{TenantId: s.Tenant, Action: d.Action, PageSize: pageAudit})
	if err != nil {
		return err
	}
	d.Records = resp.GetRecords()
	return nil
}

// verifyAudit runs audit.verify (the chain spans every tenant: it is
// decided on root). An htmx request gets the result alone.
func (c *Console) verifyAudit(w http.ResponseWriter, r *http.Request, s *session) {
	d := &auditData{}
	v, err := computev1.NewAuditServiceClient(c.cfg.Conn).Verify(s.ctx, &computev1.AuditServiceVerifyRequest{TenantId: "root"})
	if err != nil {
		d.VerifyError = &note{"audit.verify", envelope(err)}
	} else {
		d.Verify = v
	}
	if r.Header.Get("HX-Request") == "true" {
		var b strings.Builder
		if err := c.pages["audit"].ExecuteTemplate(&b, "verify-result", d); err != nil {
			c.logger.Error("console: render verify result", "err", err)
			http.Error(w, "the console could not render this page", http.StatusInternalServerError)
			return
		}
		writeHTML(w, http.StatusOK, []byte(b.String()))
		return
	}
	p := &page{S: s, Data: d}
	c.render(w, p, "audit", c.loadAudit(r, s, p))
}

// stream proxies the API's events watch (SSE) with the session's key: the
// same request, its cookie swapped for the key as a bearer token, the
// tenant defaulting to the session's.
func (c *Console) stream(w http.ResponseWriter, r *http.Request) {
	id, key, err := c.lookup(r)
	if errors.Is(err, errNoSession) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = w.Write([]byte(`{"code":"UNAUTHENTICATED","message":"sign in to the console first","field":"authorization"}`))
		return
	}
	if err != nil {
		c.logger.Error("console: look up session", "err", err)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"code":"UNAVAILABLE","message":"the console cannot check its sessions now; retry"}`))
		return
	}
	q := r.URL.Query()
	if q.Get("tenantId") == "" {
		s, ok := c.open(w, r)
		if !ok {
			return
		}
		q.Set("tenantId", s.Tenant)
	}
	for k, vs := range q {
		for _, v := range vs {
			if len(v) > 4*maxField {
				http.Error(w, k+": at most 1024 characters", http.StatusBadRequest)
				return
			}
		}
	}
	// The feed ends with its session: signing out (or the session idling
	// or expiring) ends the stream with a final UNAUTHENTICATED error
	// event, so the page stops reconnecting.
	ctx, release := c.openFeed(r.Context(), id)
	defer release()
	r2 := r.Clone(ctx)
	r2.Header.Del("Cookie")
	r2.Header.Set("Authorization", "Bearer "+key)
	r2.URL.RawQuery = q.Encode()
	c.cfg.Watch(w, r2)
	if errors.Is(context.Cause(ctx), errSessionEnded) {
		_, _ = w.Write([]byte("event: error\ndata: {\"code\":\"UNAUTHENTICATED\",\"message\":\"the console session ended; sign in again\",\"field\":\"authorization\"}\n\n"))
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
	}
}
