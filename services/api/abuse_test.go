package api_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestAnonymousRequestsAreLimitedPerAddress: System.Version and
// System.Health answer anyone, so a client address gets a budget of them
// (here a burst of 3); beyond it, RATE_LIMITED, over gRPC and REST alike
// (REST by the client's own address, through the in-process gateway),
// until the bucket refills. A credentialled caller is not held to it.
func TestAnonymousRequestsAreLimitedPerAddress(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{AnonymousPerSecond: 1, AnonymousBurst: 3})
	sys := computev1.NewSystemServiceClient(h.conn)
	for i := range 3 {
		if _, err := sys.Version(t.Context(), &computev1.VersionRequest{}); err != nil {
			t.Fatalf("anonymous call %d: %v", i, err)
		}
	}
	_, err := sys.Version(t.Context(), &computev1.VersionRequest{})
	wantCode(t, err, fault.RateLimited, "")
	code, body := h.rest(t, "", "system/health", `{}`)
	wantREST(t, code, body, fault.RateLimited, "")
	if _, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("a credentialled call: %v", err)
	}
	h.clock.Advance(2 * time.Second)
	if _, err := sys.Version(t.Context(), &computev1.VersionRequest{}); err != nil {
		t.Fatalf("after the bucket refilled: %v", err)
	}
}

// TestBadKeyFromSharedAddressDoesNotLockOutValidKey: behind a NAT or an
// ingress one address is many users. A client there guessing keys spends
// the address's budget of failures (here 5), after which its guesses are
// RATE_LIMITED until the bucket refills; but a valid key from the same
// address still works, over gRPC, REST and the SSE watch. (It used to be
// refused too: one bad client locked every user of the address out of the
// API, the console and MCP.)
func TestBadKeyFromSharedAddressDoesNotLockOutValidKey(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{FailedAuthPerSecond: 1, FailedAuthBurst: 5})
	sys := computev1.NewSystemServiceClient(h.conn)
	// Guesses of the root key's secret: right id, wrong secret.
	id, _, _ := strings.Cut(h.root, ".")
	guess := func(i int) string { return id + ".wrongsecret" + strings.Repeat("x", i) }
	for i := range 5 {
		_, err := sys.WhoAmI(as(guess(i)), &computev1.WhoAmIRequest{})
		if c, _ := envelope(err); c != fault.Unauthenticated {
			t.Fatalf("guess %d: %v, want UNAUTHENTICATED", i, err)
		}
	}
	_, err := sys.WhoAmI(as(guess(9)), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.RateLimited, "")
	// REST is keyed by the client's own address, which a forged
	// X-Forwarded-For does not change (the gateway appends the real one,
	// and no proxy is trusted).
	if code, body := restFrom(t, h, "127.0.0.1", "203.0.113.9", guess(10), "system/whoAmI"); !isRateLimited(body) {
		t.Fatalf("a guess with a forged X-Forwarded-For from the same address: %d %s, want RATE_LIMITED", code, body)
	}
	// The valid key from the same, spent address works everywhere.
	if _, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("the valid key over gRPC from the spent address: %v", err)
	}
	if code, body := restFrom(t, h, "127.0.0.1", "", h.root, "system/whoAmI"); code != http.StatusOK {
		t.Fatalf("the valid key over REST from the spent address: %d %s", code, body)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, h.base+api.WatchPath+"?tenantId=root", nil)
	req.Header.Set("Authorization", "Bearer "+h.root)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the events watch with the valid key from the spent address: %d", resp.StatusCode)
	}
	// A guess from another address is its own budget.
	if code, body := restFrom(t, h, "127.0.0.2", "", guess(11), "system/whoAmI"); code != http.StatusUnauthorized {
		t.Fatalf("a guess from another address: %d %s, want 401", code, body)
	}
	h.clock.Advance(2 * time.Second)
	_, err = sys.WhoAmI(as(guess(12)), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.Unauthenticated, "authorization")
}

