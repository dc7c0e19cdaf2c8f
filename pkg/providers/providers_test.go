package providers_test

import (
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/providers"
)

const token = "prov-token-9f3e1d-secret"

// loopback is the outbound client of these tests: the production rules,
// except that http to loopback — the httptest servers — is allowed.
func loopback(t *testing.T) *outbound.Client {
	t.Helper()
	c := outbound.NewClient(outbound.Options{Setting: "providers", AllowInsecure: true, AllowLoopback: true})
	t.Cleanup(c.CloseIdleConnections)
	return c
}

func setup(t *testing.T, delay time.Duration) (*providers.Fake, *providers.Client) {
	t.Helper()
	f := providers.NewFake(providers.FakeConfig{Token: token, ProvisionDelay: delay})
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c, err := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: token, Backoff: time.Millisecond, Timeout: 5 * time.Second, HTTP: loopback(t)})
	if err != nil {
		t.Fatal(err)
	}
	return f, c
}

var req = providers.CreateRequest{IdempotencyKey: "inst_1", Size: providers.Size{VCPUs: 2, MemoryMiB: 2048, DiskGiB: 20}, Image: "ubuntu-24.04"}

func TestCreateIsIdempotentByKey(t *testing.T) {
	t.Parallel()
	f, c := setup(t, 0)
	a, err := c.Create(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Create(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if a.ID != b.ID || a.State != providers.StateRunning {
		t.Fatalf("two creates under one key: %+v and %+v", a, b)
	}
	if n := len(f.MachinesFor("inst_1")); n != 1 {
		t.Fatalf("%d machines for one key", n)
	}
	other := req
	other.Image = "debian-12"
	if _, err := c.Create(t.Context(), other); !errors.Is(err, providers.ErrConflict) {
		t.Fatalf("same key, different request: %v, want ErrConflict", err)
	}
}

func TestDroppedCreateRetriesToTheSameMachine(t *testing.T) {
	t.Parallel()
	f, c := setup(t, 0)
	f.DropAfterCreate(1)
	m, err := c.Create(t.Context(), req)
	if err != nil {
		t.Fatalf("the client retries a dropped create: %v", err)
	}
	if ms := f.Machines(); len(ms) != 1 || ms[0].ID != m.ID {
		t.Fatalf("machines %+v, want one: %s", ms, m.ID)
	}
	calls := f.Calls()
	if len(calls) != 2 || calls[0].Status != 0 || calls[1].IdempotencyKey != "inst_1" {
		t.Fatalf("calls %+v", calls)
	}
}

func TestRetriesBoundedOn5xxAnd429(t *testing.T) {
	t.Parallel()
	f, c := setup(t, 0)
	m, _ := c.Create(t.Context(), req)
	f.FailNext(2, 503, 0)
	if _, err := c.Get(t.Context(), m.ID); err != nil {
		t.Fatalf("two 503s then success within 3 attempts: %v", err)
	}
	f.FailNext(3, 503, 0)
	if _, err := c.Get(t.Context(), m.ID); !errors.Is(err, providers.ErrTransient) {
		t.Fatalf("three 503s: %v, want ErrTransient", err)
	}
	f.FailNext(1, 429, 1)
	if _, err := c.Get(t.Context(), m.ID); err != nil {
		t.Fatalf("a 429 with Retry-After 1 then success: %v", err)
	}
	f.FailNext(3, 429, 60)
	_, err := c.Get(t.Context(), m.ID)
	if !errors.Is(err, providers.ErrRateLimited) || !errors.Is(err, providers.ErrTransient) || providers.RetryAfter(err) != time.Minute {
		t.Fatalf("429 past MaxRetryAfter: %v (retry after %s)", err, providers.RetryAfter(err))
	}
}

func TestPowerAndDeleteAreIdempotent(t *testing.T) {
	t.Parallel()
	f, c := setup(t, 0)
	m, _ := c.Create(t.Context(), req)
	for range 2 {
		if got, err := c.Stop(t.Context(), m.ID); err != nil || got.State != providers.StateStopped {
			t.Fatalf("stop: %+v %v", got, err)
		}
	}
	for range 2 {
		if got, err := c.Start(t.Context(), m.ID); err != nil || got.State != providers.StateRunning {
			t.Fatalf("start: %+v %v", got, err)
		}
	}
	for range 2 {
		if err := c.Delete(t.Context(), m.ID); err != nil {
			t.Fatalf("delete (a gone machine is success): %v", err)
		}
	}
	if _, err := c.Get(t.Context(), m.ID); !errors.Is(err, providers.ErrNotFound) {
		t.Fatalf("get deleted: %v", err)
	}
	if ms := f.Machines(); !ms[0].Deleted {
		t.Fatalf("machine %+v not deleted", ms[0])
	}
}

func TestProvisioningDelay(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	f := providers.NewFake(providers.FakeConfig{Token: token, ProvisionDelay: time.Minute, Now: func() time.Time { return now }})
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c, _ := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: token, HTTP: loopback(t)})
	m, err := c.Create(t.Context(), req)
	if err != nil || m.State != providers.StatePending {
		t.Fatalf("create: %+v %v, want pending", m, err)
	}
	now = now.Add(2 * time.Minute)
	if m, _ = c.Get(t.Context(), m.ID); m.State != providers.StateRunning {
		t.Fatalf("after the delay: %s, want running", m.State)
	}
	if m, _ = c.Stop(t.Context(), m.ID); m.State != providers.StateStopping {
		t.Fatalf("stop: %s, want stopping", m.State)
	}
}

