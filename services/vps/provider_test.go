package vps_test

import (
	"bytes"
	"errors"
	"fmt"
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

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/providers"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/reconcile/reconciletest"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/services/vps"
)

// TestMain is the package's (services/vps): one per test binary.
func TestMain(m *testing.M) { pgtest.Main(m) }

// providerToken is the fake provider's bearer token: no log line, reason
// or error may show it.
const providerToken = "prov-tok-7c1b9e-never-logged"

type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

type harness struct {
	db   *pgxpool.Pool
	fake *providers.Fake
	kr   *secrets.Keyring
	logs *logBuffer
	deps vps.Deps
}

// role is the membership the workflow runs in: "vps" once the role is a
// runtime membership, controllers until then.
func role() string {
	if slices.Contains(reconcile.Roles, string(config.RoleVPS)) {
		return string(config.RoleVPS)
	}
	return reconcile.RoleControllers
}

// setup opens a fresh database with the provider pool "pool_p" (root) on a
// fake provider whose machines provision in delay, its credentials a
// secret holding token.
func setup(t *testing.T, delay time.Duration, token string, edit func(*vps.Deps)) *harness {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	kr, err := secrets.NewKeyring(secrets.NewKey())
	if err != nil {
		t.Fatal(err)
	}
	fake := providers.NewFake(providers.FakeConfig{Token: providerToken, ProvisionDelay: delay})
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_p", Class: pools.ClassProvider})
	creds := providers.Credentials{Token: token}
	if err := secrets.Put(t.Context(), pool, kr, secrets.Secret{ID: "sec_prov", TenantID: "root", Kind: secrets.KindProvider, Plain: creds.Marshal()}); err != nil {
		t.Fatal(err)
	}
	if err := instances.SetProviderSettings(t.Context(), pool, instances.ProviderSettings{PoolID: "pool_p", Endpoint: srv.URL, CredentialsRef: "sec_prov"}); err != nil {
		t.Fatal(err)
	}
	logs := &logBuffer{}
	f := &harness{db: pool, fake: fake, kr: kr, logs: logs, deps: vps.Deps{
		Keyring: kr, Role: role(), Resync: 200 * time.Millisecond, CallAttempts: 1,
		// The fake provider is an httptest server on loopback: the test
		// lets the client reach it; every other outbound rule holds.
		Outbound: outbound.Options{AllowInsecure: true, AllowLoopback: true},
		Logger:   slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}}
	if edit != nil {
		edit(&f.deps)
	}
	return f
}

