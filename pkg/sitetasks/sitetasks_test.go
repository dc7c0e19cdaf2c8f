package sitetasks_test

import (
	"crypto/ecdsa"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/sites"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type fixture struct {
	db   *pgxpool.Pool
	site sites.Site
}

// agent is an enrolled agent with a session key.
type agent struct {
	id  string
	key *ecdsa.PrivateKey
	jwk string
	kid string
}

func setup(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{db: pgtest.New(t)}
	var err error
	if f.site, err = sites.Create(t.Context(), f.db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1"}); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fixture) agent(t *testing.T) *agent {
	t.Helper()
	a, err := sites.CreateAgent(t.Context(), f.db, sites.Agent{ID: sites.NewAgentID(), TenantID: "root", SiteID: f.site.ID})
	if err != nil {
		t.Fatal(err)
	}
	return f.session(t, &agent{id: a.ID})
}

// session gives a a new session key, stored as its seal key.
func (f *fixture) session(t *testing.T, a *agent) *agent {
	t.Helper()
	var err error
	if a.key, err = credseal.NewKey(); err != nil {
		t.Fatal(err)
	}
	if a.jwk, err = credseal.PublicJWK(a.key); err != nil {
		t.Fatal(err)
	}
	a.kid, _ = credseal.KeyID(a.jwk)
	if err := sitetasks.SetSealKey(t.Context(), f.db, a.id, a.jwk); err != nil {
		t.Fatal(err)
	}
	return a
}

// lease takes the boot lease for a and returns a's holder.
func (f *fixture) lease(t *testing.T, a *agent) sitetasks.Holder {
	t.Helper()
	l, err := sites.AcquireLease(t.Context(), f.db, f.site.ID, a.id, time.Minute)
	if err != nil || !l.Held(a.id) {
		t.Fatalf("lease for %s: %+v %v", a.id, l, err)
	}
	return sitetasks.Holder{SiteID: f.site.ID, AgentID: a.id, Epoch: l.Epoch, SessionKID: a.kid}
}

func inTx[T any](t *testing.T, f *fixture, fn func(tx pgx.Tx, q *reconcile.Queue) (T, error)) (T, error) {
	t.Helper()
	var out T
	err := reconcile.InTx(t.Context(), f.db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		out, err = fn(tx, q)
		return err
	})
	return out, err
}

// inspect queues a bmc.inspect sealed to the site's current key.
func (f *fixture) inspect(t *testing.T, machine string) sitetasks.Task {
	t.Helper()
	k, err := sitetasks.SealKey(t.Context(), f.db, f.site.ID)
	if err != nil {
		t.Fatal(err)
	}
	id := sitetasks.NewID()
	sealed, err := credseal.Seal(k.JWK, []byte(`{"username":"u","password":"p"}`), credseal.TaskAAD(id, machine)...)
	if err != nil {
		t.Fatal(err)
	}
	task, err := inTx(t, f, func(tx pgx.Tx, _ *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Enqueue(t.Context(), tx, sitetasks.Task{ID: id, TenantID: "root", SiteID: f.site.ID, MachineID: machine,
			Kind: sitetasks.KindBMCInspect, Payload: sitetasks.Payload{BMC: &sitetasks.BMC{Address: "https://10.0.0.5"}},
			Sealed: sealed, NotAfter: time.Now().Add(time.Hour)})
	})
	if err != nil {
		t.Fatal(err)
	}
	return task
}

func (f *fixture) claim(t *testing.T, h sitetasks.Holder) []sitetasks.Task {
	t.Helper()
	ts, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) ([]sitetasks.Task, error) {
		return sitetasks.Claim(t.Context(), tx, q, h)
	})
	if err != nil {
		t.Fatal(err)
	}
	return ts
}