func TestBadTokenIsRejectedAndNeverShown(t *testing.T) {
	t.Parallel()
	f := providers.NewFake(providers.FakeConfig{Token: token})
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	bad, _ := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: "wrong-token-xyz", HTTP: loopback(t)})
	_, err := bad.Create(t.Context(), req)
	if !errors.Is(err, providers.ErrRejected) || strings.Contains(err.Error(), "wrong-token-xyz") {
		t.Fatalf("bad token: %v", err)
	}
	if len(f.Machines()) != 0 {
		t.Fatal("an unauthorized create made a machine")
	}
	if s := (providers.Credentials{Token: token}).String(); strings.Contains(s, token) {
		t.Fatalf("credentials print their token: %s", s)
	}
	if _, err := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: "has space", HTTP: loopback(t)}); err == nil || strings.Contains(err.Error(), "has space") {
		t.Fatalf("bad token: %v", err)
	}
}

func TestValidEndpoint(t *testing.T) {
	t.Parallel()
	dev := outbound.Options{AllowInsecure: true, AllowPrivateNetworks: true}
	for _, tc := range []struct {
		raw string
		o   outbound.Options
		ok  bool
	}{
		{"https://api.example.com/v2", outbound.Options{}, true},
		{"http://127.0.0.1:8090", dev, true},
		{"http://localhost:1", dev, true},
		{"http://[::1]:9", dev, true},
		{"http://api.example.com", dev, false},
		{"ftp://x", dev, false},
		{"https://user:pw@x", dev, false},
		{"https://x/?a=1", dev, false},
		{"https://x/?", dev, false},
		{"https://x/#f", dev, false},
		{"", dev, false},
		{"/relative", dev, false},
		{"https://" + strings.Repeat("a", 3000), dev, false},
	} {
		err := providers.ValidEndpoint(tc.raw, tc.o)
		if (err == nil) != tc.ok {
			t.Errorf("ValidEndpoint(%.40q) = %v, want ok %v", tc.raw, err, tc.ok)
		}
		if fe, ok := fault.As(err); err != nil && (!ok || fe.Code != fault.InvalidInput || fe.Field != "provider.endpoint") {
			t.Errorf("ValidEndpoint(%.40q) = %v, want INVALID_INPUT on provider.endpoint", tc.raw, err)
		}
	}
}

