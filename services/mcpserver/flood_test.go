package mcpserver_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/mcpserver"
)

// TestInitializeFloodKeepsNoSessions is the attack of a client that opens
// session after session: 1,000 `initialize` calls (the review made 3,000)
// used to leave 1,000 sessions, each with a goroutine, kept for 30 minutes
// and still running after the server stopped. The transport is stateless
// now: no answer names a session, and once the server is closed not one
// goroutine of the MCP SDK is left. (A leak check over the MCP SDK's
// goroutines only: goleak's whole-process check cannot tell the flood's
// from the dev control plane's own, which come and go.)
func TestInitializeFloodKeepsNoSessions(t *testing.T) {
	env, _ := startEnv(t)
	conn, err := client.New(env.BaseURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if n := len(sdkGoroutines()); n != 0 {
		t.Fatalf("%d MCP goroutines before the flood", n)
	}

	srv := httptest.NewServer(mcpserver.Handler(mcpserver.Config{Conn: conn, Version: "test", RateBurst: 2 * floodCalls}))
	tr := &http.Transport{MaxIdleConnsPerHost: 8}
	hc := &http.Client{Transport: tr}
	init := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"flood","version":"0"}}}`
	const calls, workers = floodCalls, 8
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		failures []string
	)
	work := make(chan struct{})
	for range workers {
		wg.Go(func() {
			for range work {
				req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL, strings.NewReader(init))
				req.Header.Set("Authorization", "Bearer "+env.Credential)
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Accept", "application/json, text/event-stream")
				resp, err := hc.Do(req)
				if err != nil {
					mu.Lock()
					failures = append(failures, err.Error())
					mu.Unlock()
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK || resp.Header.Get("Mcp-Session-Id") != "" {
					mu.Lock()
					failures = append(failures, resp.Status+" session "+resp.Header.Get("Mcp-Session-Id"))
					mu.Unlock()
				}
			}
		})
	}
	for range calls {
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d of %d initialize calls: first %s", len(failures), calls, failures[0])
	}
	tr.CloseIdleConnections()
	srv.Close()
	poll.UntilNil(t, 10*time.Second, "no MCP goroutine left after the server's stop", func() error {
		if g := sdkGoroutines(); len(g) > 0 {
			return fmt.Errorf("%d MCP goroutines left, first:\n%s", len(g), g[0])
		}
		return nil
	})
}

// floodCalls is how many initialize calls the flood makes.
const floodCalls = 1000

// sdkGoroutines are the stacks of the goroutines running the MCP SDK's
// code.
func sdkGoroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "modelcontextprotocol/go-sdk") && !strings.Contains(g, "sdkGoroutines") {
			out = append(out, g)
		}
	}
	return out
}