// TestForwardedForFromUntrustedPeerIgnored: with a trusted proxy
// configured (127.0.0.2), a client connecting from any other address
// (127.0.0.1) cannot choose the address it is counted as by sending
// X-Forwarded-For: every guess counts against its own address however the
// header changes, so a new header per guess does not escape the budget.
func TestForwardedForFromUntrustedPeerIgnored(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{FailedAuthPerSecond: 1, FailedAuthBurst: 5}, func(c *config.Config) {
		c.Server.TrustedProxies = []string{"127.0.0.2"}
	})
	for i := range 5 {
		if code, body := restFrom(t, h, "127.0.0.1", fmt.Sprintf("203.0.113.%d", i+1), "bck_nope.nope", "system/whoAmI"); code != http.StatusUnauthorized {
			t.Fatalf("guess %d: %d %s, want 401", i, code, body)
		}
	}
	if code, body := restFrom(t, h, "127.0.0.1", "203.0.113.99", "bck_nope.nope", "system/whoAmI"); !isRateLimited(body) {
		t.Fatalf("a guess with yet another X-Forwarded-For from the spent untrusted peer: %d %s, want RATE_LIMITED", code, body)
	}
	// The same over gRPC, whose metadata may carry x-forwarded-for too.
	ctx := metadata.AppendToOutgoingContext(as("bck_nope.nope"), "x-forwarded-for", "203.0.113.100")
	_, err := computev1.NewSystemServiceClient(h.conn).WhoAmI(ctx, &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.RateLimited, "")
	// Through the trusted proxy, that header names the client.
	if code, body := restFrom(t, h, "127.0.0.2", "203.0.113.99", "bck_nope.nope", "system/whoAmI"); code != http.StatusUnauthorized {
		t.Fatalf("a guess through the trusted proxy for another client: %d %s, want 401", code, body)
	}
}

// TestForwardedForRightMostUntrusted: behind a chain of trusted proxies
// (127.0.0.1, then 10.0.0.0/8) the client is the right-most
// X-Forwarded-For entry that is not a trusted proxy. A client that
// prepends forged entries is still counted as itself, and other clients of
// the same proxies are not held to its budget.
func TestForwardedForRightMostUntrusted(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{FailedAuthPerSecond: 1, FailedAuthBurst: 5}, func(c *config.Config) {
		c.Server.TrustedProxies = []string{"127.0.0.1/32", "10.0.0.0/8"}
	})
	via := func(client string) string { return "198.51.100.7, " + client + ", 10.1.2.3" }
	for i := range 5 {
		forged := fmt.Sprintf("198.51.100.%d, 203.0.113.5, 10.1.2.3", i+1)
		if code, body := restFrom(t, h, "127.0.0.1", forged, "bck_nope.nope", "system/whoAmI"); code != http.StatusUnauthorized {
			t.Fatalf("guess %d: %d %s, want 401", i, code, body)
		}
	}
	if code, body := restFrom(t, h, "127.0.0.1", via("203.0.113.5"), "bck_nope.nope", "system/whoAmI"); !isRateLimited(body) {
		t.Fatalf("the guesser behind the proxies: %d %s, want RATE_LIMITED", code, body)
	}
	// A direct gRPC client through the trusted proxy: the same client.
	ctx := metadata.AppendToOutgoingContext(as("bck_nope.nope"), "x-forwarded-for", "203.0.113.5")
	_, err := computev1.NewSystemServiceClient(h.conn).WhoAmI(ctx, &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.RateLimited, "")
	// Another client of the same proxies is not held to it…
	if code, body := restFrom(t, h, "127.0.0.1", via("203.0.113.6"), "bck_nope.nope", "system/whoAmI"); code != http.StatusUnauthorized {
		t.Fatalf("another client behind the proxies: %d %s, want 401", code, body)
	}
	// …and the guesser's address with a valid key works.
	if code, body := restFrom(t, h, "127.0.0.1", via("203.0.113.5"), h.root, "system/whoAmI"); code != http.StatusOK {
		t.Fatalf("a valid key from the guesser's address: %d %s", code, body)
	}
}

// restFrom POSTs {} to a REST method from local address from (a loopback
// address other than 127.0.0.1 is another client), with an
// X-Forwarded-For header when xff is set.
func restFrom(t *testing.T, h *harness, from, xff, token, path string) (int, string) {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
	c := &http.Client{Transport: &http.Transport{DialContext: d.DialContext}}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, h.base+"/api/compute/"+path, strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	if xff != "" {
		req.Header.Set("X-Forwarded-For", xff)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

func isRateLimited(body string) bool { return strings.Contains(body, string(fault.RateLimited)) }
