package api_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// watchSetup is eventsSetup with the bus returned and the configuration
// changed by change.
func watchSetup(t testing.TB, change func(*config.Config)) (*harness, *natstest.Server) {
	t.Helper()
	ns := natstest.New(t)
	h := setupWith(t, api.Tuning{}, func(c *config.Config) {
		c.NATS.URL = ns.URL()
		c.Events.Poll = config.Duration(5 * time.Millisecond)
		if change != nil {
			change(c)
		}
	})
	return h, ns
}

// acmeWatcher makes tenant acme with alice, allowed everything in acme,
// and returns alice's identity and key.
func acmeWatcher(t *testing.T, h *harness) (string, string) {
	t.Helper()
	id, key := h.member(t, "acme", "alice")
	h.policy(t, "acme", "admin", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	return id, key
}

// wantStreamError reads c until it ends and returns the error event it
// ended with.
func wantStreamError(t *testing.T, c <-chan sseEvent, code fault.Code) {
	t.Helper()
	for {
		select {
		case ev, ok := <-c:
			if !ok {
				t.Fatalf("the stream ended without an error event (want %s)", code)
			}
			if ev.Event == "error" {
				if ev.Data["code"] != string(code) {
					t.Fatalf("error event %v, want code %s", ev.Data, code)
				}
				if _, ok := <-c; ok {
					t.Fatal("the stream went on after its error event")
				}
				return
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("the stream did not end (want %s)", code)
		}
	}
}

// pool creates a pool in tenant as token and returns its event's type.
func (h *harness) pool(t *testing.T, token, tenant, name string) {
	t.Helper()
	if code, body := h.rest(t, token, "pools/create", `{"tenantId":"`+tenant+`","class":"gpu","name":"`+name+`"}`); code != 200 {
		t.Fatalf("pools/create in %s: %d %v", tenant, code, body)
	}
}

func TestWatchEndsAfterKeyRevoked(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, nil)
	_, key := acmeWatcher(t, h)
	keyID, _, err := iam.ParseKey(key)
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, code, body := h.sseAs(ctx, t, key, "tenantId=acme&types=pool.created", "")
	if code != 200 {
		t.Fatalf("watch: %d %v", code, body)
	}
	grpcWatch, err := computev1.NewEventsServiceClient(h.conn).Watch(as(key), &computev1.EventsServiceWatchRequest{TenantId: "acme", Types: []string{"pool.created"}})
	if err != nil {
		t.Fatal(err)
	}
	h.pool(t, key, "acme", "before")
	if ev := next(t, stream); ev.Data["type"] != "pool.created" {
		t.Fatalf("watched %v", ev)
	}
	if _, err := grpcWatch.Recv(); err != nil {
		t.Fatal(err)
	}

	// The key is revoked well inside the authentication cache's TTL: both
	// streams end at once, UNAUTHENTICATED.
	if code, body := h.rest(t, h.root, "apiKeys/revoke", `{"tenantId":"acme","apiKeyId":"`+keyID+`"}`); code != 200 {
		t.Fatalf("revoke: %d %v", code, body)
	}
	wantStreamError(t, stream, fault.Unauthenticated)
	for {
		_, err := grpcWatch.Recv()
		if err == nil {
			continue
		}
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("gRPC watch ended with %v, want UNAUTHENTICATED", err)
		}
		break
	}
}

func TestWatchEndsAfterIdentityRevoked(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, nil)
	id, key := acmeWatcher(t, h)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, code, body := h.sseAs(ctx, t, key, "tenantId=acme", "")
	if code != 200 {
		t.Fatalf("watch: %d %v", code, body)
	}
	if code, body := h.rest(t, h.root, "identities/revoke", `{"tenantId":"acme","identityId":"`+id+`"}`); code != 200 {
		t.Fatalf("revoke: %d %v", code, body)
	}
	wantStreamError(t, stream, fault.Unauthenticated)
}

func TestWatchEndsAfterPolicyForbids(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, nil)
	_, key := acmeWatcher(t, h)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, code, body := h.sseAs(ctx, t, key, "tenantId=acme", "")
	if code != 200 {
		t.Fatalf("watch: %d %v", code, body)
	}
	grpcWatch, err := computev1.NewEventsServiceClient(h.conn).Watch(as(key), &computev1.EventsServiceWatchRequest{TenantId: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	h.pool(t, key, "acme", "seen")
	next(t, stream)
	if _, err := grpcWatch.Recv(); err != nil {
		t.Fatal(err)
	}
	h.policy(t, "acme", "no-watching", `forbid (principal, action == Action::"compute:events:watch", resource in Tenant::"acme");`)
	wantStreamError(t, stream, fault.AccessDenied)
	for {
		_, err := grpcWatch.Recv()
		if err == nil {
			continue
		}
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("gRPC watch ended with %v, want PERMISSION_DENIED", err)
		}
		break
	}
	// And a new one is refused before the first byte.
	_, code, body = h.sseAs(ctx, t, key, "tenantId=acme", "")
	wantREST(t, code, body, fault.AccessDenied, "")
}