// queued reports whether the metal job of machine is in the work queue.
func (f *fixture) queued(t *testing.T, machine string) bool {
	t.Helper()
	var n int
	if err := f.db.QueryRow(t.Context(), `SELECT count(*) FROM work_queue WHERE kind = 'metal' AND key = $1`, machine).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

func fieldOf(err error) string {
	if fe, ok := fault.As(err); ok {
		return fe.Field
	}
	return ""
}

func TestEnqueueRefusesBadTasks(t *testing.T) {
	t.Parallel()
	f := setup(t)
	a := f.agent(t)
	f.lease(t, a)
	sealed, _ := credseal.Seal(a.jwk, []byte("x"))
	ok := sitetasks.Task{TenantID: "root", SiteID: f.site.ID, MachineID: "mach_1", Kind: sitetasks.KindBMCPower,
		Payload: sitetasks.Payload{BMC: &sitetasks.BMC{Address: "https://10.0.0.5"}, PowerAction: "on"}, Sealed: sealed,
		NotAfter: time.Now().Add(time.Hour)}
	for _, tc := range []struct {
		name  string
		edit  func(*sitetasks.Task)
		code  fault.Code
		field string
	}{
		{"unknown kind", func(t *sitetasks.Task) { t.Kind = "bmc.flash" }, fault.Unsupported, "kind"},
		{"no deadline", func(t *sitetasks.Task) { t.NotAfter = time.Time{} }, fault.InvalidInput, "notAfter"},
		{"a deadline too far", func(t *sitetasks.Task) { t.NotAfter = time.Now().Add(48 * time.Hour) }, fault.InvalidInput, "notAfter"},
		{"a bad action", func(t *sitetasks.Task) { t.Payload.PowerAction = "explode" }, fault.InvalidInput, "payload.powerAction"},
		{"an http bmc", func(t *sitetasks.Task) { t.Payload.BMC = &sitetasks.BMC{Address: "http://10.0.0.5"} }, fault.InvalidInput, "payload.bmc.address"},
		{"no seal", func(t *sitetasks.Task) { t.Sealed = "" }, fault.InvalidInput, "sealed"},
		{"a plaintext seal", func(t *sitetasks.Task) { t.Sealed = `{"password":"p"}` }, fault.InvalidInput, "sealed"},
		{"no machine", func(t *sitetasks.Task) { t.MachineID = "" }, fault.InvalidInput, "machineId"},
		{"another tenant's site", func(t *sitetasks.Task) { t.TenantID = "other" }, fault.NotFound, "siteId"},
		{"a bad mac", func(t *sitetasks.Task) {
			t.Kind, t.Sealed, t.Payload = sitetasks.KindPXEDisarm, "", sitetasks.Payload{MACs: []string{"zz"}}
		}, fault.InvalidInput, "payload.macs"},
		{"a ramdisk arm without images", func(t *sitetasks.Task) {
			t.Kind, t.Payload = sitetasks.KindPXEArm, sitetasks.Payload{MACs: []string{"aa:bb:cc:dd:ee:ff"}, Decision: "ramdisk"}
		}, fault.InvalidInput, "payload.kernel"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			task := ok
			p := *ok.Payload.BMC
			task.Payload.BMC = &p
			tc.edit(&task)
			_, err := inTx(t, f, func(tx pgx.Tx, _ *reconcile.Queue) (sitetasks.Task, error) {
				return sitetasks.Enqueue(t.Context(), tx, task)
			})
			if fault.CodeOf(err) != tc.code || fieldOf(err) != tc.field {
				t.Fatalf("got %v, want %s on %s", err, tc.code, tc.field)
			}
		})
	}
	got, err := inTx(t, f, func(tx pgx.Tx, _ *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Enqueue(t.Context(), tx, ok)
	})
	if err != nil || got.State != sitetasks.Pending || got.SealKID != a.kid || got.Attempts != 0 {
		t.Fatalf("the good task: %+v %v", got, err)
	}
}

