package gateway_test

import (
	"context"
	"encoding/json"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// The site task tests run the real site agent against the real gateway
// over mutual TLS on a real PostgreSQL, with no NATS: delivery is a local
// poke (what the in-process gateway gets) or the resync alone, and the BMC
// is the fake one over HTTPS.

const bmcPassword = "correct-horse-battery-staple-7731"

func startBMC(t *testing.T) *fakebmc.Server {
	t.Helper()
	b, err := fakebmc.New(fakebmc.Config{Username: "admin", Password: bmcPassword})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := fakebmc.StartTLS(b, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// producer plays the metal workflow: it seals to the site's key and queues.
type producer struct {
	f    *siteFixture
	bmc  *fakebmc.Server
	poke bool
	nc   *nats.Conn
}

// poker wakes over the bus: the gateway listens to the site task wakes of
// the sites it holds an agent session of (Gateway.ListenSiteTasks).
func (p *producer) poker() *wake.Waker {
	if !p.poke {
		return nil
	}
	return wake.New(p.nc, nil, nil)
}

// seal seals plain for task id of machine to the site's current key.
func (p *producer) seal(t *testing.T, id, machine string, plain []byte) string {
	t.Helper()
	k, err := sitetasks.SealKey(t.Context(), p.f.db, p.f.site.ID)
	if err != nil {
		t.Fatal(err)
	}
	jwe, err := credseal.Seal(k.JWK, plain, credseal.TaskAAD(id, machine)...)
	if err != nil {
		t.Fatal(err)
	}
	return jwe
}

func (p *producer) creds(t *testing.T, id, machine string) string {
	t.Helper()
	b, _ := json.Marshal(credseal.BMCCredentials{Username: "admin", Password: bmcPassword})
	return p.seal(t, id, machine, b)
}

// enqueue queues task (id and sealed filled as its kind needs) and pokes.
func (p *producer) enqueue(t *testing.T, task sitetasks.Task) sitetasks.Task {
	t.Helper()
	task.ID = cmpOr(task.ID, sitetasks.NewID())
	task.TenantID, task.SiteID = "root", p.f.site.ID
	task.MachineID = cmpOr(task.MachineID, "mach_1")
	if task.NotAfter.IsZero() {
		task.NotAfter = time.Now().Add(5 * time.Minute)
	}
	if task.Payload.BMC != nil && task.Sealed == "" {
		task.Sealed = p.creds(t, task.ID, task.MachineID)
	}
	var out sitetasks.Task
	err := reconcile.InTx(t.Context(), p.f.db, p.poker(), func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		out, err = sitetasks.Enqueue(t.Context(), tx, task)
		q.WakeSiteTasks(task.SiteID)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// bus starts a NATS server and has the gateway listen to site task wakes
// on it; it returns a connection for producers.
func (f *siteFixture) bus(t *testing.T) *nats.Conn {
	t.Helper()
	ns := natstest.New(t)
	sub, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	f.gw.ListenSiteTasks(sub)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if err := sub.Flush(); err != nil {
		t.Fatal(err)
	}
	return nc
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// wait polls until the task finished, resyncing the gateway when the
// producer does not poke.
func (p *producer) wait(t *testing.T, id string) sitetasks.Task {
	t.Helper()
	var got sitetasks.Task
	poll.Until(t, 30*time.Second, "site task "+id+" finished", func() bool {
		if !p.poke {
			if err := p.f.gw.ResyncSiteTasks(t.Context()); err != nil {
				t.Logf("resync: %v", err)
			}
		}
		var err error
		got, err = sitetasks.Get(t.Context(), p.f.db, id)
		return err == nil && got.FinishedAt != nil
	})
	return got
}

func (f *siteFixture) bmcPayload(srv *fakebmc.Server) *sitetasks.BMC {
	return &sitetasks.BMC{Address: srv.URL, CAPEM: string(srv.CAPEM)}
}

// TestSiteTasksReachTheHolderAndActOnTheBMC: bmc.inspect returns the fake
// BMC's inventory, bmc.power and bmc.boot change its state, pxe.arm and
// pxe.disarm change the agent's pxe.Table — first on a poke, then with the
// resync alone (no bus) — and the BMC password appears in no log of either
// side, no site_tasks row and no result.
func TestSiteTasksReachTheHolderAndActOnTheBMC(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	ctx := t.Context()
	srv := startBMC(t)
	id, st := f.enroll(t, f.token(t, 1), "pxe-a")
	table := pxe.NewTable()
	a := f.runWith(t, id, st, f.addr, func(c *site.Config) { c.PXE = table; c.Logger = f.logs.logger() })
	poll.Until(t, 30*time.Second, "the agent serving", func() bool {
		ok, _ := a.boot.serving()
		return ok
	})
	poll.Until(t, 30*time.Second, "the holder's seal key stored", func() bool {
		k, err := sitetasks.SealKey(ctx, f.db, f.site.ID)
		return err == nil && k.AgentID == id.AgentID
	})

	nc := f.bus(t)
	for _, poke := range []bool{true, false} {
		name := map[bool]string{true: "poked", false: "resync only"}[poke]
		t.Run(name, func(t *testing.T) {
			p := &producer{f: f, bmc: srv, poke: poke, nc: nc}
			inspect := p.wait(t, p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindBMCInspect,
				Payload: sitetasks.Payload{BMC: f.bmcPayload(srv)}}).ID)
			if inspect.State != sitetasks.Succeeded || inspect.Result == nil || inspect.Result.Inventory == nil {
				t.Fatalf("bmc.inspect: %+v", inspect)
			}
			m := srv.BMC.Machine()
			inv := inspect.Result.Inventory
			var macs []string
			for _, n := range inv.NICs {
				macs = append(macs, n.MAC)
			}
			if inv.Manufacturer != m.Manufacturer || inv.SerialNumber != m.SerialNumber || inv.UUID != m.UUID ||
				inv.CPUCount != len(m.CPUs) || len(inv.Disks) != len(m.Disks) ||
				!slices.Equal(macs, []string{m.NICs[0].MAC, m.NICs[1].MAC}) {
				t.Fatalf("inventory %+v, want the fake BMC's %+v", inv, m)
			}
			if inspect.Attempts != 1 || inspect.AgentID != id.AgentID {
				t.Fatalf("bmc.inspect ran as %+v", inspect)
			}

			off := p.wait(t, p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindBMCPower,
				Payload: sitetasks.Payload{BMC: f.bmcPayload(srv), PowerAction: "off"}}).ID)
			if off.State != sitetasks.Succeeded || off.Result.PowerState != "Off" || srv.BMC.PowerState() != "Off" {
				t.Fatalf("bmc.power off: %+v; the BMC says %s", off, srv.BMC.PowerState())
			}
			boot := p.wait(t, p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindBMCBoot,
				Payload: sitetasks.Payload{BMC: f.bmcPayload(srv), BootTarget: "pxe"}}).ID)
			if enabled, target := srv.BMC.BootOverride(); boot.State != sitetasks.Succeeded || enabled != "Once" || target != "Pxe" {
				t.Fatalf("bmc.boot pxe: %+v; the BMC's override %s/%s", boot, enabled, target)
			}
			on := p.wait(t, p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindBMCPower,
				Payload: sitetasks.Payload{BMC: f.bmcPayload(srv), PowerAction: "on"}}).ID)
			if on.State != sitetasks.Succeeded || srv.BMC.PowerState() != "On" {
				t.Fatalf("bmc.power on: %+v", on)
			}
			if acts := srv.BMC.Actions(); !slices.ContainsFunc(acts, func(a fakebmc.Action) bool { return a.Kind == "Boot" && a.Detail == "Pxe" }) {
				t.Fatalf("the machine did not boot from PXE: %+v", acts)
			}

			mac := map[bool]string{true: "02:00:00:00:00:01", false: "02:00:00:00:00:02"}[poke]
			hw, _ := net.ParseMAC(mac)
			armID := sitetasks.NewID()
			img := &sitetasks.Image{URL: "http://images.example/k", SHA256: strings.Repeat("ab", 32)}
			arm := p.wait(t, p.enqueue(t, sitetasks.Task{ID: armID, Kind: sitetasks.KindPXEArm,
				Sealed: p.seal(t, armID, "mach_1", []byte("boot-token-"+name[:4])),
				Payload: sitetasks.Payload{MACs: []string{mac}, Decision: "ramdisk", Kernel: img, Initrd: img,
					Args: []string{"console=ttyS0"}}}).ID)
			if arm.State != sitetasks.Succeeded {
				t.Fatalf("pxe.arm: %+v", arm)
			}
			d, ok := table.Lookup(ctx, hw)
			if !ok || d.Action != pxe.BootRamdisk || d.Kernel.SHA256 != img.SHA256 || !slices.Equal(d.Args, []string{"console=ttyS0"}) {
				t.Fatalf("the table answers %s with %+v %v", mac, d, ok)
			}
			if tok, err := table.TakeBootToken(ctx, hw); err != nil || tok != "boot-token-"+name[:4] {
				t.Fatalf("boot token %q %v", tok, err)
			}
			disarm := p.wait(t, p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindPXEDisarm,
				Payload: sitetasks.Payload{MACs: []string{mac}}}).ID)
			if _, ok := table.Lookup(ctx, hw); disarm.State != sitetasks.Succeeded || ok {
				t.Fatalf("pxe.disarm: %+v; the table still answers: %v", disarm, ok)
			}
		})
	}

	// The password is nowhere but in the JWEs.
	var rows string
	if err := f.db.QueryRow(ctx, `SELECT coalesce(string_agg(t::text, E'\n'), '') FROM site_tasks t`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	var ok int
	if err := f.db.QueryRow(ctx, `SELECT count(*) FROM site_tasks WHERE state = 'succeeded'`).Scan(&ok); err != nil || ok != 12 {
		t.Fatalf("%d tasks succeeded (%v), want the 12", ok, err)
	}
	logs := f.logs.String()
	if !strings.Contains(logs, "site task finished") || !strings.Contains(logs, "running site task") {
		t.Fatalf("the logs did not capture both sides:\n%s", logs)
	}
	for what, text := range map[string]string{"site_tasks": rows, "logs": logs} {
		for _, secret := range []string{bmcPassword, "boot-token-"} {
			if strings.Contains(text, secret) {
				t.Errorf("%s contain a secret (%s)", what, secret)
			}
		}
	}
}

