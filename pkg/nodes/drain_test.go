package nodes_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodes"
)

func exec(t *testing.T, db *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

func setNodeState(t *testing.T, db *pgxpool.Pool, id, state string) {
	t.Helper()
	exec(t, db, `UPDATE nodes SET state = $2 WHERE id = $1`, id, state)
}

// book gives node id an active booking of reservation rsv.
func book(t *testing.T, db *pgxpool.Pool, rsv, id string) {
	t.Helper()
	exec(t, db, `INSERT INTO reservations (id, tenant_id, pool_id, gpu_count, state) VALUES ($1, 'acme', 'pool_a', 1, 'bound') ON CONFLICT DO NOTHING`, rsv)
	exec(t, db, `INSERT INTO devices (node_id, id, index, model, memory_bytes) VALUES ($1, $2, 0, 'NVIDIA H200', 1) ON CONFLICT DO NOTHING`, id, "GPU-"+id)
	exec(t, db, `INSERT INTO bookings (reservation_id, node_id, device_id, tenant_id, pool_id) VALUES ($1, $2, $3, 'acme', 'pool_a')`, rsv, id, "GPU-"+id)
}

func wantFault(t *testing.T, err error, code fault.Code, field, contains string) {
	t.Helper()
	fe, ok := fault.As(err)
	if !ok || fe.Code != code || fe.Field != field || !strings.Contains(fe.Message, contains) {
		t.Fatalf("got %v, want %s on %s saying %q", err, code, field, contains)
	}
}

func TestDrainTransitions(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b")
	ctx := t.Context()
	setNodeState(t, db, "node_a", nodes.StateAdopted)
	setNodeState(t, db, "node_b", nodes.StateAdopted)
	book(t, db, "rsv_1", "node_a")

	deadline := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	n, err := nodes.StartDrain(ctx, db, "node_a", nodes.Drain{Deadline: deadline, Reason: "rack move", By: nodes.DrainByOperator})
	if err != nil {
		t.Fatal(err)
	}
	if n.State != nodes.StateDraining || !n.DrainDeadline.Equal(deadline) || n.DrainReason != "rack move" || n.DrainBy != nodes.DrainByOperator ||
		n.DrainStartedAt == nil || n.Retiring {
		t.Fatalf("after StartDrain: %+v", n)
	}
	started := *n.DrainStartedAt

	// Draining again moves the deadline, keeps the start, ORs retiring, and
	// an operator's drain stays the operator's when remediation drains too.
	later := deadline.Add(time.Hour)
	n, err = nodes.StartDrain(ctx, db, "node_a", nodes.Drain{Deadline: later, Reason: "gpu.reset failed", By: nodes.DrainByRemediation, Retire: true})
	if err != nil {
		t.Fatal(err)
	}
	if !n.DrainStartedAt.Equal(started) || !n.DrainDeadline.Equal(later) || n.DrainBy != nodes.DrainByOperator || !n.Retiring || n.DrainReason != "gpu.reset failed" {
		t.Fatalf("after a second StartDrain: %+v", n)
	}
	n, err = nodes.StartDrain(ctx, db, "node_a", nodes.Drain{Deadline: later, By: nodes.DrainByOperator})
	if err != nil || !n.Retiring {
		t.Fatalf("retiring is OR-ed, never cleared by a drain: %+v %v", n, err)
	}

	// The drain is not over: a booking is active and the deadline is ahead.
	if _, changed, err := nodes.MarkDrained(ctx, db, "node_a"); err != nil || changed {
		t.Fatalf("MarkDrained before the deadline with a booking: %v %v", changed, err)
	}
	if due, err := nodes.DueDrains(ctx, db, 0); err != nil || len(due) != 0 {
		t.Fatalf("due drains: %v %v", due, err)
	}
	if keys, err := nodes.DrainKeys(ctx, db, []int{lookup(t, db, "node_a").Shard}); err != nil || !slices.Equal(keys, []string{"node_a"}) {
		t.Fatalf("drain keys: %v %v", keys, err)
	}
	refs, err := nodes.LiveReservationsOn(ctx, db, "node_a")
	if err != nil || len(refs) != 1 || refs[0] != (nodes.ReservationRef{ID: "rsv_1", TenantID: "acme"}) {
		t.Fatalf("live reservations on node_a: %+v %v", refs, err)
	}
	// Past the deadline it is due, and drained.
	exec(t, db, `UPDATE nodes SET drain_deadline = now() - interval '1 second' WHERE id = 'node_a'`)
	if due, err := nodes.DueDrains(ctx, db, 0); err != nil || !slices.Equal(due, []string{"node_a"}) {
		t.Fatalf("due drains past the deadline: %v %v", due, err)
	}
	n, changed, err := nodes.MarkDrained(ctx, db, "node_a")
	if err != nil || !changed || n.State != nodes.StateDrained {
		t.Fatalf("MarkDrained past the deadline: %+v %v %v", n, changed, err)
	}
	if _, changed, _ := nodes.MarkDrained(ctx, db, "node_a"); changed {
		t.Fatal("MarkDrained twice changed the node twice")
	}
	// Retiring and drained: still due (for the retire), past undraining,
	// and not retired while a booking is active unless the policy keeps it.
	if due, _ := nodes.DueDrains(ctx, db, 0); !slices.Equal(due, []string{"node_a"}) {
		t.Fatalf("a retiring drained node is due: %v", due)
	}
	_, err = nodes.Undrain(ctx, db, "node_a")
	wantFault(t, err, fault.Conflict, "nodeId", "being retired")
	if _, changed, err := nodes.MarkRetired(ctx, db, "node_a", false); err != nil || changed {
		t.Fatalf("MarkRetired with an active booking: %v %v", changed, err)
	}
	exec(t, db, `UPDATE bookings SET active = false WHERE node_id = 'node_a'`)
	n, changed, err = nodes.MarkRetired(ctx, db, "node_a", false)
	if err != nil || !changed || n.State != nodes.StateRetired || n.RetiredAt == nil {
		t.Fatalf("MarkRetired: %+v %v %v", n, changed, err)
	}
	if due, _ := nodes.DueDrains(ctx, db, 0); len(due) != 0 {
		t.Fatalf("a retired node is not due: %v", due)
	}

	// node_b: no booking, so its drain is over at once; undrain returns it.
	if _, err := nodes.StartDrain(ctx, db, "node_b", nodes.Drain{Deadline: deadline, By: nodes.DrainByOperator}); err != nil {
		t.Fatal(err)
	}
	if due, _ := nodes.DueDrains(ctx, db, 0); !slices.Equal(due, []string{"node_b"}) {
		t.Fatalf("a draining node without bookings is due: %v", due)
	}
	if _, changed, _ := nodes.MarkDrained(ctx, db, "node_b"); !changed {
		t.Fatal("a draining node without bookings was not drained")
	}
	// A drained node can be retired (it stays drained), but not drained
	// again.
	_, err = nodes.StartDrain(ctx, db, "node_b", nodes.Drain{Deadline: deadline, By: nodes.DrainByOperator})
	wantFault(t, err, fault.Conflict, "nodeId", "drained")
	n, err = nodes.Undrain(ctx, db, "node_b")
	if err != nil || n.State != nodes.StateAdopted || n.DrainDeadline != nil || n.DrainReason != "" || n.DrainBy != "" || n.DrainStartedAt != nil || n.Retiring {
		t.Fatalf("Undrain: %+v %v", n, err)
	}
	_, err = nodes.StartDrain(ctx, db, "node_b", nodes.Drain{Deadline: deadline, By: nodes.DrainByOperator})
	if err != nil {
		t.Fatal(err)
	}
	if _, changed, _ := nodes.MarkDrained(ctx, db, "node_b"); !changed {
		t.Fatal("drain node_b again")
	}
	n, err = nodes.StartDrain(ctx, db, "node_b", nodes.Drain{Deadline: later, By: nodes.DrainByOperator, Retire: true})
	if err != nil || n.State != nodes.StateDrained || !n.Retiring || !n.DrainDeadline.Equal(deadline) {
		t.Fatalf("retiring a drained node: %+v %v", n, err)
	}
}

func TestDrainErrors(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_new", "node_failed", "node_gone", "node_up")
	ctx := t.Context()
	setNodeState(t, db, "node_failed", nodes.StateFailed)
	setNodeState(t, db, "node_gone", nodes.StateRetired)
	setNodeState(t, db, "node_up", nodes.StateAdopted)
	d := nodes.Drain{Deadline: time.Now().Add(time.Hour), By: nodes.DrainByOperator}

	_, err := nodes.StartDrain(ctx, db, "node_nope", d)
	wantFault(t, err, fault.NotFound, "nodeId", "node_nope")
	_, err = nodes.Undrain(ctx, db, "node_nope")
	wantFault(t, err, fault.NotFound, "nodeId", "node_nope")
	for id, state := range map[string]string{"node_new": "adopting", "node_failed": "failed", "node_gone": "retired"} {
		_, err := nodes.StartDrain(ctx, db, id, d)
		wantFault(t, err, fault.Conflict, "nodeId", "is "+state)
		if !errors.Is(err, nodes.ErrWrongState) {
			t.Fatalf("%s: %v does not wrap ErrWrongState", id, err)
		}
		r := d
		r.Retire = true
		_, err = nodes.StartDrain(ctx, db, id, r)
		wantFault(t, err, fault.Conflict, "nodeId", "is "+state)
		_, err = nodes.Undrain(ctx, db, id)
		wantFault(t, err, fault.Conflict, "nodeId", "is "+state)
	}
	_, err = nodes.Undrain(ctx, db, "node_up")
	wantFault(t, err, fault.Conflict, "nodeId", "is adopted")
	_, err = nodes.StartDrain(ctx, db, "node_up", nodes.Drain{Deadline: d.Deadline, By: "someone"})
	wantFault(t, err, fault.InvalidInput, "by", "someone")
	if n := lookup(t, db, "node_up"); n.State != nodes.StateAdopted {
		t.Fatalf("a refused drain changed the node: %+v", n)
	}
	// MarkRetired leaves a node that is not retiring alone.
	if _, changed, err := nodes.MarkRetired(ctx, db, "node_up", true); err != nil || changed {
		t.Fatalf("MarkRetired of an adopted node: %v %v", changed, err)
	}
}

func TestListByCondition(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b", "node_c", "node_d")
	ctx := t.Context()
	exec(t, db, `UPDATE nodes SET state = 'adopted'`)
	exec(t, db, `UPDATE nodes SET ready = 'Unknown' WHERE id = 'node_b'`)
	exec(t, db, `UPDATE nodes SET ready = 'Lost' WHERE id = 'node_c'`)
	exec(t, db, `UPDATE nodes SET state = 'draining', drain_deadline = now() + interval '1 hour' WHERE id = 'node_c'`)
	exec(t, db, `UPDATE nodes SET state = 'drained' WHERE id = 'node_d'`)
	exec(t, db, `UPDATE nodes SET needs_repair = true, needs_repair_reason = 'xid 79', needs_repair_since = now() WHERE id = 'node_b'`)
	exec(t, db, `UPDATE nodes SET conditions = '[{"type":"GPUsHealthy","status":true,"since":"2025-01-01T00:00:00Z"}]' WHERE id IN ('node_a', 'node_b')`)
	exec(t, db, `UPDATE nodes SET conditions = '[{"type":"GPUsHealthy","status":false,"reason":"xid","since":"2025-01-01T00:00:00Z"}]' WHERE id = 'node_c'`)

	for cond, want := range map[string][]string{
		"Ready":             {"node_a", "node_d"},
		"Ready=True":        {"node_a", "node_d"},
		"Ready=Unknown":     {"node_b"},
		"Ready=Lost":        {"node_c"},
		"!Ready":            {"node_b", "node_c"},
		"Draining":          {"node_c", "node_d"},
		"Draining=False":    {"node_a", "node_b"},
		"!Draining":         {"node_a", "node_b"},
		"NeedsRepair":       {"node_b"},
		"!NeedsRepair":      {"node_a", "node_c", "node_d"},
		"GPUsHealthy":       {"node_a", "node_b"},
		"GPUsHealthy=False": {"node_c"},
		"!GPUsHealthy":      {"node_c", "node_d"},
		"DevicesPresent":    nil,
		"":                  {"node_a", "node_b", "node_c", "node_d"},
	} {
		ns, err := nodes.List(ctx, db, nodes.Filter{TenantID: "acme", Condition: cond}, "", 100)
		if err != nil {
			t.Fatalf("%q: %v", cond, err)
		}
		var got []string
		for _, n := range ns {
			got = append(got, n.ID)
		}
		if !slices.Equal(got, want) {
			t.Errorf("condition %q: got %v, want %v", cond, got, want)
		}
	}
	for _, bad := range []string{"Healthy", "Ready=Maybe", "Draining=Unknown", "!Ready=True", "!", "=True", "ready", "Ready=", "GPUsHealthy=Lost"} {
		_, err := nodes.List(ctx, db, nodes.Filter{TenantID: "acme", Condition: bad}, "", 100)
		wantFault(t, err, fault.InvalidInput, "condition", "")
	}
}
