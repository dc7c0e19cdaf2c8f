package outbox_test

import (
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestWriteManyKeepsOrderAndFields(t *testing.T) {
	db := pgtest.New(t)
	es := []outbox.Event{
		{TenantID: "root", Type: "node.converged", Resource: "node_b", Payload: map[string]any{"nodeId": "node_b", "generation": 2}},
		{TenantID: "root", Type: "node.spec.changed", Resource: "node_a"},
		{TenantID: "root", Type: "node.converged", Resource: "node_c", Payload: map[string]any{"nodeId": "node_c"}},
	}
	if err := outbox.WriteMany(t.Context(), db, es); err != nil {
		t.Fatal(err)
	}
	rows, err := db.Query(t.Context(), `SELECT tenant_id, type, subject, resource_id, payload::text FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var i int
	for rows.Next() {
		var tenant, typ, subject, resource, payload string
		if err := rows.Scan(&tenant, &typ, &subject, &resource, &payload); err != nil {
			t.Fatal(err)
		}
		want := es[i]
		if tenant != want.TenantID || typ != want.Type || resource != want.Resource || subject != wake.EventSubject(want.TenantID, want.Type) {
			t.Errorf("row %d = %s %s %s %s, want %+v", i, tenant, typ, subject, resource, want)
		}
		if want.Payload == nil && payload != "{}" {
			t.Errorf("row %d payload = %s, want {}", i, payload)
		}
		if i == 0 && !strings.Contains(payload, `"generation": 2`) {
			t.Errorf("row 0 payload = %s", payload)
		}
		i++
	}
	if i != len(es) {
		t.Fatalf("%d rows, want %d", i, len(es))
	}
}

func TestWriteManyRefusesAnUncataloguedTypeAndWritesNone(t *testing.T) {
	db := pgtest.New(t)
	err := outbox.WriteMany(t.Context(), db, []outbox.Event{
		{TenantID: "root", Type: "node.converged"},
		{TenantID: "root", Type: "node.exploded"},
	})
	if err == nil || !strings.Contains(err.Error(), "node.exploded") {
		t.Fatalf("err = %v, want the uncatalogued type named", err)
	}
	var n int
	if err := db.QueryRow(t.Context(), `SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows (%v), want none", n, err)
	}
}
