package nodes_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// seenAgo moves node id's last heartbeat d into the past (a test stands in
// for the clock).
func seenAgo(t *testing.T, db *pgxpool.Pool, id string, d time.Duration) {
	t.Helper()
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET last_seen_at = now() - $2::interval WHERE id = $1`, id, d); err != nil {
		t.Fatal(err)
	}
}

func TestUpdateReadiness(t *testing.T) {
	db := setup(t, "node_1", "node_2", "node_3", "node_4")
	r := nodes.Readiness{NotReadyAfter: 40 * time.Second, LostAfter: 2 * time.Minute}
	update := func() map[string]nodes.ReadyChange {
		t.Helper()
		cs, err := nodes.UpdateReadiness(t.Context(), db, r)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]nodes.ReadyChange{}
		for _, c := range cs {
			m[c.NodeID] = c
		}
		return m
	}
	if got := update(); len(got) != 0 {
		t.Fatalf("fresh nodes changed: %+v", got)
	}
	if n := lookup(t, db, "node_1"); n.Ready != nodes.ReadyTrue || !n.ReadyCondition().Status {
		t.Fatalf("fresh node: %+v", n.ReadyCondition())
	}

	seenAgo(t, db, "node_1", 41*time.Second)
	seenAgo(t, db, "node_2", 3*time.Minute)
	seenAgo(t, db, "node_3", 39*time.Second)
	got := update()
	if len(got) != 2 || got["node_1"].From != nodes.ReadyTrue || got["node_1"].To != nodes.ReadyUnknown ||
		got["node_2"].To != nodes.ReadyLost || got["node_1"].TenantID != "acme" || got["node_1"].PoolID != "pool_a" ||
		got["node_1"].LastSeenAt == nil || got["node_2"].Reason == "" {
		t.Fatalf("changes: %+v", got)
	}
	n := lookup(t, db, "node_1")
	if c := n.ReadyCondition(); c.Status || c.Reason == "" || c.Since.IsZero() || n.Ready != nodes.ReadyUnknown {
		t.Fatalf("node_1 Ready: %+v", c)
	}
	if got := update(); len(got) != 0 {
		t.Fatalf("second pass changed: %+v", got)
	}

	// The inventory controller's conditions and Ready do not overwrite
	// each other.
	if err := nodes.SetState(t.Context(), db, "node_1", "adopted", []nodes.Condition{{Type: "GPUsHealthy", Status: true, Since: time.Now()}}); err != nil {
		t.Fatal(err)
	}
	if n := lookup(t, db, "node_1"); n.Ready != nodes.ReadyUnknown || len(n.Conditions) != 1 {
		t.Fatalf("after SetState: %+v %+v", n.Ready, n.Conditions)
	}

	// Unknown goes on to Lost; a heartbeat brings both back.
	seenAgo(t, db, "node_1", 3*time.Minute)
	if got := update(); len(got) != 1 || got["node_1"].From != nodes.ReadyUnknown || got["node_1"].To != nodes.ReadyLost {
		t.Fatalf("to lost: %+v", got)
	}
	if _, err := nodes.WriteLiveness(t.Context(), db, []nodes.Liveness{{NodeID: "node_1", Epoch: 1, Seen: true}, {NodeID: "node_2", Epoch: 1, Seen: true}}); err != nil {
		t.Fatal(err)
	}
	got = update()
	if len(got) != 2 || got["node_1"].To != nodes.ReadyTrue || got["node_2"].From != nodes.ReadyLost || got["node_2"].Reason != "" {
		t.Fatalf("back: %+v", got)
	}
	if n := lookup(t, db, "node_2"); !n.ReadyCondition().Status || n.ReadyReason != "" {
		t.Fatalf("node_2 after heartbeat: %+v", n.ReadyCondition())
	}

	// Retired nodes are left alone; Limit bounds a call.
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET state = 'retired' WHERE id = 'node_4'`); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"node_1", "node_2", "node_3", "node_4"} {
		seenAgo(t, db, id, time.Hour)
	}
	r.Limit = 2
	if got := update(); len(got) != 2 || got["node_1"].To != nodes.ReadyLost || got["node_2"].To != nodes.ReadyLost {
		t.Fatalf("limited: %+v", got)
	}
	if got := update(); len(got) != 1 || got["node_3"].To != nodes.ReadyLost {
		t.Fatalf("rest: %+v", got)
	}
	if got := update(); len(got) != 0 {
		t.Fatalf("retired changed: %+v", got)
	}
}