// start runs the workflow on a runtime of its own, stopped when t ends.
func (f *harness) start(t *testing.T) *reconcile.Runtime {
	t.Helper()
	rt, err := reconcile.New(f.db, nil, reconcile.Config{
		Roles: []string{f.deps.Role}, Heartbeat: 100 * time.Millisecond, LeaseTTL: 500 * time.Millisecond,
		Poll: 50 * time.Millisecond, PollBusDown: 20 * time.Millisecond, Logger: f.deps.Logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := vps.RegisterProvider(rt, f.deps); err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	return rt
}

// change runs fn and enqueues the instance's workflow in one transaction,
// as the API does.
func (f *harness) change(t *testing.T, id string, fn func(tx pgx.Tx) error) {
	t.Helper()
	err := reconcile.InTx(t.Context(), f.db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		if err := fn(tx); err != nil {
			return err
		}
		return q.Enqueue(t.Context(), vps.KindProvider, id)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (f *harness) create(t *testing.T, id string) {
	t.Helper()
	f.change(t, id, func(tx pgx.Tx) error {
		return instances.Insert(t.Context(), tx, instances.Instance{ID: id, TenantID: "root", PoolID: "pool_p",
			Size: instances.Size{VCPUs: 2, MemoryMiB: 4096, DiskGiB: 40}, Image: "ubuntu-24.04",
			SSHKeys: []string{"ssh-ed25519 AAAAC3Nza test@example"}, UserData: "#cloud-config\n"})
	})
}

func (f *harness) get(t *testing.T, id string) instances.ProviderInstance {
	t.Helper()
	p, err := instances.GetProvider(t.Context(), f.db, id, false)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (f *harness) waitState(t *testing.T, id, state string) instances.ProviderInstance {
	t.Helper()
	var p instances.ProviderInstance
	poll.UntilNil(t, 30*time.Second, id+" "+state, func() error {
		p = f.get(t, id)
		if p.State != state {
			return fmt.Errorf("state %s (reason %q, step %q, machine %s %s)", p.State, p.Reason, p.Step, p.ProviderMachineID, p.MachineState)
		}
		return nil
	})
	return p
}

// machine is the one machine the fake made for key; it fails t when there
// is any other number.
func (f *harness) machine(t *testing.T, key string) providers.FakeMachine {
	t.Helper()
	ms := f.fake.MachinesFor(key)
	if len(ms) != 1 {
		t.Fatalf("%d machines at the provider for %s, want exactly 1: %+v", len(ms), key, ms)
	}
	return ms[0]
}

// noToken fails t if the provider token shows in the logs or in any
// instance's reason.
func (f *harness) noToken(t *testing.T) {
	t.Helper()
	if strings.Contains(f.logs.String(), providerToken) {
		t.Fatal("the provider token is in the logs")
	}
	var n int
	if err := f.db.QueryRow(t.Context(), `SELECT count(*) FROM instances WHERE reason LIKE '%' || $1 || '%' OR observed_reason LIKE '%' || $1 || '%'`,
		providerToken).Scan(&n); err != nil || n != 0 {
		t.Fatalf("the provider token is in %d instance reasons (%v)", n, err)
	}
}

func TestProviderInstanceConvergesThroughCreateStopStartDelete(t *testing.T) {
	t.Parallel()
	f := setup(t, 150*time.Millisecond, providerToken, nil)
	f.start(t)
	f.create(t, "inst_a")

	p := f.waitState(t, "inst_a", instances.StateRunning)
	m := f.machine(t, "inst_a")
	if p.ProviderMachineID != m.ID || m.State != providers.StateRunning || p.PlacedAt == nil || p.Step != "" {
		t.Fatalf("running: instance %+v, machine %+v", p, m)
	}
	if m.Request.Image != "ubuntu-24.04" || m.Request.Size.VCPUs != 2 || m.Request.UserData != "#cloud-config\n" || len(m.Request.SSHKeys) != 1 {
		t.Fatalf("the machine was asked for %+v", m.Request)
	}

	f.change(t, "inst_a", func(tx pgx.Tx) error {
		_, _, err := instances.SetPower(t.Context(), tx, "inst_a", instances.PowerStopped)
		return err
	})
	f.waitState(t, "inst_a", instances.StateStopped)
	if m := f.machine(t, "inst_a"); m.State != providers.StateStopped {
		t.Fatalf("stopped instance, machine %s", m.State)
	}

	f.change(t, "inst_a", func(tx pgx.Tx) error {
		_, _, err := instances.SetPower(t.Context(), tx, "inst_a", instances.PowerRunning)
		return err
	})
	f.waitState(t, "inst_a", instances.StateRunning)
	if m := f.machine(t, "inst_a"); m.State != providers.StateRunning {
		t.Fatalf("started instance, machine %s", m.State)
	}

	f.change(t, "inst_a", func(tx pgx.Tx) error {
		_, changed, err := instances.DeleteProvider(t.Context(), tx, "inst_a")
		if err == nil && !changed {
			err = errors.New("delete changed nothing")
		}
		return err
	})
	p = f.waitState(t, "inst_a", instances.StateDeleted)
	if m := f.machine(t, "inst_a"); !m.Deleted || p.DeletedAt == nil {
		t.Fatalf("deleted instance %+v, machine %+v", p, m)
	}
	for _, c := range f.fake.Calls() {
		if !c.Authorized {
			t.Fatalf("a call without the pool's token: %+v", c)
		}
		if c.Method == http.MethodPost && c.Path == "/v1/machines" && c.IdempotencyKey != "inst_a" {
			t.Fatalf("a create not keyed by the instance id: %+v", c)
		}
	}
	f.noToken(t)
}

// TestProviderCrashBetweenCreateAndWriteMakesOneMachine: the provider makes
// the machine and the connection drops before its answer arrives, and the
// reconciler is killed right then (as a crash would, leases held). A new
// worker repeats the create under the same key: the provider answers with
// the same machine, and exactly one exists.
func TestProviderCrashBetweenCreateAndWriteMakesOneMachine(t *testing.T) {
	t.Parallel()
	f := setup(t, 0, providerToken, nil)
	f.fake.DropAfterCreate(1)
	a := f.start(t)
	f.create(t, "inst_c")
	poll.Until(t, 30*time.Second, "the dropped create", func() bool { return len(f.fake.Calls()) > 0 })
	reconciletest.Kill(a)
	if ms := f.fake.MachinesFor("inst_c"); len(ms) != 1 {
		t.Fatalf("after the dropped create: %d machines", len(ms))
	}
	if p := f.get(t, "inst_c"); p.ProviderMachineID != "" && len(f.fake.Calls()) == 1 {
		t.Fatalf("a machine id recorded from a create whose answer was dropped: %+v", p)
	}

	f.start(t)
	p := f.waitState(t, "inst_c", instances.StateRunning)
	m := f.machine(t, "inst_c")
	if p.ProviderMachineID != m.ID {
		t.Fatalf("instance records machine %q, the provider has %q", p.ProviderMachineID, m.ID)
	}
	creates := 0
	for _, c := range f.fake.Calls() {
		if c.Method == http.MethodPost && c.Path == "/v1/machines" {
			creates++
		}
	}
	if creates < 2 || len(f.fake.Machines()) != 1 {
		t.Fatalf("%d creates made %d machines; want the create repeated and one machine", creates, len(f.fake.Machines()))
	}
	f.noToken(t)
}

// TestProviderDeleteAfterCrashLeavesNoMachine: the create's answer is lost,
// the reconciler crashes, and the instance is deleted before any worker
// learned the machine's id. The delete creates again under the key to
// learn it and deletes that machine: nothing is left running.
func TestProviderDeleteAfterCrashLeavesNoMachine(t *testing.T) {
	t.Parallel()
	f := setup(t, 0, providerToken, nil)
	f.fake.DropAfterCreate(1)
	a := f.start(t)
	f.create(t, "inst_d")
	poll.Until(t, 30*time.Second, "the dropped create", func() bool { return len(f.fake.Calls()) > 0 })
	reconciletest.Kill(a)
	f.change(t, "inst_d", func(tx pgx.Tx) error {
		_, _, err := instances.DeleteProvider(t.Context(), tx, "inst_d")
		return err
	})
	f.start(t)
	f.waitState(t, "inst_d", instances.StateDeleted)
	if m := f.machine(t, "inst_d"); !m.Deleted {
		t.Fatalf("machine %+v left behind", m)
	}
	f.noToken(t)
}

func TestProviderDeleteOfAnInstanceNeverCreatedCallsNothing(t *testing.T) {
	t.Parallel()
	f := setup(t, 0, providerToken, nil)
	f.create(t, "inst_n") // no runtime yet: the create is never sent
	f.change(t, "inst_n", func(tx pgx.Tx) error {
		_, _, err := instances.DeleteProvider(t.Context(), tx, "inst_n")
		return err
	})
	f.start(t)
	f.waitState(t, "inst_n", instances.StateDeleted)
	if calls := f.fake.Calls(); len(calls) != 0 {
		t.Fatalf("calls for an instance never created: %+v", calls)
	}
}

// TestProviderEndpointAtLoopbackRefusedBeforeAnyRequest: a pool whose
// endpoint names a loopback service (stored before endpoints were checked,
// or refused since by the operator's rules) fails its instance with the
// fixed reason "destination refused" and sends the provider nothing — the
// production rules, without the tests' loopback allowance.
func TestProviderEndpointAtLoopbackRefusedBeforeAnyRequest(t *testing.T) {
	t.Parallel()
	f := setup(t, 0, providerToken, func(d *vps.Deps) { d.Outbound = outbound.Options{} })
	f.start(t)
	f.create(t, "inst_r")
	p := f.waitState(t, "inst_r", instances.StateFailed)
	if p.Reason != "provider create failed after 1 attempts: destination refused" {
		t.Fatalf("reason %q", p.Reason)
	}
	if calls := f.fake.Calls(); len(calls) != 0 {
		t.Fatalf("the provider got %d requests", len(calls))
	}
}

func TestProviderFailures(t *testing.T) {
	t.Parallel()
	t.Run("a rejected token fails the instance at once, naming the step", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 0, "not-the-providers-token", nil)
		f.start(t)
		f.create(t, "inst_t")
		p := f.waitState(t, "inst_t", instances.StateFailed)
		if !strings.Contains(p.Reason, "provider create failed after 1 attempts") || !strings.Contains(p.Reason, "HTTP status 401") ||
			strings.Contains(p.Reason, "not-the-providers-token") || strings.Contains(p.Reason, "bearer token") {
			t.Fatalf("reason %q", p.Reason)
		}
		if strings.Contains(f.logs.String(), "not-the-providers-token") {
			t.Fatal("the token is in the logs")
		}
	})
	t.Run("5xx past the attempts fails the instance", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 0, providerToken, func(d *vps.Deps) { d.MaxAttempts = 2 })
		f.fake.FailNext(100, 503, 0)
		f.start(t)
		f.create(t, "inst_5")
		p := f.waitState(t, "inst_5", instances.StateFailed)
		if !strings.Contains(p.Reason, "after 2 attempts") || !strings.Contains(p.Reason, "HTTP status 503") {
			t.Fatalf("reason %q", p.Reason)
		}
		f.noToken(t)
	})
	t.Run("a transient failure is retried", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 0, providerToken, nil)
		f.fake.FailNext(2, 429, 0)
		f.start(t)
		f.create(t, "inst_r")
		f.waitState(t, "inst_r", instances.StateRunning)
		f.machine(t, "inst_r")
	})
	t.Run("provisioning past the step's deadline fails the instance", func(t *testing.T) {
		t.Parallel()
		f := setup(t, time.Hour, providerToken, func(d *vps.Deps) { d.CreateTimeout = 500 * time.Millisecond })
		f.start(t)
		f.create(t, "inst_l")
		p := f.waitState(t, "inst_l", instances.StateFailed)
		if !strings.Contains(p.Reason, "provider create did not finish within 500ms") {
			t.Fatalf("reason %q", p.Reason)
		}
		// A failed instance still deletes its machine.
		f.change(t, "inst_l", func(tx pgx.Tx) error {
			_, _, err := instances.DeleteProvider(t.Context(), tx, "inst_l")
			return err
		})
		f.waitState(t, "inst_l", instances.StateDeleted)
		if m := f.machine(t, "inst_l"); !m.Deleted {
			t.Fatalf("machine %+v left behind", m)
		}
	})
	t.Run("a machine gone at the provider fails the instance", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 0, providerToken, nil)
		f.start(t)
		f.create(t, "inst_g")
		p := f.waitState(t, "inst_g", instances.StateRunning)
		f.fake.Remove(p.ProviderMachineID)
		f.change(t, "inst_g", func(tx pgx.Tx) error {
			_, _, err := instances.SetPower(t.Context(), tx, "inst_g", instances.PowerStopped)
			return err
		})
		p = f.waitState(t, "inst_g", instances.StateFailed)
		if !strings.Contains(p.Reason, "no longer exists at the provider") {
			t.Fatalf("reason %q", p.Reason)
		}
	})
}

// TestProviderResyncConvergesWithoutWakeUps: an instance inserted without
// its work row still converges, through the resync key.
func TestProviderResyncConvergesWithoutWakeUps(t *testing.T) {
	t.Parallel()
	f := setup(t, 0, providerToken, nil)
	if err := instances.Insert(t.Context(), f.db, instances.Instance{ID: "inst_s", TenantID: "root", PoolID: "pool_p",
		Size: instances.Size{VCPUs: 1, MemoryMiB: 512, DiskGiB: 10}, Image: "ubuntu-24.04"}); err != nil {
		t.Fatal(err)
	}
	f.start(t)
	f.waitState(t, "inst_s", instances.StateRunning)
	f.machine(t, "inst_s")
}