func TestWatchEndsAtItsLifetimeAndResumes(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, func(c *config.Config) { c.Events.MaxStreamLifetime = config.Duration(3 * time.Second) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, code := h.sse(ctx, t, "tenantId=root&types=pool.created", "")
	if code != 200 {
		t.Fatalf("watch: %d", code)
	}
	h.pool(t, h.root, "root", "one")
	first := next(t, stream)
	wantStreamError(t, stream, fault.Unavailable)
	h.pool(t, h.root, "root", "two")
	resumed, code := h.sse(ctx, t, "tenantId=root&types=pool.created", first.ID)
	if code != 200 {
		t.Fatalf("resume: %d", code)
	}
	ev := next(t, resumed)
	a, _ := strconv.ParseInt(first.ID, 10, 64)
	b, _ := strconv.ParseInt(ev.ID, 10, 64)
	if ev.Data["type"] != "pool.created" || b <= a {
		t.Fatalf("resumed after %s with %v", first.ID, ev)
	}
}

func TestWatchCapPerIdentity(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, func(c *config.Config) { c.Events.MaxWatchesPerIdentity = 2 })
	_, key := acmeWatcher(t, h)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range 2 {
		if _, code, body := h.sseAs(ctx, t, key, "tenantId=acme", ""); code != 200 {
			t.Fatalf("watch %d: %d %v", i, code, body)
		}
	}
	_, code, body := h.sseAs(ctx, t, key, "tenantId=acme", "")
	wantREST(t, code, body, fault.RateLimited, "")
	gctx, gcancel := context.WithTimeout(as(key), 20*time.Second)
	defer gcancel()
	w, err := computev1.NewEventsServiceClient(h.conn).Watch(gctx, &computev1.EventsServiceWatchRequest{TenantId: "acme"})
	if err == nil {
		_, err = w.Recv()
	}
	if c, _ := envelope(err); c != fault.RateLimited {
		t.Fatalf("a third gRPC watch: %v, want RATE_LIMITED", err)
	}
	// Another identity is not held back by alice's.
	if _, code, body := h.sseAs(ctx, t, h.root, "tenantId=root", ""); code != 200 {
		t.Fatalf("root's watch: %d %v", code, body)
	}
	// A closed stream frees its place.
	cancel()
	poll.UntilNil(t, 20*time.Second, "a watch place freed", func() error {
		ctx2, cancel2 := context.WithCancel(context.Background())
		defer cancel2()
		if _, code, body := h.sseAs(ctx2, t, key, "tenantId=acme", ""); code != 200 {
			time.Sleep(20 * time.Millisecond) // between tries, not an assertion
			return fmt.Errorf("%d %v", code, body)
		}
		return nil
	})
}

func TestSSEBadFilterAnswers400(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, nil)
	for _, c := range []struct{ query, field string }{
		{"tenantId=root&subject=%00", "subject"},      // PostgreSQL refused it after the 200
		{"tenantId=root&subject=a%ffb", "subject"},    // not UTF-8
		{"tenantId=root&subject=a%1b[2Jb", "subject"}, // terminal control
		{"tenantId=root&type=node.*", "type"},         // a misspelt parameter watched everything
		{"tenantId=root&includeDescendants=yes", "includeDescendants"},
		{"tenantId=root&tenantId=acme", "tenantId"},
		{"tenantId=root&types=Bad!", "types"},
		{"tenantId=root&after=-1", "after"},
		{"tenantId=root&subject=" + strings.Repeat("x", 200), "subject"},
	} {
		_, code, body := h.sseAs(context.Background(), t, h.root, c.query, "")
		if code != 400 {
			t.Fatalf("%s: %d %v, want 400", c.query, code, body)
		}
		wantREST(t, code, body, fault.InvalidInput, c.field)
	}
}

