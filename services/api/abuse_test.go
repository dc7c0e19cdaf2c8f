package api_test

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

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

// TestFailedAuthenticationsAreLimitedPerAddress: guessing keys costs the
// guesser's address its budget of failures (here 5); then every request
// from it, even with a valid key, is RATE_LIMITED before any lookup, until
// the bucket refills — while the same valid key from elsewhere works.
func TestFailedAuthenticationsAreLimitedPerAddress(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{FailedAuthPerSecond: 1, FailedAuthBurst: 5})
	sys := computev1.NewSystemServiceClient(h.conn)
	// Guesses of the root key's secret: right id, wrong secret.
	id, _, _ := strings.Cut(h.root, ".")
	for i := range 5 {
		_, err := sys.WhoAmI(as(id+".wrongsecret"+strings.Repeat("x", i)), &computev1.WhoAmIRequest{})
		if c, _ := envelope(err); c != fault.Unauthenticated {
			t.Fatalf("guess %d: %v, want UNAUTHENTICATED", i, err)
		}
	}
	_, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.RateLimited, "")
	// REST is keyed by the client's own address, which a forged
	// X-Forwarded-For does not change (the gateway appends the real one)…
	code, body := restFrom(t, h, "127.0.0.1", "203.0.113.9", h.root, "system/whoAmI")
	if !isRateLimited(body) {
		t.Fatalf("a forged X-Forwarded-For from the same address: %d %s, want RATE_LIMITED", code, body)
	}
	// …while the same valid key from another address works.
	if code, body := restFrom(t, h, "127.0.0.2", "", h.root, "system/whoAmI"); code != http.StatusOK {
		t.Fatalf("the valid key from another address: %d %s", code, body)
	}
	h.clock.Advance(2 * time.Second)
	if _, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("after the bucket refilled: %v", err)
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
