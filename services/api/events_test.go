package api_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
	"github.com/bettercompute/bettercompute/services/api"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// eventsSetup runs every role with a bus, the relay polling fast, and
// webhooks allowed to loopback.
func eventsSetup(t *testing.T) *harness {
	t.Helper()
	ns := natstest.New(t)
	return setupWith(t, api.Tuning{}, func(c *config.Config) {
		c.NATS.URL = ns.URL()
		c.Events.Poll = config.Duration(5 * time.Millisecond)
		c.Webhooks.AllowInsecure = true
		c.Webhooks.AllowPrivateNetworks = true
		c.Webhooks.Poll = config.Duration(20 * time.Millisecond)
		c.Webhooks.RetrySchedule = []config.Duration{config.Duration(50 * time.Millisecond)}
	})
}

// hookReceiver records signed requests; it accepts a request whose
// signatures verify under every key in want.
type hookReceiver struct {
	srv  *httptest.Server
	mu   sync.Mutex
	want [][]byte
	got  []hookRequest
}

type hookRequest struct {
	ID, Type string
	Header   http.Header
	Body     []byte
}

func newHookReceiver(t *testing.T) *hookReceiver {
	r := &hookReceiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		b, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, k := range r.want {
			if err := webhooks.Verify(k, req.Header, b, time.Now(), time.Minute); err != nil {
				w.WriteHeader(http.StatusUnauthorized)
				return
			}
		}
		var body struct {
			Type string `json:"type"`
		}
		_ = json.Unmarshal(b, &body)
		r.got = append(r.got, hookRequest{ID: req.Header.Get(webhooks.HeaderID), Type: body.Type, Header: req.Header.Clone(), Body: b})
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *hookReceiver) setKeys(keys ...[]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.want = keys
}

// wait returns the first request of typ, waiting up to 20 s.
func (r *hookReceiver) wait(t *testing.T, typ string, n int) []hookRequest {
	t.Helper()
	var out []hookRequest
	poll.UntilNil(t, 20*time.Second, fmt.Sprintf("%d %s deliveries", n, typ), func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		out = nil
		for _, g := range r.got {
			if g.Type == typ {
				out = append(out, g)
			}
		}
		if len(out) >= n {
			return nil
		}
		return fmt.Errorf("have %d", len(out))
	})
	return out
}