func TestIncludeDescendantsHonoursDescendantForbid(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, nil)
	_, key := acmeWatcher(t, h)
	h.member(t, "acme.open", "o")
	h.member(t, "acme.secret", "s")
	// acme.secret's own policies forbid everyone its events.
	h.policy(t, "acme.secret", "private", `forbid (principal, action in [Action::"compute:events:list", Action::"compute:events:watch"], resource in Tenant::"acme.secret");`)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, code, body := h.sseAs(ctx, t, key, "tenantId=acme&includeDescendants=true&types=pool.created", "")
	if code != 200 {
		t.Fatalf("watch: %d %v", code, body)
	}
	h.pool(t, h.root, "acme.secret", "hidden")
	h.pool(t, h.root, "acme.open", "shown")
	h.pool(t, h.root, "acme", "own")
	var got []string
	for range 2 {
		got = append(got, next(t, stream).Data["tenantId"].(string))
	}
	if strings.Join(got, ",") != "acme.open,acme" {
		t.Fatalf("watched events of %v, want acme.open then acme (acme.secret forbids)", got)
	}
	code, list := h.rest(t, key, "events/list", `{"tenantId":"acme","includeDescendants":true,"types":["pool.created"]}`)
	if code != 200 {
		t.Fatalf("list: %d %v", code, list)
	}
	evs, _ := list["events"].([]any)
	var listed []string
	for _, e := range evs {
		listed = append(listed, e.(map[string]any)["tenantId"].(string))
	}
	if strings.Join(listed, ",") != "acme.open,acme" {
		t.Fatalf("listed events of %v, want acme.open and acme", listed)
	}
}