// TestASiteTaskOfADeadHolderRunsOnceOnTheStandby: the holder receives a
// bmc.power cycle and dies before it acts; the standby takes the lease
// over, the producer reseals the credentials to its key, and the standby
// runs the task: the BMC sees one reset.
func TestASiteTaskOfADeadHolderRunsOnceOnTheStandby(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	ctx := t.Context()
	srv := startBMC(t)
	tok := f.token(t, 2)
	idA, stA := f.enroll(t, tok, "pxe-a")
	idB, stB := f.enroll(t, tok, "pxe-b")

	// The first agent to receive a task blocks in it until it is stopped.
	var once sync.Once
	started := make(chan struct{})
	hook := func(c *site.Config) {
		c.OnTask = func(ctx context.Context, task *agentv1.SiteTask) {
			first := false
			once.Do(func() { first = true })
			if first {
				close(started)
				<-ctx.Done() // dies holding it
			}
		}
		c.Logger = f.logs.logger()
	}
	a := f.runWith(t, idA, stA, f.addr, hook)
	poll.Until(t, 30*time.Second, "a serving", func() bool {
		ok, _ := a.boot.serving()
		return ok
	})
	b := f.runWith(t, idB, stB, f.addr, hook)
	poll.Until(t, 30*time.Second, "b's session", func() bool { return f.gw.SiteSessions() == 2 })
	_, epoch := a.boot.serving()

	p := &producer{f: f, bmc: srv, poke: true, nc: f.bus(t)}
	task := p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindBMCPower, Payload: sitetasks.Payload{BMC: f.bmcPayload(srv), PowerAction: "cycle"}})
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the holder never received the task")
	}
	a.stop()
	poll.Until(t, 30*time.Second, "b serving", func() bool {
		ok, _ := b.boot.serving()
		return ok
	})

	// The gateway finds the task sealed to a's key and asks for a reseal.
	var stale []sitetasks.Task
	poll.Until(t, 30*time.Second, "the task waiting for a reseal", func() bool {
		_ = f.gw.ResyncSiteTasks(ctx)
		var err error
		stale, err = sitetasks.NeedingReseal(ctx, f.db, f.site.ID)
		return err == nil && len(stale) == 1
	})
	k, err := sitetasks.SealKey(ctx, f.db, f.site.ID)
	if err != nil || k.AgentID != idB.AgentID || k.Epoch != epoch+1 {
		t.Fatalf("SealKey %+v %v, want b's at epoch %d", k, err, epoch+1)
	}
	if _, err := sitetasks.Reseal(ctx, f.db, task.ID, p.creds(t, task.ID, task.MachineID)); err != nil {
		t.Fatal(err)
	}
	p.poker().Wake(wake.Set{Sites: []string{f.site.ID}})
	done := p.wait(t, task.ID)
	if done.State != sitetasks.Succeeded || done.Attempts != 2 || done.AgentID != idB.AgentID || done.LeaseEpoch != epoch+1 {
		t.Fatalf("the task finished as %+v", done)
	}
	var resets []fakebmc.Action
	for _, act := range srv.BMC.Actions() {
		if act.Kind == "Reset" {
			resets = append(resets, act)
		}
	}
	if len(resets) != 1 {
		t.Fatalf("the BMC saw %d resets, want 1: %+v", len(resets), resets)
	}
	if strings.Contains(f.logs.String(), bmcPassword) {
		t.Fatal("the password is in the logs")
	}
}