// TestProviderEndpointMetadataAddressRefused: the endpoints of the review
// — the metadata service, etcd on a private address, NATS and PostgreSQL
// on loopback — and the other spellings of such addresses are refused as
// the endpoint is checked (INVALID_INPUT on provider.endpoint), and a
// client for one fails before any request with the fixed reason, not a
// dial. With an allowlist, a public host outside it is refused too.
func TestProviderEndpointMetadataAddressRefused(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{
		"https://169.254.169.254/", "https://10.0.0.1:2379/", "http://127.0.0.1:8222/", "http://localhost:5432/",
		"https://[::ffff:169.254.169.254]/", "https://[64:ff9b::a9fe:a9fe]/", "https://0xa9fea9fe/", "https://2852039166/",
		"https://169.254.169.254./", "https://metadata.localhost/", "https://[fd00:ec2::254]/", "https://100.100.100.200/",
		"https://192.168.1.1:8443/", "https://[2002:a00:1::]/", "https://api.example.com:99999/",
	} {
		for _, o := range []outbound.Options{{}, {AllowInsecure: true}} {
			fe, ok := fault.As(providers.ValidEndpoint(raw, o))
			if !ok || fe.Code != fault.InvalidInput || fe.Field != "provider.endpoint" {
				t.Errorf("ValidEndpoint(%s, insecure %v) = %v, want INVALID_INPUT on provider.endpoint", raw, o.AllowInsecure, fe)
			}
		}
		_, err := providers.NewClient(providers.ClientConfig{Endpoint: raw, Token: token})
		var pe *providers.Error
		if !errors.As(err, &pe) || !errors.Is(err, providers.ErrRejected) || pe.Reason() != "destination refused" {
			t.Errorf("NewClient(%s) = %v, want ErrRejected, destination refused", raw, err)
		}
	}
	// The metadata address stays refused with private networks allowed.
	if err := providers.ValidEndpoint("https://169.254.169.254/", outbound.Options{AllowPrivateNetworks: true}); err == nil {
		t.Error("metadata accepted with allowPrivateNetworks")
	}
	allow := outbound.Options{AllowedHosts: []string{"api.provider.example", "*.eu.provider.example"}}
	for raw, ok := range map[string]bool{
		"https://api.provider.example/v1": true, "https://x.eu.provider.example/": true,
		"https://evil.example.com/": false, "https://eu.provider.example/": false,
	} {
		if err := providers.ValidEndpoint(raw, allow); (err == nil) != ok {
			t.Errorf("allowlist: ValidEndpoint(%s) = %v, want ok %v", raw, err, ok)
		}
	}
}

// TestProviderRedirectToLoopbackNotFollowed: a provider answering 302 to
// another (loopback) server does not make the client request it; the call
// fails for good with "HTTP status 302".
func TestProviderRedirectToLoopbackNotFollowed(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	inner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		_, _ = w.Write([]byte(`{"id":"m-1","state":"running"}`))
	}))
	t.Cleanup(inner.Close)
	outer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, inner.URL+"/internal/secrets", http.StatusFound)
	}))
	t.Cleanup(outer.Close)
	c, err := providers.NewClient(providers.ClientConfig{Endpoint: outer.URL, Token: token, HTTP: loopback(t)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Get(t.Context(), "m-1")
	var pe *providers.Error
	if !errors.As(err, &pe) || !errors.Is(err, providers.ErrRejected) || pe.Reason() != "HTTP status 302" {
		t.Fatalf("get: %v, want ErrRejected, HTTP status 302", err)
	}
	if hits.Load() != 0 {
		t.Fatal("the redirect was followed")
	}
}

// TestProviderErrorTextNotShownToTenant: what a provider (or the network)
// says goes to the log only: the tenant's reason is the fixed class — the
// status, "connection failed", "invalid response" — without the answer's
// text or any address.
func TestProviderErrorTextNotShownToTenant(t *testing.T) {
	t.Parallel()
	const leak = "pg_hba.conf rejects 10.0.0.7:5432"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/machines/m-400":
			w.WriteHeader(http.StatusBadRequest)
			_, _ = w.Write([]byte(`{"message":"` + leak + `"}`))
		case "/v1/machines/m-html":
			_, _ = w.Write([]byte("<html>" + leak + "</html>"))
		}
	}))
	t.Cleanup(srv.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String()
	_ = ln.Close()
	for _, tc := range []struct{ endpoint, id, want string }{
		{srv.URL, "m-400", "HTTP status 400"},
		{srv.URL, "m-html", "invalid response"},
		{closed, "m-1", "connection failed"},
	} {
		c, err := providers.NewClient(providers.ClientConfig{Endpoint: tc.endpoint, Token: token, HTTP: loopback(t), Attempts: 1})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Get(t.Context(), tc.id)
		var pe *providers.Error
		if !errors.As(err, &pe) || pe.Reason() != tc.want {
			t.Fatalf("get %s: %v, want reason %q", tc.id, err, tc.want)
		}
		if r := pe.Reason(); strings.Contains(r, "10.0.0.7") || strings.Contains(r, "127.0.0.1") || strings.Contains(r, "pg_hba") {
			t.Fatalf("the reason %q shows the provider's text or an address", r)
		}
	}
}
