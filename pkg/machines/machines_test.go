package machines_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func fieldOf(err error) string {
	if fe, ok := fault.As(err); ok {
		return fe.Field
	}
	return ""
}

func wantFault(t *testing.T, err error, code fault.Code, field string) {
	t.Helper()
	if fault.CodeOf(err) != code || fieldOf(err) != field {
		t.Fatalf("got %v, want %s on %q", err, code, field)
	}
}

type fixture struct {
	db     *pgxpool.Pool
	site   string
	pool   string
	secret string
}

func setup(t *testing.T) fixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t)
	s, err := sites.Create(ctx, db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1"})
	if err != nil {
		t.Fatal(err)
	}
	p, err := pools.Create(ctx, db, pools.Pool{ID: iam.NewID("pool"), TenantID: "root", Name: "metal", Class: pools.ClassGPU})
	if err != nil {
		t.Fatal(err)
	}
	kr, err := secrets.NewKeyring(secrets.NewKey())
	if err != nil {
		t.Fatal(err)
	}
	sec := secrets.NewID()
	if err := secrets.Put(ctx, db, kr, secrets.Secret{ID: sec, TenantID: "root", Kind: secrets.KindBMC,
		Plain: secrets.BMCCredentials{Username: "u", Password: "p"}.Marshal()}); err != nil {
		t.Fatal(err)
	}
	return fixture{db: db, site: s.ID, pool: p.ID, secret: sec}
}

func (f fixture) machine(t *testing.T, name string) machines.Machine {
	t.Helper()
	m, err := machines.Create(context.Background(), f.db, machines.Machine{ID: machines.NewID(), TenantID: "root", SiteID: f.site,
		PoolID: f.pool, Name: name, Labels: map[string]string{"rack": "r1"}, BMCAddress: "https://" + name + ".bmc.example",
		BMCCredentialsRef: f.secret, NodeID: iam.NewID("node")})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestStore: create, get (scoped to the tenant), list with site and state
// filters in pages, and a guarded delete that reports how many machines
// still use a secret.
func TestStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	m := f.machine(t, "m1")
	if m.State != machines.StateEnrolled || m.Purpose != machines.PurposeCommission || m.Boot != machines.BootNone ||
		m.Generation != 1 || m.Image != nil || string(m.Inventory) != "{}" || m.Labels["rack"] != "r1" || m.JoinTokenID != "" {
		t.Fatalf("created %+v", m)
	}
	_, err := machines.Create(ctx, f.db, machines.Machine{ID: machines.NewID(), TenantID: "root", SiteID: f.site, PoolID: f.pool,
		Name: "m1", BMCAddress: "https://x", BMCCredentialsRef: f.secret, NodeID: iam.NewID("node")})
	wantFault(t, err, fault.Conflict, "name")
	_, err = machines.Create(ctx, f.db, machines.Machine{ID: machines.NewID(), TenantID: "root", SiteID: f.site, PoolID: f.pool,
		Name: "m9", BMCAddress: "https://x", BMCCredentialsRef: "sec_gone", NodeID: iam.NewID("node")})
	wantFault(t, err, fault.NotFound, "bmc.credentialsRef")

	if got, err := machines.Get(ctx, f.db, "root", m.ID); err != nil || got.NodeID != m.NodeID {
		t.Fatalf("get: %+v %v", got, err)
	}
	_, err = machines.Get(ctx, f.db, "acme", m.ID)
	wantFault(t, err, fault.NotFound, "machineId")
	if got, err := machines.Get(ctx, f.db, "", m.ID); err != nil || got.ID != m.ID {
		t.Fatalf("get in any tenant: %+v %v", got, err)
	}

	m2 := f.machine(t, "m2")
	m3 := f.machine(t, "m3")
	if _, err := machines.SetState(ctx, f.db, m2.ID, []machines.State{machines.StateEnrolled}, machines.StateInspecting, machines.Change{}); err != nil {
		t.Fatal(err)
	}
	ids := func(ms []machines.Machine) []string {
		var out []string
		for _, x := range ms {
			out = append(out, x.ID)
		}
		return out
	}
	all, err := machines.List(ctx, f.db, machines.Filter{TenantID: "root", SiteID: f.site})
	want := []string{m.ID, m2.ID, m3.ID}
	slices.Sort(want)
	if err != nil || !slices.Equal(ids(all), want) {
		t.Fatalf("list: %v %v, want %v", ids(all), err, want)
	}
	page, err := machines.List(ctx, f.db, machines.Filter{TenantID: "root", After: want[0], Limit: 1})
	if err != nil || !slices.Equal(ids(page), want[1:2]) {
		t.Fatalf("second page: %v %v", ids(page), err)
	}
	inspecting, err := machines.List(ctx, f.db, machines.Filter{TenantID: "root", States: []machines.State{machines.StateInspecting}})
	if err != nil || !slices.Equal(ids(inspecting), []string{m2.ID}) {
		t.Fatalf("inspecting: %v %v", ids(inspecting), err)
	}
	for _, flt := range []machines.Filter{{TenantID: "acme"}, {TenantID: "root", SiteID: "site_other"}} {
		if none, err := machines.List(ctx, f.db, flt); err != nil || len(none) != 0 {
			t.Fatalf("list %+v: %v %v, want none", flt, ids(none), err)
		}
	}

	// Delete only from the states given.
	deletable := []machines.State{machines.StateEnrolled, machines.StateReady, machines.StateFailed}
	_, err = machines.Delete(ctx, f.db, "root", m2.ID, deletable)
	wantFault(t, err, fault.Conflict, "state")
	_, err = machines.Delete(ctx, f.db, "acme", m.ID, deletable)
	wantFault(t, err, fault.NotFound, "machineId")
	if n, err := machines.UsingCredentials(ctx, f.db, f.secret, m.ID); err != nil || n != 2 {
		t.Fatalf("others using the secret: %d %v, want 2", n, err)
	}
	if gone, err := machines.Delete(ctx, f.db, "root", m.ID, deletable); err != nil || gone.ID != m.ID {
		t.Fatalf("delete: %+v %v", gone, err)
	}
	_, err = machines.Get(ctx, f.db, "root", m.ID)
	wantFault(t, err, fault.NotFound, "machineId")
}

