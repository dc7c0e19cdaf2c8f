package session_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/state"
)

// wait is how long a test waits for the agent before failing.
const wait = 20 * time.Second

type fixture struct {
	cp    *testcontrol.Server
	store *state.Store
	id    state.Identity
	cfg   session.Config
	done  chan error
}

// setup joins a node (with certificates valid from notBefore to notAfter
// when given) and returns a session config for it.
func setup(t *testing.T, validity func() (time.Time, time.Time), opts ...testcontrol.Option) *fixture {
	t.Helper()
	cp := testcontrol.New(t, opts...)
	if validity != nil {
		cp.SetJoinValidity(validity)
	}
	store, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "sim"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	id, err := join.Join(context.Background(), join.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token, JoinserviceKey: cp.PublicKey, State: store, Claims: inv,
	})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{cp: cp, store: store, id: id, cfg: session.Config{
		Gateway: cp.Addr, State: store, Inventory: inv, BootID: "boot-1", AgentVersion: "test",
		Logger:     slog.New(slog.DiscardHandler),
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
	}}
}

// start runs the session client until the test ends.
func (f *fixture) start(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	f.done = make(chan error, 1)
	go func() { f.done <- session.Run(ctx, f.cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-f.done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(wait):
			t.Error("Run did not return after cancel")
		}
	})
}

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(wait):
		t.Fatalf("no %s within %s", what, wait)
		panic("unreachable")
	}
}

func TestSession(t *testing.T) {
	t.Parallel()

	t.Run("hello, heartbeats, inventory, reconnect with the same ids", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.start(t)
		journal, err := f.store.JournalID()
		if err != nil {
			t.Fatal(err)
		}

		h := recv(t, f.cp.Hellos, "Hello")
		if h.GetNodeId() != f.id.NodeID || h.GetBootId() != "boot-1" || h.GetJournalId() != journal || h.GetAgentVersion() != "test" {
			t.Fatalf("hello %v", h.Hello)
		}
		rep := recv(t, f.cp.Reports, "inventory report")
		if len(rep.GetGpus()) != 8 {
			t.Fatalf("%d GPUs, want 8", len(rep.GetGpus()))
		}
		for _, g := range rep.GetGpus() {
			if !strings.Contains(g.GetModel(), "H200") {
				t.Errorf("gpu %v", g)
			}
		}
		if rep.GetHost().GetDriverVersion() == "" {
			t.Errorf("host %v", rep.GetHost())
		}
		deadline := time.Now().Add(wait)
		for f.cp.Heartbeats.Load() < 3 {
			if time.Now().After(deadline) {
				t.Fatalf("%d heartbeats", f.cp.Heartbeats.Load())
			}
			time.Sleep(5 * time.Millisecond) // polling with a deadline
		}

		if n := f.cp.KickSessions(); n != 1 {
			t.Fatalf("kicked %d sessions, want 1", n)
		}
		h2 := recv(t, f.cp.Hellos, "Hello after reconnect")
		if h2.GetNodeId() != h.GetNodeId() || h2.GetBootId() != h.GetBootId() || h2.GetJournalId() != h.GetJournalId() {
			t.Errorf("reconnect hello %v, first %v", h2.Hello, h.Hello)
		}
		recv(t, f.cp.Reports, "inventory report after reconnect")
		select {
		case c := <-f.cp.Renewed:
			t.Errorf("renewed a fresh 24h certificate (expires %s)", c.NotAfter)
		default:
		}
	})

	t.Run("renews a certificate near expiry and uses it after reconnect", func(t *testing.T) {
		t.Parallel()
		// 70 s lifetime with 10 s left: under a third, so due at once.
		f := setup(t, func() (time.Time, time.Time) {
			now := time.Now()
			return now.Add(-time.Minute), now.Add(10 * time.Second)
		})
		key, err := f.store.Key()
		if err != nil {
			t.Fatal(err)
		}
		f.start(t)

		renewed := recv(t, f.cp.Renewed, "renewal")
		if !key.PublicKey.Equal(renewed.PublicKey) {
			t.Error("renewal certified another key")
		}
		// The renewed certificate is on disk...
		deadline := time.Now().Add(wait)
		for {
			id, err := f.store.Identity()
			if err != nil {
				t.Fatal(err)
			}
			leaf, err := id.Leaf()
			if err != nil {
				t.Fatal(err)
			}
			if leaf.SerialNumber.Cmp(renewed.SerialNumber) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("renewed certificate not stored")
			}
			time.Sleep(5 * time.Millisecond) // polling with a deadline
		}
		// ...and the next session presents it.
		first := recv(t, f.cp.Hellos, "Hello")
		for {
			f.cp.KickSessions()
			h := recv(t, f.cp.Hellos, "Hello after reconnect")
			if h.GetJournalId() != first.GetJournalId() {
				t.Fatalf("journal id changed: %s -> %s", first.GetJournalId(), h.GetJournalId())
			}
			if h.Serial.Cmp(renewed.SerialNumber) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("sessions never used the renewed certificate")
			}
		}
	})

	t.Run("does not say Hello to a gateway without a gateway SPIFFE id", func(t *testing.T) {
		t.Parallel()
		// A certificate of the right CA with the right name, but a node's
		// SPIFFE id: not a gateway.
		f := setup(t, nil, testcontrol.WithGatewayPath("/node/impostor"))
		var logs syncBuffer
		f.cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		f.start(t)
		deadline := time.Now().Add(wait)
		for !strings.Contains(logs.String(), "has no SPIFFE id spiffe://"+testcontrol.TrustDomain+"/gateway/") {
			if time.Now().After(deadline) {
				t.Fatalf("no refusal logged: %s", logs.String())
			}
			time.Sleep(5 * time.Millisecond) // polling with a deadline
		}
		select {
		case h := <-f.cp.Hellos:
			t.Fatalf("said Hello to a non-gateway: %v", h.Hello)
		default:
		}
	})

	t.Run("refuses to start without an identity", func(t *testing.T) {
		t.Parallel()
		store, err := state.Open(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		inv, _ := inventory.Open(inventory.Config{Backend: inventory.BackendMock})
		t.Cleanup(func() { _ = inv.Close() })
		err = session.Run(context.Background(), session.Config{Gateway: "127.0.0.1:1", State: store, Inventory: inv, BootID: "b"})
		if err == nil || !strings.Contains(err.Error(), "not joined") {
			t.Errorf("err %v", err)
		}
	})

	t.Run("keeps reconnecting to a failing gateway until cancelled", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		// A listener that hangs up on every connection: each accept is one
		// attempt by the agent.
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = lis.Close() })
		accepts := make(chan struct{}, 100)
		go func() {
			for {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				_ = c.Close()
				select {
				case accepts <- struct{}{}:
				default:
				}
			}
		}()
		f.cfg.Gateway = lis.Addr().String()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- session.Run(ctx, f.cfg) }()
		for i := range 4 {
			recv(t, accepts, fmt.Sprintf("connection attempt %d", i+1))
		}
		cancel()
		if err := recv(t, done, "Run's return"); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func TestRenewAt_LastThird(t *testing.T) {
	t.Parallel()
	nb := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := &x509.Certificate{NotBefore: nb, NotAfter: nb.Add(24 * time.Hour)}
	if got, want := session.RenewAt(c), nb.Add(16*time.Hour); !got.Equal(want) {
		t.Errorf("RenewAt %s, want %s", got, want)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a reader.
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
