package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// syncBuffer is a buffer two goroutines can use.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestEventsWatchPrintsAndResumes(t *testing.T) {
	t.Parallel()
	base, token, _, _ := startAuditServer(t)
	f := &apiFlags{url: base, token: token, clientConfig: emptyClientConfig(t)}
	ctx, cancel := context.WithCancel(t.Context())
	var out, errb syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- runEventsWatch(ctx, f, []string{"tenantId=root", "types=tenant.created"}, false, &out, &errb)
	}()
	// New events only: create tenants (watched-1, watched-2, …) until the
	// watch, once up, prints one.
	polls, created := 0, 0
	poll.Until(t, 20*time.Second, "a tenant.created printed", func() bool {
		if strings.Contains(out.String(), "tenant.created") {
			return true
		}
		if polls%25 == 0 { // every 250 ms or so
			created++
			code, o, e := execCLI(t, "", "api", "tenants.create", "tenantId=root", fmt.Sprintf("childTenantId=watched-%d", created),
				"--url", base, "--token", token, "--client-config", f.clientConfig)
			if code != serve.ExitOK {
				t.Fatalf("tenants.create: %d %s %s", code, o, e)
			}
		}
		polls++
		return false
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("watch ended with %v", err)
	}
	fields := strings.Split(strings.SplitN(strings.TrimSpace(out.String()), "\n", 2)[0], "\t")
	if len(fields) < 5 || fields[2] != "tenant.created" || !strings.HasPrefix(fields[3], "watched-") {
		t.Fatalf("printed %q", out.String())
	}

	// after=0 replays from the start of the log; a refused filter fails at
	// once instead of retrying.
	var all syncBuffer
	ctx2, cancel2 := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel2()
	_ = runEventsWatch(ctx2, f, []string{"tenantId=root", "after=0", "types=tenant.*"}, true, &all, io.Discard)
	var ev struct{ Type, Subject string }
	if err := json.Unmarshal([]byte(strings.SplitN(all.String(), "\n", 2)[0]), &ev); err != nil || ev.Type != "tenant.created" {
		t.Fatalf("replay printed %q (%v)", all.String(), err)
	}
	err := runEventsWatch(t.Context(), f, []string{"tenantId=root", "types=Bad!"}, false, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "400") {
		t.Fatalf("a bad filter: %v, want the 400 at once", err)
	}
	if err := runEventsWatch(t.Context(), f, []string{"types=node.*"}, false, io.Discard, io.Discard); err == nil {
		t.Fatal("no tenantId accepted")
	}
}

func TestWebhooksListenVerifiesAndPrints(t *testing.T) {
	t.Parallel()
	secret, key := webhooks.NewSecret()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var out, errb syncBuffer
	go func() { _ = runWebhooksListen(ctx, addr, secret, &out, &errb) }()
	send := func(k []byte, id string) int {
		body := []byte(`{"type":"node.updated","timestamp":"2026-12-01T00:00:00Z","data":{"id":"node_a"}}`)
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+addr, bytes.NewReader(body))
		req.Header = webhooks.Headers(id, time.Now(), body, k)
		for range 100 {
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				_ = resp.Body.Close()
				return resp.StatusCode
			}
			time.Sleep(20 * time.Millisecond) // not listening yet
			req.Body = io.NopCloser(bytes.NewReader(body))
		}
		t.Fatal("the listener never answered")
		return 0
	}
	_, other := webhooks.NewSecret()
	if code := send(key, "evt_1"); code != http.StatusNoContent {
		t.Fatalf("a good delivery got %d", code)
	}
	if code := send(key, "evt_1"); code != http.StatusNoContent {
		t.Fatalf("a duplicate got %d", code)
	}
	if code := send(other, "evt_2"); code != http.StatusUnauthorized {
		t.Fatalf("a bad signature got %d", code)
	}
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	var lines []map[string]any
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, m)
	}
	if len(lines) != 2 || lines[0]["id"] != "evt_1" || lines[0]["type"] != "node.updated" || lines[0]["duplicate"] != false || lines[1]["duplicate"] != true {
		t.Fatalf("printed %v (stderr %s)", lines, errb.String())
	}
	if err := runWebhooksListen(t.Context(), addr, "", io.Discard, io.Discard); err == nil {
		t.Fatal("no secret accepted")
	}
}
