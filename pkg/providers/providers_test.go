package providers_test

import (
	"errors"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/providers"
)

const token = "prov-token-9f3e1d-secret"

func setup(t *testing.T, delay time.Duration) (*providers.Fake, *providers.Client) {
	t.Helper()
	f := providers.NewFake(providers.FakeConfig{Token: token, ProvisionDelay: delay})
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c, err := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: token, Backoff: time.Millisecond, Timeout: 5 * time.Second})
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
	c, _ := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: token})
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
	bad, _ := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: "wrong-token-xyz"})
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
	if _, err := providers.NewClient(providers.ClientConfig{Endpoint: srv.URL, Token: "has space"}); err == nil || strings.Contains(err.Error(), "has space") {
		t.Fatalf("bad token: %v", err)
	}
}

func TestValidEndpoint(t *testing.T) {
	t.Parallel()
	for raw, ok := range map[string]bool{
		"https://api.example.com/v2": true, "http://127.0.0.1:8090": true, "http://localhost:1": true, "http://[::1]:9": true,
		"http://api.example.com": false, "ftp://x": false, "https://user:pw@x": false, "https://x/?a=1": false, "": false,
		"/relative": false, "https://" + strings.Repeat("a", 3000): false,
	} {
		if err := providers.ValidEndpoint(raw); (err == nil) != ok {
			t.Errorf("ValidEndpoint(%q) = %v, want ok %v", raw, err, ok)
		}
	}
}
