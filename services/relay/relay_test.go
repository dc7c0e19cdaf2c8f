package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
	"github.com/bettercompute/bettercompute/services/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// env is a database, a bus and a relay configuration with short intervals.
type env struct {
	t    testing.TB
	pool *pgxpool.Pool
	ns   *natstest.Server
	nc   *nats.Conn
	cfg  relay.Config
}

func setup(t *testing.T) *env { return setupTB(t) }

func setupTB(t testing.TB) *env {
	t.Helper()
	pool := pgtest.New(t)
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "relay-test", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	var c config.Config
	c.Defaults()
	c.Events.Poll = config.Duration(5 * time.Millisecond)
	c.Webhooks.RetrySchedule = []config.Duration{config.Duration(50 * time.Millisecond), config.Duration(100 * time.Millisecond), config.Duration(150 * time.Millisecond)}
	c.Webhooks.Poll = config.Duration(20 * time.Millisecond)
	c.Webhooks.AllowPrivateNetworks = true
	c.Webhooks.AllowInsecure = true
	c.Webhooks.Timeout = config.Duration(2 * time.Second)
	for _, tenant := range []string{"acme", "acme.ml", "beta"} {
		fixture.Tenant(t, pool, fixture.TenantOpts{ID: tenant})
	}
	return &env{t: t, pool: pool, ns: ns, nc: nc, cfg: relay.Config{
		DB: pool, NATS: nc, Events: c.Events, Webhooks: c.Webhooks,
		Heartbeat: 100 * time.Millisecond, LeaseTTL: 500 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}}
}

// start runs a relay with cfg until the test ends.
func (e *env) start(cfg relay.Config) *relay.Service {
	e.t.Helper()
	r, err := relay.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := r.Start(e.t.Context()); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(r.Stop)
	return r
}

// write commits n events of typ for tenant, one transaction each, and
// returns their ids.
func (e *env) write(tenant, typ string, n int) []int64 {
	e.t.Helper()
	var ids []int64
	for i := range n {
		err := db.InTx(e.t.Context(), e.pool, db.TxOptions{}, func(tx pgx.Tx) error {
			id, err := outbox.Write(e.t.Context(), tx, outbox.Event{TenantID: tenant, Type: typ, Resource: "node_x", Payload: map[string]any{"i": i}})
			ids = append(ids, id)
			return err
		})
		if err != nil {
			e.t.Fatal(err)
		}
	}
	return ids
}

// passed waits until event cursor name (relay.FanoutCursor, "sub:<name>")
// has passed the events ids (outbox ids, as write returns them): they are
// sequenced, and the cursor's seq is at or past theirs.
func (e *env) passed(name string, ids []int64) {
	e.t.Helper()
	poll.Until(e.t, 20*time.Second, "cursor "+name+" past the events written", func() bool {
		var ok bool
		err := e.pool.QueryRow(e.t.Context(), `
			SELECT count(o.seq) = cardinality($1::bigint[]) AND coalesce(max(o.seq) <= (SELECT seq FROM event_cursors WHERE name = $2), false)
			  FROM outbox o WHERE o.id = ANY($1)`, ids, name).Scan(&ok)
		return err == nil && ok
	})
}