func TestClaimCompleteUnderTheLease(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	if _, err := sitetasks.SealKey(ctx, f.db, f.site.ID); fault.CodeOf(err) != fault.Unavailable {
		t.Fatalf("SealKey with no holder: %v, want UNAVAILABLE", err)
	}
	a, b := f.agent(t), f.agent(t)
	ha := f.lease(t, a)
	k, err := sitetasks.SealKey(ctx, f.db, f.site.ID)
	if err != nil || k.AgentID != a.id || k.Epoch != ha.Epoch || k.KID != a.kid {
		t.Fatalf("SealKey = %+v %v", k, err)
	}
	task := f.inspect(t, "mach_1")

	// The standby claims nothing: it does not hold the lease.
	hb := sitetasks.Holder{SiteID: f.site.ID, AgentID: b.id, Epoch: ha.Epoch, SessionKID: b.kid}
	if _, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) ([]sitetasks.Task, error) { return sitetasks.Claim(ctx, tx, q, hb) }); !errors.Is(err, sites.ErrFenced) {
		t.Fatalf("the standby's claim: %v, want ErrFenced", err)
	}
	// A superseded session of the holder claims nothing either.
	if got := f.claim(t, sitetasks.Holder{SiteID: f.site.ID, AgentID: a.id, Epoch: ha.Epoch, SessionKID: "old"}); len(got) != 0 {
		t.Fatalf("a superseded session claimed %+v", got)
	}

	claimed := f.claim(t, ha)
	if len(claimed) != 1 || claimed[0].ID != task.ID || claimed[0].State != sitetasks.InFlight || claimed[0].Attempts != 1 ||
		claimed[0].LeaseEpoch != ha.Epoch || claimed[0].AgentID != a.id {
		t.Fatalf("claimed %+v", claimed)
	}
	if again := f.claim(t, ha); len(again) != 0 {
		t.Fatalf("claimed twice: %+v", again)
	}
	plain, err := credseal.Open(a.key, claimed[0].Sealed, credseal.TaskAAD(task.ID, "mach_1")...)
	if err != nil || string(plain) != `{"username":"u","password":"p"}` {
		t.Fatalf("the holder opens %q, %v", plain, err)
	}

	inv := &sitetasks.Result{Inventory: &sitetasks.Inventory{Manufacturer: "Contoso", NICs: []sitetasks.NIC{{ID: "1", MAC: "aa:bb:cc:dd:ee:01"}}}}
	if _, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Complete(ctx, tx, q, ha, sitetasks.Outcome{ID: task.ID, Attempt: 2, Result: inv})
	}); !errors.Is(err, sitetasks.ErrStale) || fieldOf(err) != "attempt" {
		t.Fatalf("a result for another attempt: %v, want ErrStale", err)
	}
	done, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Complete(ctx, tx, q, ha, sitetasks.Outcome{ID: task.ID, Attempt: 1, Result: inv})
	})
	if err != nil || done.State != sitetasks.Succeeded || done.FinishedAt == nil || done.Result.Inventory.NICs[0].MAC != "aa:bb:cc:dd:ee:01" {
		t.Fatalf("completed %+v %v", done, err)
	}
	if !f.queued(t, "mach_1") {
		t.Fatal("no metal job for the machine after its task finished")
	}
	if _, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Fail(ctx, tx, q, ha, sitetasks.Outcome{ID: task.ID, Attempt: 1, Error: "late"})
	}); !errors.Is(err, sitetasks.ErrStale) {
		t.Fatalf("a second result: %v, want ErrStale", err)
	}
	list, err := sitetasks.ListByMachine(ctx, f.db, "mach_1")
	if err != nil || len(list) != 1 || list[0].State != sitetasks.Succeeded {
		t.Fatalf("ListByMachine = %+v %v", list, err)
	}
}

// TestATakeOverRedispatchesAndFencesTheOldHolder: a task in flight on a
// holder whose lease lapsed goes to the new holder once resealed to its key,
// as a new attempt; the old holder's result is refused.
func TestATakeOverRedispatchesAndFencesTheOldHolder(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	a, b := f.agent(t), f.agent(t)
	ha := f.lease(t, a)
	task := f.inspect(t, "mach_1")
	if got := f.claim(t, ha); len(got) != 1 {
		t.Fatalf("claimed %+v", got)
	}
	if err := sites.ReleaseLease(ctx, f.db, f.site.ID, a.id); err != nil { // as if it lapsed
		t.Fatal(err)
	}
	hb := f.lease(t, b)
	if hb.Epoch != ha.Epoch+1 {
		t.Fatalf("the new holder's epoch %d, want %d", hb.Epoch, ha.Epoch+1)
	}

	// Sealed to a's key: not sent to b, but marked for resealing.
	if got := f.claim(t, hb); len(got) != 0 {
		t.Fatalf("b claimed a task sealed to a's key: %+v", got)
	}
	stale, err := sitetasks.NeedingReseal(ctx, f.db, f.site.ID)
	if err != nil || len(stale) != 1 || stale[0].ID != task.ID || stale[0].State != sitetasks.Pending {
		t.Fatalf("NeedingReseal = %+v %v", stale, err)
	}
	if !f.queued(t, "mach_1") {
		t.Fatal("the producer was not woken to reseal")
	}
	k, err := sitetasks.SealKey(ctx, f.db, f.site.ID)
	if err != nil || k.KID != b.kid {
		t.Fatalf("SealKey = %+v %v", k, err)
	}
	resealed, _ := credseal.Seal(k.JWK, []byte(`{"username":"u","password":"p"}`), credseal.TaskAAD(task.ID, "mach_1")...)
	if _, err := sitetasks.Reseal(ctx, f.db, task.ID, resealed); err != nil {
		t.Fatal(err)
	}
	got := f.claim(t, hb)
	if len(got) != 1 || got[0].Attempts != 2 || got[0].LeaseEpoch != hb.Epoch || got[0].AgentID != b.id {
		t.Fatalf("b claimed %+v", got)
	}

	// The old holder's late result, under its old epoch, is refused.
	_, err = inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Complete(ctx, tx, q, ha, sitetasks.Outcome{ID: task.ID, Attempt: 1, Result: &sitetasks.Result{PowerState: "On"}})
	})
	if !errors.Is(err, sites.ErrFenced) || fieldOf(err) != "bootEpoch" {
		t.Fatalf("the old holder's result: %v, want CONFLICT on bootEpoch", err)
	}
	done, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Fail(ctx, tx, q, hb, sitetasks.Outcome{ID: task.ID, Attempt: 2, Error: "bmc unavailable"})
	})
	if err != nil || done.State != sitetasks.Failed || done.Error != "bmc unavailable" || done.Result != nil {
		t.Fatalf("failed %+v %v", done, err)
	}

	// An unsealed in-flight task goes to a new session of the same holder.
	disarm, err := inTx(t, f, func(tx pgx.Tx, _ *reconcile.Queue) (sitetasks.Task, error) {
		return sitetasks.Enqueue(ctx, tx, sitetasks.Task{TenantID: "root", SiteID: f.site.ID, MachineID: "mach_2", Kind: sitetasks.KindPXEDisarm,
			Payload: sitetasks.Payload{MACs: []string{"AA:BB:CC:DD:EE:02"}}, NotAfter: time.Now().Add(time.Hour)})
	})
	if err != nil || disarm.Payload.MACs[0] != "aa:bb:cc:dd:ee:02" {
		t.Fatalf("enqueue disarm: %+v %v", disarm, err)
	}
	if got := f.claim(t, hb); len(got) != 1 || got[0].Attempts != 1 {
		t.Fatalf("claimed %+v", got)
	}
	f.session(t, b)
	hb.SessionKID = b.kid
	if got := f.claim(t, hb); len(got) != 1 || got[0].ID != disarm.ID || got[0].Attempts != 2 {
		t.Fatalf("the new session claimed %+v", got)
	}
}