// TestGuardedTransitions: SetState moves a machine only from the states it
// is given and only along the table; the loser of two concurrent writers
// gets CONFLICT on "state"; failing records the step, retry resumes it; an
// attempt counts without moving; inventory and boot changes bump the
// generation.
func TestGuardedTransitions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	m := f.machine(t, "m1")

	// Not along the table: refused before any write.
	if _, err := machines.SetState(ctx, f.db, m.ID, []machines.State{machines.StateEnrolled}, machines.StateReady, machines.Change{}); err == nil {
		t.Fatal("enrolled → ready (skipping steps) was allowed")
	}

	// Concurrent writers: exactly one moves enrolled → inspecting.
	const writers = 8
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for i := range writers {
		wg.Go(func() {
			_, errs[i] = machines.SetState(ctx, f.db, m.ID, []machines.State{machines.StateEnrolled}, machines.StateInspecting, machines.Change{})
		})
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case fault.CodeOf(err) != fault.Conflict || fieldOf(err) != "state":
			t.Fatalf("a losing writer: %v, want CONFLICT on state", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d writers moved the machine, want 1", won)
	}
	got, _ := machines.Get(ctx, f.db, "root", m.ID)
	if got.State != machines.StateInspecting || got.Generation != 2 || got.StepAttempts != 0 {
		t.Fatalf("after the race: %+v", got)
	}

	deadline := time.Now().Add(time.Minute).UTC().Truncate(time.Microsecond)
	got, err := machines.Attempt(ctx, f.db, m.ID, machines.StateInspecting, deadline)
	if err != nil || got.StepAttempts != 1 || got.StepDeadline == nil || !got.StepDeadline.Equal(deadline) || got.Generation != 2 {
		t.Fatalf("attempt: %+v %v", got, err)
	}
	_, err = machines.Attempt(ctx, f.db, m.ID, machines.StateEnrolled, deadline)
	wantFault(t, err, fault.Conflict, "state")

	inv := json.RawMessage(`{"processors":2}`)
	got, err = machines.SetInventory(ctx, f.db, m.ID, machines.StateInspecting, inv, []string{"AA:BB:CC:00:11:22"})
	if err != nil || !slices.Equal(got.MACs, []string{"aa:bb:cc:00:11:22"}) || got.Generation != 3 {
		t.Fatalf("inventory: %+v %v", got, err)
	}

	// Fail records where; retry resumes there with attempts at 0.
	got, err = machines.Fail(ctx, f.db, m.ID, machines.StateInspecting, "redfish: 401 at https://10.0.0.1")
	if err != nil || got.State != machines.StateFailed || got.FailedStep != machines.StateInspecting || got.FailedReason == "" {
		t.Fatalf("fail: %+v %v", got, err)
	}
	got, err = machines.Retry(ctx, f.db, m.ID, nil)
	if err != nil || got.State != machines.StateInspecting || got.FailedStep != "" || got.FailedReason != "" || got.StepAttempts != 0 {
		t.Fatalf("retry: %+v %v", got, err)
	}
	_, err = machines.Retry(ctx, f.db, m.ID, nil)
	wantFault(t, err, fault.Conflict, "state")

	// Walk to ready, then a deploy writes its image and purpose.
	for _, step := range [][2]machines.State{
		{machines.StateInspecting, machines.StateBootingRamdisk}, {machines.StateBootingRamdisk, machines.StateDiagnosing},
		{machines.StateDiagnosing, machines.StateWiping}, {machines.StateWiping, machines.StateReady},
	} {
		if _, err := machines.SetState(ctx, f.db, m.ID, []machines.State{step[0]}, step[1], machines.Change{}); err != nil {
			t.Fatalf("%s → %s: %v", step[0], step[1], err)
		}
	}
	got, err = machines.SetBoot(ctx, f.db, m.ID, machines.StateReady, machines.BootRamdisk, "bcjt_x")
	if err != nil || got.Boot != machines.BootRamdisk || got.JoinTokenID != "bcjt_x" {
		t.Fatalf("boot: %+v %v", got, err)
	}
	img := &machines.Image{URL: "https://img/x.raw", SHA256: "ab", SizeBytes: 10}
	got, err = machines.SetState(ctx, f.db, m.ID, []machines.State{machines.StateReady}, machines.StateDeploying,
		machines.Change{Purpose: machines.PurposeDeploy, Image: img, CloudInit: "#cloud-config\n"})
	if err != nil || got.Purpose != machines.PurposeDeploy || got.Image == nil || *got.Image != *img || got.CloudInit != "#cloud-config\n" ||
		got.JoinTokenID != "bcjt_x" || got.Boot != machines.BootRamdisk {
		t.Fatalf("deploy: %+v %v", got, err)
	}
	// A change that names no image keeps the stored one.
	got, err = machines.SetState(ctx, f.db, m.ID, []machines.State{machines.StateDeploying}, machines.StateRebooting, machines.Change{})
	if err != nil || got.Image == nil || got.CloudInit == "" {
		t.Fatalf("rebooting: %+v %v", got, err)
	}
	_, err = machines.SetState(ctx, f.db, m.ID, []machines.State{machines.StateReady}, machines.StateDeploying, machines.Change{})
	wantFault(t, err, fault.Conflict, "state")
	_, err = machines.SetState(ctx, f.db, "mach_nope", []machines.State{machines.StateReady}, machines.StateDeploying, machines.Change{})
	wantFault(t, err, fault.NotFound, "machineId")
}