// hook registers a webhook for tenant at url and returns it with its key.
func (e *env) hook(tenant, url string, types []string, descendants bool) (webhooks.Webhook, []byte) {
	e.t.Helper()
	_, key := webhooks.NewSecret()
	// A webhook's descendants' events are decided as its creator: one
	// allowed to list the subtree's events.
	var owner string
	if descendants {
		i, err := iam.CreateIdentity(e.t.Context(), e.pool, iam.Identity{ID: iam.NewID("idn"), TenantID: tenant, Kind: iam.KindUser, Name: "hook-owner"})
		if err != nil {
			e.t.Fatal(err)
		}
		owner = i.ID
		if _, err := authz.PutPolicy(e.t.Context(), e.pool, authz.Policy{TenantID: tenant, Name: "hook-owner",
			Body: `permit (principal == Identity::"` + owner + `", action == Action::"compute:events:list", resource in Tenant::"` + tenant + `");`}); err != nil {
			e.t.Fatal(err)
		}
	}
	w, err := webhooks.Create(e.t.Context(), e.pool, webhooks.Webhook{
		ID: webhooks.NewID(), TenantID: tenant, URL: url, EventTypes: types, IncludeDescendants: descendants, Secret: key,
		CreatedBy: owner,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return w, key
}

// receiver is a webhook endpoint that verifies every signature with its
// keys and records what it got.
type receiver struct {
	t    *testing.T
	srv  *httptest.Server
	mu   sync.Mutex
	keys [][]byte
	// status answers each request (200 when nil); it sees the attempt's
	// number for the event id, from 1.
	status func(id string, attempt int) int
	got    []delivered
	tries  map[string]int
	bad    int
}

type delivered struct {
	ID, Type  string
	Tenant    string
	At        time.Time
	Signature string
}

func newReceiver(t *testing.T, keys ...[]byte) *receiver {
	r := &receiver{t: t, keys: keys, tries: map[string]int{}}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *receiver) serve(w http.ResponseWriter, req *http.Request) {
	b, _ := io.ReadAll(req.Body)
	r.mu.Lock()
	defer r.mu.Unlock()
	ok := false
	for _, k := range r.keys {
		if webhooks.Verify(k, req.Header, b, time.Now(), time.Minute) == nil {
			ok = true
		}
	}
	if !ok {
		r.bad++
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	id := req.Header.Get(webhooks.HeaderID)
	r.tries[id]++
	status := http.StatusOK
	if r.status != nil {
		status = r.status(id, r.tries[id])
	}
	if status/100 == 2 {
		var body struct {
			Type string          `json:"type"`
			Data json.RawMessage `json:"data"`
		}
		if err := json.Unmarshal(b, &body); err != nil {
			r.t.Errorf("body %s: %v", b, err)
		}
		r.got = append(r.got, delivered{ID: id, Type: body.Type, At: time.Now(), Signature: req.Header.Get(webhooks.HeaderSignature)})
	}
	w.WriteHeader(status)
}

// ids returns the distinct event ids received, and how many deliveries
// there were in all.
func (r *receiver) ids() (map[string]bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := map[string]bool{}
	for _, d := range r.got {
		m[d.ID] = true
	}
	return m, len(r.got)
}

// waitReceived waits until r has every event of ids.
func waitReceived(t *testing.T, r *receiver, ids []int64) {
	t.Helper()
	poll.Until(t, 20*time.Second, "every event at the receiver", func() bool {
		got, _ := r.ids()
		for _, id := range ids {
			if !got[events.EventID(id)] {
				return false
			}
		}
		return true
	})
}

// streamIDs returns the Nats-Msg-Id of every message in BC_EVENTS, in
// stream order; none while the stream does not exist.
func (e *env) streamIDs() []string {
	e.t.Helper()
	js, err := jetstream.New(e.nc)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(e.t.Context(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, "BC_EVENTS")
	if err != nil {
		return nil // not created (again) yet
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil
	}
	var ids []string
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		ids = append(ids, m.Header.Get(nats.MsgIdHdr))
	}
	return ids
}

func TestDeliversSignedEventsInOrderToTheStreamAndWebhooks(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w, key := e.hook("acme", "", []string{"node.*"}, false)
	rcv := newReceiver(t, key)
	w.URL = rcv.srv.URL
	if _, err := webhooks.Save(t.Context(), e.pool, w); err != nil {
		t.Fatal(err)
	}
	e.start(e.cfg)
	ids := e.write("acme", "node.updated", 20)
	other := e.write("acme", "pool.created", 3) // not subscribed
	waitReceived(t, rcv, ids)

	// The stream has every event once, in commit order.
	poll.Until(t, 20*time.Second, "every event published", func() bool { return len(e.streamIDs()) == 23 })
	want := []string{}
	for _, id := range append(slices.Clone(ids), other...) {
		want = append(want, events.EventID(id))
	}
	if got := e.streamIDs(); !slices.Equal(got, want) {
		t.Fatalf("stream ids = %v, want %v", got, want)
	}
	got, n := rcv.ids()
	for _, id := range other {
		if got[events.EventID(id)] {
			t.Errorf("pool.created %d reached a node.* webhook", id)
		}
	}
	if n != len(ids) {
		t.Errorf("%d deliveries for %d events", n, len(ids))
	}
	if rcv.bad != 0 {
		t.Errorf("%d requests failed signature verification", rcv.bad)
	}
	st, err := events.ReadStats(t.Context(), e.pool)
	if err != nil || st.Unsequenced != 0 || st.Unpublished != 0 {
		t.Fatalf("stats %+v, %v: want nothing waiting", st, err)
	}
	// The receiver answers before the relay records the attempt.
	poll.UntilNil(t, 20*time.Second, "every delivery recorded", func() error {
		ds, err := webhooks.ListDeliveries(t.Context(), e.pool, webhooks.DeliveryFilter{TenantID: "acme", WebhookID: w.ID, Limit: 100})
		if err != nil {
			return err
		}
		for _, d := range ds {
			if d.State != webhooks.Succeeded || d.Attempts != 1 || d.LastStatus != 200 {
				return fmt.Errorf("delivery %+v: want succeeded after 1 attempt with 200", d)
			}
		}
		return nil
	})
}

func TestRetriesAfterA500WithBackOff(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	rcv.status = func(_ string, attempt int) int {
		if attempt < 3 {
			return http.StatusInternalServerError
		}
		return http.StatusNoContent
	}
	setURL(t, e, rcv)
	e.start(e.cfg)
	ids := e.write("acme", "node.updated", 1)
	waitReceived(t, rcv, ids)
	rcv.mu.Lock()
	tries := rcv.tries[events.EventID(ids[0])]
	rcv.mu.Unlock()
	if tries != 3 {
		t.Fatalf("%d attempts, want 3 (two 500s, then 204)", tries)
	}
	poll.Until(t, 20*time.Second, "the success recorded", func() bool { return onlyDelivery(t, e).State == webhooks.Succeeded })
	d := onlyDelivery(t, e)
	if d.State != webhooks.Succeeded || d.Attempts != 3 || d.LastStatus != 204 {
		t.Fatalf("delivery %+v: want succeeded on attempt 3", d)
	}
}

func setURL(t *testing.T, e *env, rcv *receiver) {
	t.Helper()
	if _, err := e.pool.Exec(t.Context(), `UPDATE webhooks SET url = $1`, rcv.srv.URL); err != nil {
		t.Fatal(err)
	}
}

func onlyDelivery(t *testing.T, e *env) webhooks.Delivery {
	t.Helper()
	var tenant, hook string
	if err := e.pool.QueryRow(t.Context(), `SELECT tenant_id, id FROM webhooks LIMIT 1`).Scan(&tenant, &hook); err != nil {
		t.Fatal(err)
	}
	ds, err := webhooks.ListDeliveries(t.Context(), e.pool, webhooks.DeliveryFilter{TenantID: tenant, WebhookID: hook, Limit: 10})
	if err != nil || len(ds) != 1 {
		t.Fatalf("deliveries %v, %v: want one", ds, err)
	}
	return ds[0]
}

func TestGoneDisablesTheWebhookWithAnEvent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w, key := e.hook("acme", "", []string{"node.updated"}, false)
	rcv := newReceiver(t, key)
	rcv.status = func(string, int) int { return http.StatusGone }
	setURL(t, e, rcv)
	e.start(e.cfg)
	e.write("acme", "node.updated", 1)
	poll.Until(t, 20*time.Second, "the webhook disabled", func() bool {
		var enabled bool
		var reason string
		_ = e.pool.QueryRow(t.Context(), `SELECT enabled, disabled_reason FROM webhooks WHERE id = $1`, w.ID).Scan(&enabled, &reason)
		return !enabled && reason == webhooks.ReasonGone
	})
	if d := onlyDelivery(t, e); d.State != webhooks.Failed || d.LastStatus != 410 || d.Attempts != 1 {
		t.Fatalf("delivery %+v: want failed once with 410, no retry", d)
	}
	evs, err := events.List(t.Context(), e.pool, events.Filter{TenantID: "acme", Types: []string{"webhook.disabled"}, Limit: 10})
	poll.Until(t, 20*time.Second, "webhook.disabled sequenced", func() bool {
		evs, err = events.List(t.Context(), e.pool, events.Filter{TenantID: "acme", Types: []string{"webhook.disabled"}, Limit: 10})
		return err == nil && len(evs) == 1
	})
	var p map[string]any
	_ = json.Unmarshal(evs[0].Payload, &p)
	if evs[0].Resource != w.ID || p["reason"] != "gone" {
		t.Fatalf("webhook.disabled %+v payload %v", evs[0], p)
	}
	// No further events reach a disabled webhook.
	ids := e.write("acme", "node.updated", 2)
	e.passed(relay.FanoutCursor, ids)
	var queued int
	if err := e.pool.QueryRow(t.Context(), `SELECT count(*) FROM webhook_deliveries WHERE webhook_id = $1 AND event_id = ANY($2)`, w.ID, ids).Scan(&queued); err != nil || queued != 0 {
		t.Fatalf("%d deliveries queued for a disabled webhook (%v)", queued, err)
	}
	if _, n := rcv.ids(); n != 0 {
		t.Fatalf("a disabled webhook got %d deliveries", n)
	}
}

func TestReceiverDownThenUpGetsEverything(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	url := rcv.srv.URL
	rcv.srv.Close() // down: connection refused
	if _, err := e.pool.Exec(t.Context(), `UPDATE webhooks SET url = $1`, url); err != nil {
		t.Fatal(err)
	}
	e.start(e.cfg)
	ids := e.write("acme", "node.updated", 5)
	poll.Until(t, 20*time.Second, "failed attempts recorded", func() bool {
		var n int
		_ = e.pool.QueryRow(t.Context(), `SELECT count(*) FROM webhook_deliveries WHERE attempts >= 1 AND last_error <> ''`).Scan(&n)
		return n == 5
	})
	// Up again on the same address.
	ln, err := listenOn(url)
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", url, err)
	}
	up := httptest.NewUnstartedServer(http.HandlerFunc(rcv.serve))
	up.Listener = ln
	up.Start()
	t.Cleanup(up.Close)
	waitReceived(t, rcv, ids)
}

func TestTenantIsolationAndDescendants(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, keyA := e.hook("acme", "", []string{"*"}, true)
	_, keyB := e.hook("beta", "", []string{"*"}, false)
	a, b := newReceiver(t, keyA), newReceiver(t, keyB)
	if _, err := e.pool.Exec(t.Context(), `UPDATE webhooks SET url = CASE tenant_id WHEN 'acme' THEN $1 ELSE $2 END`, a.srv.URL, b.srv.URL); err != nil {
		t.Fatal(err)
	}
	e.start(e.cfg)
	acme := e.write("acme", "node.updated", 3)
	ml := e.write("acme.ml", "node.updated", 2)
	beta := e.write("beta", "node.updated", 2)
	waitReceived(t, a, append(slices.Clone(acme), ml...))
	waitReceived(t, b, beta)
	gotB, nB := b.ids()
	if nB != len(beta) {
		t.Fatalf("beta got %d deliveries (%v), want only its own %d", nB, gotB, len(beta))
	}
	gotA, _ := a.ids()
	for _, id := range beta {
		if gotA[events.EventID(id)] {
			t.Fatalf("acme's webhook saw beta's event %d", id)
		}
	}
}

func TestPrivateAddressRefusedWithoutAllowPrivateNetworks(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	cfg := e.cfg
	cfg.Webhooks.AllowPrivateNetworks = false
	e.start(cfg)
	e.write("acme", "node.updated", 1)
	poll.Until(t, 20*time.Second, "a refused attempt", func() bool {
		var msg string
		_ = e.pool.QueryRow(t.Context(), `SELECT last_error FROM webhook_deliveries`).Scan(&msg)
		return msg != ""
	})
	d := onlyDelivery(t, e)
	if d.LastStatus != 0 || !strings.Contains(d.LastError, "destination refused") {
		t.Fatalf("delivery %+v: want refused before any request", d)
	}
	if _, n := rcv.ids(); n != 0 || rcv.bad != 0 {
		t.Fatal("the loopback receiver was reached")
	}
}

// TestDeliveryErrorShowsTenantNoResolvedAddress: a webhook at a name that
// resolves to an internal address used to tell the tenant, in the
// delivery's lastError, the address the relay's resolver answered (and the
// dial's detail); it now reads only the fixed class "destination refused".
// The name is localhost (the hosts file: no DNS query leaves the machine)
// and the refusal comes before the connection.
func TestDeliveryErrorShowsTenantNoResolvedAddress(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	u := strings.Replace(rcv.srv.URL, "127.0.0.1", "localhost", 1)
	if _, err := e.pool.Exec(t.Context(), `UPDATE webhooks SET url = $1`, u); err != nil {
		t.Fatal(err)
	}
	cfg := e.cfg
	cfg.Webhooks.AllowPrivateNetworks = false
	e.start(cfg)
	e.write("acme", "node.updated", 1)
	poll.Until(t, 20*time.Second, "a refused attempt", func() bool {
		var msg string
		_ = e.pool.QueryRow(t.Context(), `SELECT coalesce(last_error, '') FROM webhook_deliveries`).Scan(&msg)
		return msg != ""
	})
	if d := onlyDelivery(t, e); d.LastError != "destination refused" || d.LastStatus != 0 {
		t.Fatalf("delivery %+v: want only the class, no address", d)
	}
	if _, n := rcv.ids(); n != 0 {
		t.Fatal("the loopback receiver was reached")
	}
}

func TestBusStoppedDeliveriesStillHappen(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	e.start(e.cfg)
	e.ns.Stop()
	poll.Until(t, 20*time.Second, "the client to notice", func() bool { return !e.nc.IsConnected() })
	ids := e.write("acme", "node.updated", 10)
	waitReceived(t, rcv, ids)
	st, err := events.ReadStats(t.Context(), e.pool)
	if err != nil || st.Unpublished != 10 {
		t.Fatalf("stats %+v, %v: want 10 waiting for the bus", st, err)
	}
	// Back up: the backlog is published in order.
	e.ns.Restart()
	poll.Until(t, 20*time.Second, "the backlog published", func() bool {
		st, err := events.ReadStats(t.Context(), e.pool)
		return err == nil && st.Unpublished == 0
	})
	want := []string{}
	for _, id := range ids {
		want = append(want, events.EventID(id))
	}
	if got := e.streamIDs(); !slices.Equal(got, want) {
		t.Fatalf("stream %v, want %v", got, want)
	}
}

func TestBusRestartedEmptyRecreatesTheStreamAndLosesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	e.start(e.cfg)
	first := e.write("acme", "node.updated", 5)
	waitReceived(t, rcv, first)
	poll.Until(t, 20*time.Second, "published", func() bool { return len(e.streamIDs()) == 5 })
	e.ns.RestartEmpty()
	poll.Until(t, 20*time.Second, "reconnected", e.nc.IsConnected)
	second := e.write("acme", "node.updated", 5)
	waitReceived(t, rcv, second)
	poll.Until(t, 20*time.Second, "the stream re-created with the new events", func() bool {
		ids := e.streamIDs()
		return len(ids) == 5 && ids[0] == events.EventID(second[0])
	})
	if _, n := rcv.ids(); n != 10 {
		t.Fatalf("%d deliveries, want 10", n)
	}
}

func TestTwoRelaysOnePublishesAndTheStandbyTakesOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	r1 := e.start(e.cfg)
	poll.Until(t, 20*time.Second, "r1 leading", r1.Leading)
	r2 := e.start(e.cfg)
	ids := e.write("acme", "node.updated", 20)
	waitReceived(t, rcv, ids)
	if r2.Leading() {
		t.Fatal("both relays lead")
	}
	// The leader dies without releasing its lease: the standby waits out
	// the lease, then relays.
	r1.Kill()
	more := e.write("acme", "node.updated", 5)
	poll.Until(t, 20*time.Second, "r2 leading", r2.Leading)
	waitReceived(t, rcv, more)
	poll.Until(t, 20*time.Second, "all published", func() bool { return len(e.streamIDs()) == 25 })
	got := e.streamIDs()
	seen := map[string]bool{}
	for _, id := range got {
		if seen[id] {
			t.Fatalf("%s published twice: %v", id, got)
		}
		seen[id] = true
	}
	if _, n := rcv.ids(); n != 25 {
		t.Fatalf("%d deliveries for 25 events", n)
	}
}

// testWriter sends log lines to the test's log.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}