func TestWebhooksEndToEndThroughTheAPI(t *testing.T) {
	t.Parallel()
	h := eventsSetup(t)
	rcv := newHookReceiver(t)

	// Bad input names its field and creates nothing.
	for _, c := range []struct {
		body, field string
	}{
		{`{"tenantId":"root","url":"http://example.com/hook","eventTypes":["pool.*"]}`, "url"},
		{`{"tenantId":"root","url":"ftp://127.0.0.1/x","eventTypes":["pool.*"]}`, "url"},
		{`{"tenantId":"root","url":"` + rcv.srv.URL + `","eventTypes":[]}`, "eventTypes"},
		{`{"tenantId":"root","url":"` + rcv.srv.URL + `","eventTypes":["pool.nonsense"]}`, "eventTypes"},
		{`{"tenantId":"root","url":"` + rcv.srv.URL + `","eventTypes":["Pool!"]}`, "eventTypes"},
		{`{"tenantId":"root","url":"` + rcv.srv.URL + `","eventTypes":["*"],"description":"` + strings.Repeat("x", 257) + `"}`, "description"},
	} {
		code, body := h.rest(t, h.root, "webhooks/create", c.body)
		wantREST(t, code, body, fault.InvalidInput, c.field)
	}
	if n := h.count(t, `SELECT count(*) FROM webhooks`); n != 0 {
		t.Fatalf("%d webhooks after bad input", n)
	}

	code, body := h.rest(t, h.root, "webhooks/create", `{"tenantId":"root","url":"`+rcv.srv.URL+`","eventTypes":["pool.*","webhook.test"],"idempotencyKey":"w1"}`)
	if code != 200 {
		t.Fatalf("create: %d %v", code, body)
	}
	secret, _ := body["secret"].(string)
	hook := body["webhook"].(map[string]any)
	id := hook["id"].(string)
	key, err := webhooks.ParseSecret(secret)
	if err != nil || !strings.HasPrefix(secret, "whsec_") {
		t.Fatalf("secret %q: %v", secret, err)
	}
	// A replay returns the webhook without the secret; no event carries it.
	_, replay := h.rest(t, h.root, "webhooks/create", `{"tenantId":"root","url":"`+rcv.srv.URL+`","eventTypes":["pool.*","webhook.test"],"idempotencyKey":"w1"}`)
	if s, _ := replay["secret"].(string); s != "" || replay["webhook"].(map[string]any)["id"] != id {
		t.Fatalf("replay %v", replay)
	}
	if n := h.count(t, `SELECT count(*) FROM outbox WHERE payload::text LIKE '%whsec_%'`); n != 0 {
		t.Fatalf("%d events carry a webhook secret", n)
	}

	rcv.setKeys(key)
	h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"first"}`)
	first := rcv.wait(t, "pool.created", 1)[0]
	if !strings.HasPrefix(first.ID, "evt_") {
		t.Fatalf("webhook-id %q", first.ID)
	}

	// Rotation: both secrets sign during the overlap.
	code, rot := h.rest(t, h.root, "webhooks/rotateSecret", `{"tenantId":"root","webhookId":"`+id+`"}`)
	if code != 200 {
		t.Fatalf("rotate: %d %v", code, rot)
	}
	newKey, err := webhooks.ParseSecret(rot["secret"].(string))
	if err != nil {
		t.Fatal(err)
	}
	rcv.setKeys(key, newKey) // each must verify on its own
	h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"second"}`)
	second := rcv.wait(t, "pool.created", 2)[1]
	if sigs := strings.Fields(second.Header.Get(webhooks.HeaderSignature)); len(sigs) != 2 {
		t.Fatalf("signatures %v: want two during the overlap", sigs)
	}

	// webhooks.test reaches this webhook now.
	code, tested := h.rest(t, h.root, "webhooks/test", `{"tenantId":"root","webhookId":"`+id+`"}`)
	if code != 200 {
		t.Fatalf("test: %d %v", code, tested)
	}
	rcv.wait(t, "webhook.test", 1)

	// Deliveries are listed, and a redelivery sends the same webhook-id.
	// The receiver answers before the deliverer marks the delivery
	// succeeded: wait for all three to settle.
	var ds []any
	poll.UntilNil(t, 30*time.Second, "three succeeded deliveries", func() error {
		code, list := h.rest(t, h.root, "webhooks/listDeliveries", `{"tenantId":"root","webhookId":"`+id+`","state":"succeeded"}`)
		if code != 200 {
			t.Fatalf("listDeliveries: %d %v", code, list)
		}
		ds, _ = list["deliveries"].([]any)
		if len(ds) < 3 {
			time.Sleep(20 * time.Millisecond) // between reads, not an assertion
			return fmt.Errorf("%d succeeded deliveries: %v", len(ds), list)
		}
		return nil
	})
	var firstDelivery string
	for _, d := range ds {
		m := d.(map[string]any)
		if m["eventId"] == first.ID {
			firstDelivery = m["id"].(string)
		}
	}
	code, red := h.rest(t, h.root, "webhooks/redeliver", `{"tenantId":"root","deliveryId":"`+firstDelivery+`"}`)
	if code != 200 {
		t.Fatalf("redeliver: %d %v", code, red)
	}
	again := rcv.wait(t, "pool.created", 3)[2]
	if again.ID != first.ID {
		t.Fatalf("redelivery webhook-id %s, want %s", again.ID, first.ID)
	}
	code, body = h.rest(t, h.root, "webhooks/listDeliveries", `{"tenantId":"root","webhookId":"`+id+`","state":"done"}`)
	wantREST(t, code, body, fault.InvalidInput, "state")
	code, body = h.rest(t, h.root, "webhooks/redeliver", `{"tenantId":"root","deliveryId":"nope"}`)
	wantREST(t, code, body, fault.InvalidInput, "deliveryId")

	// Update and disable; get and list show it.
	code, up := h.rest(t, h.root, "webhooks/update", `{"tenantId":"root","webhookId":"`+id+`","enabled":false,"description":"paused"}`)
	if code != 200 || up["webhook"].(map[string]any)["enabled"] == true || up["webhook"].(map[string]any)["disabledReason"] != "by request" {
		t.Fatalf("update: %d %v", code, up)
	}
	code, got := h.rest(t, h.root, "webhooks/get", `{"tenantId":"root","webhookId":"`+id+`"}`)
	if code != 200 || got["webhook"].(map[string]any)["description"] != "paused" || got["secret"] != nil {
		t.Fatalf("get: %d %v", code, got)
	}
	code, body = h.rest(t, h.root, "webhooks/delete", `{"tenantId":"root","webhookId":"`+id+`"}`)
	if code != 200 {
		t.Fatalf("delete: %d %v", code, body)
	}
	code, body = h.rest(t, h.root, "webhooks/get", `{"tenantId":"root","webhookId":"`+id+`"}`)
	wantREST(t, code, body, fault.NotFound, "webhookId")
}