// TestTransitionTable: every state is in the table, every target is a
// state, every step can fail and failed can resume every step.
func TestTransitionTable(t *testing.T) {
	t.Parallel()
	table := machines.Transitions()
	for _, s := range machines.States() {
		tos, ok := table[s]
		if !ok {
			t.Errorf("%s has no row", s)
		}
		for _, to := range tos {
			if !to.Valid() {
				t.Errorf("%s → %q: not a state", s, to)
			}
		}
	}
	for _, s := range machines.Steps() {
		if !machines.CanTransition(s, machines.StateFailed) || !machines.CanTransition(machines.StateFailed, s) {
			t.Errorf("%s: must fail to and resume from failed", s)
		}
	}
	if machines.CanTransition(machines.StateEnrolled, machines.StateReady) || machines.CanTransition(machines.StateReady, machines.StateJoined) {
		t.Error("the table lets a machine skip steps")
	}
	if from := machines.From(machines.StateDeploying); !slices.Equal(from, []machines.State{machines.StateReady, machines.StateFailed}) {
		t.Errorf("From(deploying) = %v", from)
	}
}

// TestEnrollSameBMCAddressTwiceRefusedInStore: one BMC address per site
// (CONFLICT on "bmc.address"); another site may use it.
func TestEnrollSameBMCAddressTwiceRefusedInStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	m := f.machine(t, "m1")
	_, err := machines.Create(ctx, f.db, machines.Machine{ID: machines.NewID(), TenantID: "root", SiteID: f.site, PoolID: f.pool,
		Name: "m2", BMCAddress: m.BMCAddress, BMCCredentialsRef: f.secret, NodeID: iam.NewID("node")})
	wantFault(t, err, fault.Conflict, "bmc.address")
	s2, err := sites.Create(ctx, f.db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "ams1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := machines.Create(ctx, f.db, machines.Machine{ID: machines.NewID(), TenantID: "root", SiteID: s2.ID, PoolID: f.pool,
		Name: "m2", BMCAddress: m.BMCAddress, BMCCredentialsRef: f.secret, NodeID: iam.NewID("node")}); err != nil {
		t.Fatal(err)
	}
}

