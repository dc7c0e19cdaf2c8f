package nodes_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// setup returns a database with tenants acme and other, pool_a (acme) and the nodes ids in
// it, each with its first session open (epoch 1).
func setup(t *testing.T, ids ...string) *pgxpool.Pool {
	t.Helper()
	db := pgtest.New(t)
	fixture.Tenant(t, db, fixture.TenantOpts{ID: "acme"})
	fixture.Tenant(t, db, fixture.TenantOpts{ID: "other"})
	fixture.Pool(t, db, fixture.PoolOpts{ID: "pool_a", Tenant: "acme"})
	for _, id := range ids {
		if _, err := nodes.Create(t.Context(), db, nodes.Node{ID: id, TenantID: "acme", PoolID: "pool_a", HardwareKey: "hw-" + id}); err != nil {
			t.Fatal(err)
		}
		if s, err := nodes.OpenSession(t.Context(), db, id, "gw-1", "boot-1", "journal-1", "v0.1.0"); err != nil || s.Epoch != 1 {
			t.Fatalf("open session of %s: %+v %v", id, s, err)
		}
	}
	return db
}

func lookup(t *testing.T, db *pgxpool.Pool, id string) nodes.Node {
	t.Helper()
	n, err := nodes.Lookup(t.Context(), db, id)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// setGeneration stands in for the nodespec controller: node id is at
// generation gen.
func setGeneration(t *testing.T, db *pgxpool.Pool, id string, gen int64) {
	t.Helper()
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET generation = $2 WHERE id = $1`, id, gen); err != nil {
		t.Fatal(err)
	}
}

func status(section string, gen int64) json.RawMessage {
	return json.RawMessage(fmt.Sprintf(`[{"section":%q,"state":"SECTION_STATE_CONVERGED","reason":"","generation":%d}]`, section, gen))
}

func record(t *testing.T, db *pgxpool.Pool, obs ...nodes.Observation) []nodes.Observed {
	t.Helper()
	var out []nodes.Observed
	err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
		var err error
		out, err = nodes.RecordObserved(t.Context(), tx, obs)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(obs) {
		t.Fatalf("%d results for %d observations", len(out), len(obs))
	}
	return out
}

func TestRecordObserved(t *testing.T) {
	t.Parallel()

	t.Run("the observed generation never goes backwards", func(t *testing.T) {
		t.Parallel()
		db := setup(t, "node_a")
		setGeneration(t, db, "node_a", 5)
		got := record(t, db, nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 5, SectionStatus: status("site", 5)})
		if want := (nodes.Observed{Stored: true, TenantID: "acme", Generation: 5, ObservedGeneration: 5, PoolID: "pool_a"}); got[0] != want {
			t.Fatalf("first report: %+v, want %+v", got[0], want)
		}
		// A late report of an older generation keeps the generation and
		// brings its section status.
		got = record(t, db, nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 3, SectionStatus: status("late", 3)})
		if got[0].ObservedGeneration != 5 {
			t.Fatalf("late report lowered the observed generation: %+v", got[0])
		}
		n := lookup(t, db, "node_a")
		if n.ObservedGeneration != 5 || len(n.Sections) != 1 || n.Sections[0].Section != "late" {
			t.Fatalf("after the late report: observed %d, sections %+v", n.ObservedGeneration, n.Sections)
		}
	})

	t.Run("a superseded session's report changes nothing", func(t *testing.T) {
		t.Parallel()
		db := setup(t, "node_a")
		if _, err := nodes.OpenSession(t.Context(), db, "node_a", "gw-2", "boot-2", "journal-1", "v0.1.0"); err != nil {
			t.Fatal(err)
		}
		before := lookup(t, db, "node_a")
		got := record(t, db, nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 7, SectionStatus: status("site", 7)})
		if got[0] != (nodes.Observed{}) {
			t.Fatalf("superseded report: %+v, want not stored", got[0])
		}
		after := lookup(t, db, "node_a")
		if after.ObservedGeneration != 0 || len(after.Sections) != 0 || !after.UpdatedAt.Equal(before.UpdatedAt) {
			t.Fatalf("superseded report wrote the node: %+v", after)
		}
	})

	t.Run("a report replacing one with a section reported drifted says so", func(t *testing.T) {
		t.Parallel()
		db := setup(t, "node_a")
		setGeneration(t, db, "node_a", 1)
		drifted := json.RawMessage(`[{"section":"devices","state":"SECTION_STATE_CONVERGED","reason":"drifted: /var/run/cdi/x.json was edited","generation":1}]`)
		for i, c := range []struct {
			status json.RawMessage
			prev   bool
		}{{status("devices", 1), false}, {drifted, false}, {drifted, true}, {status("devices", 1), true}, {status("devices", 1), false}} {
			got := record(t, db, nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 1, SectionStatus: c.status})
			if !got[0].Stored || got[0].PrevDrifted != c.prev {
				t.Fatalf("report %d: %+v, want PrevDrifted %t", i, got[0], c.prev)
			}
		}
	})

	t.Run("one statement stores a batch, results in order", func(t *testing.T) {
		t.Parallel()
		db := setup(t, "node_a", "node_b", "node_c")
		setGeneration(t, db, "node_a", 2)
		setGeneration(t, db, "node_b", 4)
		got := record(t, db,
			nodes.Observation{NodeID: "node_c", Epoch: 9, Generation: 1}, // superseded
			nodes.Observation{NodeID: "node_b", Epoch: 1, Generation: 4, SectionStatus: status("b", 4)},
			nodes.Observation{NodeID: "node_nope", Epoch: 1, Generation: 1}, // no such node
			nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 1, SectionStatus: status("a", 1)},
		)
		want := []nodes.Observed{
			{},
			{Stored: true, TenantID: "acme", Generation: 4, ObservedGeneration: 4, PoolID: "pool_a"},
			{},
			{Stored: true, TenantID: "acme", Generation: 2, ObservedGeneration: 1, PoolID: "pool_a"},
		}
		if !slices.Equal(got, want) {
			t.Fatalf("results %+v, want %+v", got, want)
		}
		if n := lookup(t, db, "node_c"); n.ObservedGeneration != 0 {
			t.Fatalf("superseded report stored: %+v", n)
		}
	})

	t.Run("reports of one session in a batch keep the highest generation and the last status", func(t *testing.T) {
		t.Parallel()
		db := setup(t, "node_a")
		setGeneration(t, db, "node_a", 3)
		got := record(t, db,
			nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 3, SectionStatus: status("first", 3)},
			nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 2, SectionStatus: status("last", 2)},
		)
		for i, o := range got {
			if !o.Stored || o.ObservedGeneration != 3 {
				t.Fatalf("result %d: %+v", i, o)
			}
		}
		n := lookup(t, db, "node_a")
		if n.ObservedGeneration != 3 || len(n.Sections) != 1 || n.Sections[0].Section != "last" {
			t.Fatalf("observed %d, sections %+v", n.ObservedGeneration, n.Sections)
		}
	})

	t.Run("an empty batch runs nothing", func(t *testing.T) {
		t.Parallel()
		got, err := nodes.RecordObserved(t.Context(), nil, nil)
		if err != nil || len(got) != 0 {
			t.Fatalf("%v %v", got, err)
		}
	})

	t.Run("batches over the same nodes in any order do not deadlock", func(t *testing.T) {
		t.Parallel()
		var ids []string
		for i := range 32 {
			ids = append(ids, fmt.Sprintf("node_%02d", i))
		}
		db := setup(t, ids...)
		for _, id := range ids {
			setGeneration(t, db, id, 14)
		}
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for w := range 4 {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(w), 1))
				for i := range 15 {
					obs := make([]nodes.Observation, len(ids))
					for j, id := range ids {
						obs[j] = nodes.Observation{NodeID: id, Epoch: 1, Generation: int64(i), SectionStatus: status("s", int64(i))}
					}
					r.Shuffle(len(obs), func(a, b int) { obs[a], obs[b] = obs[b], obs[a] })
					err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
						_, err := nodes.RecordObserved(t.Context(), tx, obs)
						return err
					})
					if err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		for _, id := range ids {
			if n := lookup(t, db, id); n.ObservedGeneration != 14 {
				t.Fatalf("%s: observed %d, want 14", id, n.ObservedGeneration)
			}
		}
	})
}

func TestNextCommandSeq(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b")
	for want := int64(1); want <= 3; want++ {
		seq, tenant, err := nodes.NextCommandSeq(t.Context(), db, "node_a")
		if err != nil || seq != want || tenant != "acme" {
			t.Fatalf("seq %d of %q (%v), want %d of acme", seq, tenant, err, want)
		}
	}
	// Each node counts on its own.
	if seq, _, err := nodes.NextCommandSeq(t.Context(), db, "node_b"); err != nil || seq != 1 {
		t.Fatalf("node_b: seq %d (%v), want 1", seq, err)
	}
	// Two transactions taking numbers at once never share one: the second
	// waits for the first's commit.
	var mu sync.Mutex
	seen := map[int64]bool{}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 5 {
				err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
					seq, _, err := nodes.NextCommandSeq(t.Context(), tx, "node_a")
					if err != nil {
						return err
					}
					mu.Lock()
					defer mu.Unlock()
					if seen[seq] {
						return fmt.Errorf("seq %d taken twice", seq)
					}
					seen[seq] = true
					return nil
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if len(seen) != 20 {
		t.Fatalf("%d numbers taken, want 20", len(seen))
	}
	if _, _, err := nodes.NextCommandSeq(t.Context(), db, "node_nope"); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("unknown node: %v, want pgx.ErrNoRows", err)
	}
}

func TestOpenSession(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a")
	s, err := nodes.OpenSession(t.Context(), db, "node_a", "gw-2", "boot-2", "journal-2", "v0.1.0")
	if want := (nodes.Session{Epoch: 2, PrevBootID: "boot-1", PrevJournalID: "journal-1", PrevAgentVersion: "v0.1.0"}); err != nil || s != want {
		t.Fatalf("second session: %+v (%v), want %+v", s, err, want)
	}
	n := lookup(t, db, "node_a")
	if n.SessionEpoch != 2 || n.GatewayID != "gw-2" || n.BootID != "boot-2" || n.JournalID != "journal-2" || n.LastSeenAt == nil {
		t.Fatalf("after the second session: %+v", n)
	}
	if _, err := nodes.OpenSession(t.Context(), db, "node_nope", "gw-2", "b", "j", "v0.1.0"); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("unknown node: %v, want pgx.ErrNoRows", err)
	}
}

func TestWriteLiveness(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b", "node_c")
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET last_seen_at = NULL`); err != nil {
		t.Fatal(err)
	}
	if _, err := nodes.OpenSession(t.Context(), db, "node_c", "gw-2", "boot-1", "journal-1", "v0.1.0"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET last_seen_at = NULL WHERE id = 'node_c'`); err != nil {
		t.Fatal(err)
	}
	stale, err := nodes.WriteLiveness(t.Context(), db, []nodes.Liveness{
		{NodeID: "node_a", Epoch: 1, Seen: true},
		{NodeID: "node_b", Epoch: 1, Seen: false},
		{NodeID: "node_c", Epoch: 1, Seen: true}, // superseded by epoch 2
		{NodeID: "node_nope", Epoch: 1, Seen: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(stale, func(a, b nodes.SessionRef) int { return strings.Compare(a.NodeID, b.NodeID) })
	if want := []nodes.SessionRef{{"node_c", 1}, {"node_nope", 1}}; !slices.Equal(stale, want) {
		t.Fatalf("stale %+v, want %+v", stale, want)
	}
	for id, seen := range map[string]bool{"node_a": true, "node_b": false, "node_c": false} {
		if n := lookup(t, db, id); (n.LastSeenAt != nil) != seen {
			t.Errorf("%s: last seen %v, want seen %v", id, n.LastSeenAt, seen)
		}
	}
}

func TestSpecErrorWrites(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a")

	t.Run("the same spec error is not written twice", func(t *testing.T) {
		if err := nodes.SetSpecError(t.Context(), db, "node_a", "conflict on site.ntp_servers"); err != nil {
			t.Fatal(err)
		}
		first := lookup(t, db, "node_a")
		waitClockPast(t, db, first.UpdatedAt)
		if err := nodes.SetSpecError(t.Context(), db, "node_a", "conflict on site.ntp_servers"); err != nil {
			t.Fatal(err)
		}
		if n := lookup(t, db, "node_a"); !n.UpdatedAt.Equal(first.UpdatedAt) || n.SpecError != first.SpecError {
			t.Fatalf("the same error rewrote the node: updated %v → %v", first.UpdatedAt, n.UpdatedAt)
		}
		if err := nodes.SetSpecError(t.Context(), db, "node_a", "another conflict"); err != nil {
			t.Fatal(err)
		}
		if n := lookup(t, db, "node_a"); n.SpecError != "another conflict" || !n.UpdatedAt.After(first.UpdatedAt) {
			t.Fatalf("a new error: %q, updated %v", n.SpecError, n.UpdatedAt)
		}
		if err := nodes.ClearSpecError(t.Context(), db, "node_a"); err != nil {
			t.Fatal(err)
		}
		if s, err := nodes.GetSpec(t.Context(), db, "acme", "node_a"); err != nil || s.Error != "" {
			t.Fatalf("after clearing: %+v %v", s, err)
		}
	})
}

// waitClockPast waits until the database's clock is past at, so that a
// write now would show in updated_at.
func waitClockPast(t *testing.T, db *pgxpool.Pool, at time.Time) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	for {
		var past bool
		if err := db.QueryRow(ctx, `SELECT now() > $1`, at).Scan(&past); err != nil {
			t.Fatal(err)
		}
		if past {
			return
		}
	}
}

func TestInventoryAndLabelWrites(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a")
	fixture.Pool(t, db, fixture.PoolOpts{ID: "pool_o", Tenant: "other"})
	if _, err := nodes.Create(t.Context(), db, nodes.Node{ID: "node_o", TenantID: "other", PoolID: "pool_o", HardwareKey: "hw-o"}); err != nil {
		t.Fatal(err)
	}

	if err := nodes.SetLabels(t.Context(), db, "acme", "node_a", map[string]string{"rack": "r1"}); err != nil {
		t.Fatal(err)
	}
	// Another tenant's node is left alone.
	if err := nodes.SetLabels(t.Context(), db, "acme", "node_o", map[string]string{"rack": "r1"}); err != nil {
		t.Fatal(err)
	}
	if n := lookup(t, db, "node_a"); n.Labels["rack"] != "r1" {
		t.Fatalf("labels %v", n.Labels)
	}
	if n := lookup(t, db, "node_o"); len(n.Labels) != 0 {
		t.Fatalf("another tenant's node was relabelled: %v", n.Labels)
	}
	if err := nodes.SetLabels(t.Context(), db, "acme", "node_a", nil); err != nil {
		t.Fatal(err)
	}
	if n := lookup(t, db, "node_a"); n.Labels == nil || len(n.Labels) != 0 {
		t.Fatalf("nil labels: %v", n.Labels)
	}

	if err := nodes.SetHostname(t.Context(), db, "node_a", "gpu-01"); err != nil {
		t.Fatal(err)
	}
	since := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	conds := []nodes.Condition{{Type: "InventoryReported", Status: true, Since: since}, {Type: "GPUsHealthy", Reason: "unhealthy: [GPU-0]", Since: since}}
	if err := nodes.SetState(t.Context(), db, "node_a", nodes.StateAdopted, conds); err != nil {
		t.Fatal(err)
	}
	n := lookup(t, db, "node_a")
	if n.Hostname != "gpu-01" || n.State != nodes.StateAdopted || len(n.Conditions) != 2 ||
		n.Conditions[1].Reason != conds[1].Reason || !n.Conditions[0].Since.Equal(since) {
		t.Fatalf("after inventory: %+v", n)
	}
}

// TestBatchedWritersOfNodesDoNotDeadlock: liveness (a gateway's every
// session, in whatever order it lists them), convergence reports and the
// nodespec controller's batches all lock nodes in id order, so running
// them at once over the same nodes never deadlocks (PostgreSQL would break
// one after deadlock_timeout with 40P01).
func TestBatchedWritersOfNodesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	var ids []string
	for i := range 64 {
		ids = append(ids, fmt.Sprintf("node_%02d", i))
	}
	db := setup(t, ids...)
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for w := range 6 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 2))
			for i := range 20 {
				shuffled := slices.Clone(ids)
				r.Shuffle(len(shuffled), func(a, b int) { shuffled[a], shuffled[b] = shuffled[b], shuffled[a] })
				err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
					switch w % 3 {
					case 0:
						live := make([]nodes.Liveness, len(shuffled))
						for j, id := range shuffled {
							live[j] = nodes.Liveness{NodeID: id, Epoch: 1, Seen: true}
						}
						_, err := nodes.WriteLiveness(t.Context(), tx, live)
						return err
					case 1:
						obs := make([]nodes.Observation, len(shuffled))
						for j, id := range shuffled {
							obs[j] = nodes.Observation{NodeID: id, Epoch: 1, Generation: int64(i), SectionStatus: status("s", int64(i))}
						}
						_, err := nodes.RecordObserved(t.Context(), tx, obs)
						return err
					default:
						if _, err := nodes.LockForSpec(t.Context(), tx, shuffled[:32]); err != nil {
							return err
						}
						writes := make([]nodes.SpecWrite, 32)
						for j, id := range shuffled[:32] {
							writes[j] = nodes.SpecWrite{ID: id, Spec: []byte(fmt.Sprintf(`{"site": {"logLevel": "l%d"}}`, i))}
						}
						_, err := nodes.StoreSpecs(t.Context(), tx, writes)
						return err
					}
				})
				if err != nil {
					errs <- fmt.Errorf("writer %d, round %d: %w", w, i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// TestStoreSpecsBumpsEachGenerationOnce: every written node moves one
// generation with its spec, its error cleared; a node that is gone is left
// out; the result is in id order with the gateway holding each.
func TestStoreSpecsBumpsEachGenerationOnce(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b")
	if err := nodes.SetSpecError(t.Context(), db, "node_b", "conflict"); err != nil {
		t.Fatal(err)
	}
	got, err := nodes.StoreSpecs(t.Context(), db, []nodes.SpecWrite{
		{ID: "node_b", Spec: []byte(`{"site": {"logLevel": "debug"}}`)},
		{ID: "node_gone", Spec: []byte(`{}`)},
		{ID: "node_a", Spec: []byte(`{"site": {"logLevel": "info"}}`)},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []nodes.StoredSpec{{ID: "node_a", Generation: 1, TenantID: "acme", GatewayID: "gw-1"}, {ID: "node_b", Generation: 1, TenantID: "acme", GatewayID: "gw-1"}}
	if !slices.Equal(got, want) {
		t.Fatalf("stored %+v, want %+v", got, want)
	}
	locked, err := nodes.LockForSpec(t.Context(), db, []string{"node_b", "node_a", "node_gone"})
	if err != nil {
		t.Fatal(err)
	}
	if len(locked) != 2 || locked[0].ID != "node_a" || locked[1].ID != "node_b" || locked[1].SpecError != "" || locked[1].Generation != 1 ||
		!strings.Contains(string(locked[1].Spec), "debug") {
		t.Fatalf("after the store: %+v", locked)
	}
}

// Security review 13 #10: a node reported observedGeneration 2^62, after
// which later generations were never delivered and its bookings counted as
// bound. The stored observed generation is capped at the node's generation,
// and a row already past it is capped when the next session opens.
func TestNodeCannotReportAGenerationAheadOfItsSpec(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b")
	setGeneration(t, db, "node_a", 3)
	setGeneration(t, db, "node_b", 1)
	got := record(t, db,
		nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 1 << 62, SectionStatus: status("site", 1<<62)},
		nodes.Observation{NodeID: "node_b", Epoch: 1, Generation: 1},
	)
	if want := (nodes.Observed{Stored: true, TenantID: "acme", Generation: 3, ObservedGeneration: 3, PoolID: "pool_a"}); got[0] != want {
		t.Fatalf("report of 2^62: %+v, want %+v", got[0], want)
	}
	if got[1].ObservedGeneration != 1 {
		t.Fatalf("honest report in the same batch: %+v", got[1])
	}
	// The next generation is not observed until the node reports it.
	setGeneration(t, db, "node_a", 4)
	if n := lookup(t, db, "node_a"); n.ObservedGeneration != 3 || n.Generation != 4 {
		t.Fatalf("after generation 4: observed %d of %d", n.ObservedGeneration, n.Generation)
	}
	got = record(t, db, nodes.Observation{NodeID: "node_a", Epoch: 1, Generation: 4})
	if got[0].ObservedGeneration != 4 {
		t.Fatalf("report of 4: %+v", got[0])
	}

	// A row stored past its generation (before the cap) is capped when the
	// node's next session opens, and the gateway is told the capped value.
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET observed_generation = $2 WHERE id = $1`, "node_b", int64(1)<<62); err != nil {
		t.Fatal(err)
	}
	s, err := nodes.OpenSession(t.Context(), db, "node_b", "gw-1", "boot-1", "journal-1", "v0.1.0")
	if err != nil {
		t.Fatal(err)
	}
	if s.ObservedGeneration != 1 {
		t.Fatalf("session opened with observed generation %d of 1", s.ObservedGeneration)
	}
	if n := lookup(t, db, "node_b"); n.ObservedGeneration != 1 {
		t.Fatalf("row not capped: observed %d", n.ObservedGeneration)
	}
}