// openWatches opens n gRPC watches of root's pool.created events as root
// and returns them once each has received one event (so each is live).
func openWatches(t testing.TB, h *harness, n int) []computev1.EventsService_WatchClient {
	t.Helper()
	ctx, cancel := context.WithCancel(as(h.root))
	t.Cleanup(cancel)
	head, err := events.Head(context.Background(), h.db)
	if err != nil {
		t.Fatal(err)
	}
	var ws []computev1.EventsService_WatchClient
	for range n {
		w, err := computev1.NewEventsServiceClient(h.conn).Watch(ctx, &computev1.EventsServiceWatchRequest{
			TenantId: "root", Types: []string{"pool.created"}, After: events.Cursor(head),
		})
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	h.rawEvent(t, "root", "pool.created")
	for _, w := range ws {
		if _, err := w.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	return ws
}

// rawEvent writes an event straight into the outbox (no RPC, so none of
// the API's statements), for the relay to sequence.
func (h *harness) rawEvent(t testing.TB, tenant, typ string) {
	t.Helper()
	if _, err := h.db.Exec(context.Background(), `INSERT INTO outbox (tenant_id, type, subject) VALUES ($1, $2, $3)`,
		tenant, typ, "bc.events."+tenant+"."+typ); err != nil {
		t.Fatal(err)
	}
}

func TestWatchIdleDoesNotQueryPerWatch(t *testing.T) {
	t.Parallel()
	const n = 60
	h, _ := watchSetup(t, func(c *config.Config) { c.Events.MaxWatchesPerIdentity = n })
	h.member(t, "beta", "bob")
	ws := openWatches(t, h, n)
	before := h.queries.Load()
	// An event in another tenant, then one every watch selects: each
	// watch has been woken at least twice when it has the second.
	h.rawEvent(t, "beta", "pool.created")
	h.rawEvent(t, "root", "pool.created")
	for _, w := range ws {
		if _, err := w.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	// Before the tailer, every watch read the log on every wake (2n and
	// more); now none does: the tailer reads once, outside any call.
	if d := h.queries.Load() - before; d >= n/4 {
		t.Fatalf("%d statements by %d idle watches for two events, want none per watch", d, n)
	}
}

func TestWatchReplayCursorAdvancesPastUnmatched(t *testing.T) {
	t.Parallel()
	h, _ := watchSetup(t, nil)
	h.member(t, "beta", "bob")
	// A long log of which root's pool.created filter selects nothing. The
	// relay gives it its seqs (it is the one writer of seqs: taking them
	// here too would race its reservation of a batch).
	if _, err := h.db.Exec(context.Background(), `INSERT INTO outbox (tenant_id, type, subject, sent_at)
		SELECT 'beta', 'node.updated', 'bc.events.beta.node.updated', now() FROM generate_series(1, 25000)`); err != nil {
		t.Fatal(err)
	}
	poll.UntilNil(t, time.Minute, "the relay sequencing the log", func() error {
		var left int
		if err := h.db.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE seq IS NULL`).Scan(&left); err != nil {
			return err
		}
		if left > 0 {
			return fmt.Errorf("%d events without a seq", left)
		}
		return nil
	})
	head, err := events.Head(context.Background(), h.db)
	if err != nil {
		t.Fatal(err)
	}
	f := events.Filter{TenantID: "root", Types: []string{"pool.created"}, Limit: 100}
	scans := 0
	for f.After < head {
		evs, next, err := events.Scan(context.Background(), h.db, f, head, 10_000)
		if err != nil {
			t.Fatal(err)
		}
		if next <= f.After || len(evs) != 0 && next < evs[len(evs)-1].Seq {
			t.Fatalf("scan after %d moved to %d (%d events)", f.After, next, len(evs))
		}
		f.After = next
		scans++
	}
	if want := int((head + 9_999) / 10_000); scans != want {
		t.Fatalf("%d scans of a %d-event log, want %d windows", scans, head, want)
	}
	// A watch from the start replays the log once, then reads nothing of
	// its own however often it is woken.
	ctx, cancel := context.WithCancel(as(h.root))
	defer cancel()
	w, err := computev1.NewEventsServiceClient(h.conn).Watch(ctx, &computev1.EventsServiceWatchRequest{TenantId: "root", Types: []string{"pool.created"}, After: "0"})
	if err != nil {
		t.Fatal(err)
	}
	h.rawEvent(t, "root", "pool.created")
	if _, err := w.Recv(); err != nil {
		t.Fatal(err)
	}
	before := h.queries.Load()
	for range 5 {
		h.rawEvent(t, "beta", "node.updated")
	}
	h.rawEvent(t, "root", "pool.created")
	if _, err := w.Recv(); err != nil {
		t.Fatal(err)
	}
	if d := h.queries.Load() - before; d > 1 {
		t.Fatalf("the watch ran %d statements for 6 new events after its replay, want its log read by the tailer", d)
	}
}

func TestWatchDeliversWithNATSStoppedAndRestarted(t *testing.T) {
	t.Parallel()
	h, ns := watchSetup(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, code := h.sse(ctx, t, "tenantId=root&types=pool.created", "")
	if code != 200 {
		t.Fatalf("watch: %d", code)
	}
	h.pool(t, h.root, "root", "bus-up")
	if ev := next(t, stream); ev.Data["type"] != "pool.created" {
		t.Fatalf("watched %v", ev)
	}
	ns.Stop()
	h.pool(t, h.root, "root", "bus-down")
	if ev := next(t, stream); ev.Data["data"].(map[string]any)["pool"].(map[string]any)["name"] != "bus-down" {
		t.Fatalf("watched %v with the bus down", ev)
	}
	ns.Restart()
	h.pool(t, h.root, "root", "bus-back")
	if ev := next(t, stream); ev.Data["data"].(map[string]any)["pool"].(map[string]any)["name"] != "bus-back" {
		t.Fatalf("watched %v after the bus came back", ev)
	}
}

func TestWebhookIncludeDescendantsHonoursDescendantForbid(t *testing.T) {
	t.Parallel()
	h := eventsSetup(t)
	rcv := newHookReceiver(t)
	_, key := acmeWatcher(t, h)
	h.member(t, "acme.open", "o")
	h.member(t, "acme.secret", "s")
	h.policy(t, "acme.secret", "private", `forbid (principal, action == Action::"compute:events:list", resource in Tenant::"acme.secret");`)
	code, body := h.rest(t, key, "webhooks/create", `{"tenantId":"acme","url":"`+rcv.srv.URL+`","eventTypes":["pool.created"],"includeDescendants":true}`)
	if code != 200 {
		t.Fatalf("create: %d %v", code, body)
	}
	h.pool(t, h.root, "acme.secret", "hidden")
	h.pool(t, h.root, "acme.open", "shown")
	h.pool(t, h.root, "acme", "own")
	got := rcv.wait(t, "pool.created", 2)
	// The fan-out goes in seq order: once acme's own event is delivered,
	// acme.secret's (older) was passed over.
	poll.UntilNil(t, 20*time.Second, "acme's own event fanned out", func() error {
		if n := h.count(t, `SELECT count(*) FROM webhook_deliveries d JOIN outbox o ON o.id = d.event_id WHERE o.tenant_id = 'acme' AND o.type = 'pool.created'`); n != 1 {
			time.Sleep(20 * time.Millisecond) // between reads
			return fmt.Errorf("%d deliveries", n)
		}
		return nil
	})
	if n := h.count(t, `SELECT count(*) FROM webhook_deliveries d JOIN outbox o ON o.id = d.event_id WHERE o.tenant_id = 'acme.secret'`); n != 0 {
		t.Fatalf("%d deliveries of acme.secret's events, which its policies forbid", n)
	}
	for _, g := range got {
		if strings.Contains(string(g.Body), `"acme.secret"`) {
			t.Fatalf("delivered %s", g.Body)
		}
	}
}