// TestASiteTaskPastItsDeadlineExpires: a task the holder never answers
// expires at its not_after, found by the gateway's resync.
func TestASiteTaskPastItsDeadlineExpires(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	srv := startBMC(t)
	id, st := f.enroll(t, f.token(t, 1), "pxe-a")
	release := make(chan struct{})
	a := f.runWith(t, id, st, f.addr, func(c *site.Config) {
		c.OnTask = func(context.Context, *agentv1.SiteTask) { <-release } // never answers in time
	})
	t.Cleanup(func() { close(release) }) // before the agent's stop
	poll.Until(t, 30*time.Second, "the agent serving with a key", func() bool {
		ok, _ := a.boot.serving()
		_, err := sitetasks.SealKey(t.Context(), f.db, f.site.ID)
		return ok && err == nil
	})
	p := &producer{f: f, bmc: srv}
	task := p.enqueue(t, sitetasks.Task{Kind: sitetasks.KindBMCInspect, Payload: sitetasks.Payload{BMC: f.bmcPayload(srv)},
		NotAfter: time.Now().Add(2 * time.Second)})
	done := p.wait(t, task.ID)
	if done.State != sitetasks.Expired || done.Attempts != 1 || done.Result != nil {
		t.Fatalf("the task finished as %+v, want expired after one dispatch", done)
	}
}