func TestWebhooksOfAnotherTenantAreNotFound(t *testing.T) {
	t.Parallel()
	h := eventsSetup(t)
	_, keyA := h.member(t, "acme", "alice")
	_, keyB := h.member(t, "beta", "bob")
	h.policy(t, "acme", "admin", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	h.policy(t, "beta", "admin", `permit (principal in Tenant::"beta", action, resource in Tenant::"beta");`)
	code, body := h.rest(t, keyA, "webhooks/create", `{"tenantId":"acme","url":"https://hooks.example.com/a","eventTypes":["*"]}`)
	if code != 200 {
		t.Fatalf("create: %d %v", code, body)
	}
	id := body["webhook"].(map[string]any)["id"].(string)
	code, body = h.rest(t, keyB, "webhooks/get", `{"tenantId":"beta","webhookId":"`+id+`"}`)
	wantREST(t, code, body, fault.NotFound, "webhookId")
	code, body = h.rest(t, keyB, "webhooks/get", `{"tenantId":"acme","webhookId":"`+id+`"}`)
	wantREST(t, code, body, fault.AccessDenied, "tenantId")
	code, body = h.rest(t, keyB, "events/list", `{"tenantId":"acme"}`)
	wantREST(t, code, body, fault.AccessDenied, "tenantId")
}

// sseEvent is one Server-Sent Event: Event is its type ("" for a
// message, "error" for the envelope a failed stream ends with).
type sseEvent struct {
	ID    string
	Event string
	Data  map[string]any
}

// sse opens the watch stream as root and returns a channel of its events.
func (h *harness) sse(ctx context.Context, t *testing.T, query, lastID string) (<-chan sseEvent, int) {
	t.Helper()
	out, code, _ := h.sseAs(ctx, t, h.root, query, lastID)
	return out, code
}

// sseAs opens the watch stream with token and returns a channel of its
// events, closed when the stream ends; or, when the answer is not 200, its
// status and decoded body.
func (h *harness) sseAs(ctx context.Context, t testing.TB, token, query, lastID string) (<-chan sseEvent, int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, h.base+api.WatchPath+"?"+query, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	resp, err := http.DefaultClient.Do(req) //nolint:bodyclose // closed by the reader goroutine, or below
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan sseEvent, 100)
	if resp.StatusCode != http.StatusOK {
		var body map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&body)
		_ = resp.Body.Close()
		close(out)
		return out, resp.StatusCode, body
	}
	go func() {
		defer close(out)
		defer func() { _ = resp.Body.Close() }()
		sc := bufio.NewScanner(resp.Body)
		var ev sseEvent
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "id: "):
				ev.ID = strings.TrimPrefix(line, "id: ")
			case strings.HasPrefix(line, "event: "):
				ev.Event = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				_ = json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &ev.Data)
			case line == "" && (ev.ID != "" || ev.Event != ""):
				out <- ev
				ev = sseEvent{}
			}
		}
	}()
	return out, resp.StatusCode, nil
}

func next(t testing.TB, c <-chan sseEvent) sseEvent {
	t.Helper()
	select {
	case ev, ok := <-c:
		if !ok {
			t.Fatal("stream ended")
		}
		return ev
	case <-time.After(20 * time.Second):
		t.Fatal("timed out waiting for an event")
	}
	return sseEvent{}
}