// TestMACOfAnotherMachineOfTheSiteRefused: inspection cannot give a
// machine a MAC another machine of the site has (in any case): CONFLICT on
// "macs" wrapping ErrMACTaken, nothing written; a machine may record its
// own MACs again.
func TestMACOfAnotherMachineOfTheSiteRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	a, b := f.machine(t, "a"), f.machine(t, "b")
	for _, m := range []machines.Machine{a, b} {
		if _, err := machines.SetState(ctx, f.db, m.ID, []machines.State{machines.StateEnrolled}, machines.StateInspecting, machines.Change{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := machines.SetInventory(ctx, f.db, a.ID, machines.StateInspecting, nil, []string{"02:00:00:00:00:01", "02:00:00:00:00:02"}); err != nil {
		t.Fatal(err)
	}
	_, err := machines.SetInventory(ctx, f.db, b.ID, machines.StateInspecting, nil, []string{"02:00:00:00:00:09", "02:00:00:00:00:0A", "02:00:00:00:00:02"})
	wantFault(t, err, fault.Conflict, "macs")
	if !errors.Is(err, machines.ErrMACTaken) {
		t.Fatalf("%v does not wrap ErrMACTaken", err)
	}
	if got, _ := machines.Get(ctx, f.db, "", b.ID); len(got.MACs) != 0 {
		t.Fatalf("b's MACs after the refusal: %v", got.MACs)
	}
	if _, err := machines.SetInventory(ctx, f.db, a.ID, machines.StateInspecting, nil, []string{"02:00:00:00:00:01"}); err != nil {
		t.Fatalf("a again: %v", err)
	}
	if _, err := machines.SetInventory(ctx, f.db, b.ID, machines.StateInspecting, nil, []string{"02:00:00:00:00:02"}); err != nil {
		t.Fatalf("b, a MAC a gave up: %v", err)
	}
}

// TestPinCertificate: trust on first use pins once; a machine with a CA or
// insecure is never pinned.
func TestPinCertificate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	m := f.machine(t, "m1")
	if !m.TrustOnFirstUse() {
		t.Fatal("a machine without TLS options does not trust on first use")
	}
	first, second := strings.Repeat("a", 64), strings.Repeat("b", 64)
	got, pinned, err := machines.PinCertificate(ctx, f.db, m.ID, first)
	if err != nil || !pinned || got.BMCCertificateSHA256 != first || got.TrustOnFirstUse() {
		t.Fatalf("first pin: %+v %v %v", got, pinned, err)
	}
	got, pinned, err = machines.PinCertificate(ctx, f.db, m.ID, second)
	if err != nil || pinned || got.BMCCertificateSHA256 != first {
		t.Fatalf("second pin: %v %v %v", got.BMCCertificateSHA256, pinned, err)
	}
	ins, err := machines.Create(ctx, f.db, machines.Machine{ID: machines.NewID(), TenantID: "root", SiteID: f.site, PoolID: f.pool,
		Name: "ins", BMCAddress: "https://ins", BMCCredentialsRef: f.secret, NodeID: iam.NewID("node"), BMCInsecure: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, pinned, err := machines.PinCertificate(ctx, f.db, ins.ID, first); err != nil || pinned {
		t.Fatalf("an insecure machine pinned: %v %v", pinned, err)
	}
}