func TestExpireAndPrune(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	a := f.agent(t)
	h := f.lease(t, a)
	pending, inflight, kept := f.inspect(t, "mach_1"), f.inspect(t, "mach_2"), f.inspect(t, "mach_3")
	if got := f.claim(t, h); len(got) != 3 {
		t.Fatalf("claimed %d", len(got))
	}
	if _, err := f.db.Exec(ctx, `UPDATE site_tasks SET state = 'pending' WHERE id = $1`, pending.ID); err != nil {
		t.Fatal(err)
	}
	// Their deadlines pass (the clock cannot be moved, the rows can).
	if _, err := f.db.Exec(ctx, `UPDATE site_tasks SET not_after = now() - interval '1 second' WHERE id = ANY($1)`,
		[]string{pending.ID, inflight.ID}); err != nil {
		t.Fatal(err)
	}
	if got := f.claim(t, h); len(got) != 0 {
		t.Fatalf("claimed tasks past their deadline: %+v", got)
	}
	n, err := inTx(t, f, func(tx pgx.Tx, q *reconcile.Queue) (int, error) { return sitetasks.Expire(ctx, tx, q, "", 100) })
	if err != nil || n != 2 {
		t.Fatalf("Expire = %d, %v; want 2", n, err)
	}
	for _, id := range []string{pending.ID, inflight.ID} {
		if got, _ := sitetasks.Get(ctx, f.db, id); got.State != sitetasks.Expired || got.FinishedAt == nil {
			t.Fatalf("%s: %+v", id, got)
		}
	}
	if got, _ := sitetasks.Get(ctx, f.db, kept.ID); got.State != sitetasks.InFlight {
		t.Fatalf("a task within its deadline: %+v", got)
	}
	if !f.queued(t, "mach_1") || !f.queued(t, "mach_2") || f.queued(t, "mach_3") {
		t.Fatal("Expire woke the wrong machines")
	}

	if _, err := f.db.Exec(ctx, `UPDATE site_tasks SET finished_at = now() - interval '8 days' WHERE id = $1`, pending.ID); err != nil {
		t.Fatal(err)
	}
	pruned, err := sitetasks.Prune(ctx, f.db, time.Now().Add(-sitetasks.Retention), 100)
	if err != nil || pruned != 1 {
		t.Fatalf("Prune = %d, %v; want 1", pruned, err)
	}
	if _, err := sitetasks.Get(ctx, f.db, pending.ID); fault.CodeOf(err) != fault.NotFound {
		t.Fatalf("the pruned task: %v", err)
	}
	if _, err := sitetasks.Get(ctx, f.db, inflight.ID); err != nil {
		t.Fatalf("a task finished today was pruned: %v", err)
	}
}