func TestEventsWatchResumesWithLastEventID(t *testing.T) {
	t.Parallel()
	h := eventsSetup(t)
	ctx, cancel := context.WithCancel(context.Background())
	stream, code := h.sse(ctx, t, "tenantId=root&types=pool.created", "")
	if code != 200 {
		t.Fatalf("watch: %d", code)
	}
	for i := range 3 {
		h.rest(t, h.root, "pools/create", fmt.Sprintf(`{"tenantId":"root","class":"gpu","name":"p%d"}`, i))
	}
	var seen []sseEvent
	for range 3 {
		seen = append(seen, next(t, stream))
	}
	for i, ev := range seen {
		if ev.Data["type"] != "pool.created" || ev.Data["cursor"] != ev.ID {
			t.Fatalf("event %d: %v", i, ev)
		}
	}
	cancel()
	// While away: two more, and one of another type.
	h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"p3"}`)
	h.rest(t, h.root, "tenants/create", `{"tenantId":"root","childTenantId":"zed"}`)
	h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"p4"}`)

	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	resumed, code := h.sse(ctx2, t, "tenantId=root&types=pool.created", seen[1].ID)
	if code != 200 {
		t.Fatalf("resume: %d", code)
	}
	var want []string
	for _, ev := range []sseEvent{next(t, resumed), next(t, resumed), next(t, resumed)} {
		if ev.Data["type"] != "pool.created" {
			t.Fatalf("resumed with %v", ev)
		}
		want = append(want, ev.ID)
	}
	if want[0] != seen[2].ID {
		t.Fatalf("resume after %s started at %s, want %s", seen[1].ID, want[0], seen[2].ID)
	}
	// Events.list agrees, in order.
	code, list := h.rest(t, h.root, "events/list", `{"tenantId":"root","types":["pool.created"],"after":"`+seen[1].ID+`"}`)
	evs, _ := list["events"].([]any)
	if code != 200 || len(evs) != 3 {
		t.Fatalf("list after %s: %d %v", seen[1].ID, code, list)
	}
	for i, e := range evs {
		if e.(map[string]any)["cursor"] != want[i] {
			t.Fatalf("list %d = %v, want cursor %s", i, e, want[i])
		}
	}

	// Bad input.
	_, code = h.sse(context.Background(), t, "tenantId=root&types=Bad!", "")
	if code != 400 {
		t.Fatalf("bad types: %d", code)
	}
	_, code = h.sse(context.Background(), t, "tenantId=root", "not-a-cursor")
	if code != 400 {
		t.Fatalf("bad Last-Event-ID: %d", code)
	}
}

func TestEventsWatchOverGRPCAndListBySubject(t *testing.T) {
	t.Parallel()
	h := eventsSetup(t)
	ctx, cancel := context.WithTimeout(as(h.root), 30*time.Second)
	defer cancel()
	w, err := computev1.NewEventsServiceClient(h.conn).Watch(ctx, &computev1.EventsServiceWatchRequest{TenantId: "root", Types: []string{"pool.*"}})
	if err != nil {
		t.Fatal(err)
	}
	_, pool := h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"watched"}`)
	poolID := pool["pool"].(map[string]any)["id"].(string)
	got, err := w.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if e := got.GetEvent(); e.GetType() != "pool.created" || e.GetSubject() != poolID || e.GetData().GetFields()["pool"] == nil {
		t.Fatalf("watched %v", e)
	}
	code, list := h.rest(t, h.root, "events/list", `{"tenantId":"root","subject":"`+poolID+`"}`)
	evs, _ := list["events"].([]any)
	if code != 200 || len(evs) != 1 {
		t.Fatalf("list by subject: %d %v", code, list)
	}
	code, body := h.rest(t, h.root, "events/list", `{"tenantId":"root","after":"-4"}`)
	wantREST(t, code, body, fault.InvalidInput, "after")
}

func TestWebhookToAPrivateAddressIsRefusedAtCreate(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{}) // webhooks.allowPrivateNetworks and allowInsecure off
	for _, u := range []string{
		"https://10.1.2.3/hook", "https://169.254.169.254/latest", "https://[fd00:ec2::254]/x", "https://localhost/x",
		"https://127.0.0.1:8443/x", "http://127.0.0.1/x",
	} {
		code, body := h.rest(t, h.root, "webhooks/create", `{"tenantId":"root","url":"`+u+`","eventTypes":["*"]}`)
		wantREST(t, code, body, fault.InvalidInput, "url")
	}
	code, body := h.rest(t, h.root, "webhooks/create", `{"tenantId":"root","url":"https://hooks.example.com/bc","eventTypes":["*"]}`)
	if code != 200 {
		t.Fatalf("a public https endpoint: %d %v", code, body)
	}
	id := body["webhook"].(map[string]any)["id"].(string)
	code, body = h.rest(t, h.root, "webhooks/update", `{"tenantId":"root","webhookId":"`+id+`","url":"https://192.168.0.9/"}`)
	wantREST(t, code, body, fault.InvalidInput, "url")
}
