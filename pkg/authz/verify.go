package authz

import (
	"context"
	"fmt"
	"time"
)

// ProjectionReport is what one re-verification of the authorization
// projection found and did.
type ProjectionReport struct {
	// StaleDrafts are draft rows older than the cut-off: admissions that
	// never finished. Deleted.
	StaleDrafts int
	// Repaired are live Node and Pool rows whose tenant, pool or labels
	// differed from the nodes and pools tables. Rewritten from them.
	Repaired map[string]int
	// Missing are nodes and pools with no live row (reported, not added:
	// a row is written by the transaction that makes the resource live).
	Missing map[string]int
	// Orphans are live Node and Pool rows whose resource is gone
	// (reported: such a row lets no action through, since every handler
	// reads the resource itself).
	Orphans map[string]int
}

// Total is every discrepancy found.
func (r ProjectionReport) Total() int {
	n := r.StaleDrafts
	for _, m := range []map[string]int{r.Repaired, r.Missing, r.Orphans} {
		for _, v := range m {
			n += v
		}
	}
	return n
}

// VerifyProjection re-verifies the projection against its sources: it
// deletes drafts last written before draftsBefore, rewrites live Node rows
// from nodes and Pool rows from pools where their tenant, pool or labels
// differ (the tables are the truth: a decision must see what the resource
// is), and counts nodes and pools without a live row and live rows without
// their resource. Run under the iam role's singleton lease.
func VerifyProjection(ctx context.Context, q Querier, draftsBefore time.Time) (ProjectionReport, error) {
	rep := ProjectionReport{Repaired: map[string]int{}, Missing: map[string]int{}, Orphans: map[string]int{}}
	tag, err := q.Exec(ctx, `DELETE FROM authz_projection WHERE draft AND updated_at < $1`, draftsBefore)
	if err != nil {
		return rep, fmt.Errorf("verify projection: stale drafts: %w", err)
	}
	rep.StaleDrafts = int(tag.RowsAffected())
	sources := []struct{ typ, table, pool string }{
		{TypeNode, "nodes", "s.pool_id"},
		{TypePool, "pools", "s.id"},
	}
	for _, s := range sources {
		tag, err := q.Exec(ctx, `
			UPDATE authz_projection p SET tenant_id = s.tenant_id, pool_id = `+s.pool+`, labels = s.labels, updated_at = now()
			FROM `+s.table+` s
			WHERE p.type = $1 AND p.id = s.id AND NOT p.draft
			  AND (p.tenant_id, p.pool_id, p.labels) IS DISTINCT FROM (s.tenant_id, `+s.pool+`, s.labels)`, s.typ)
		if err != nil {
			return rep, fmt.Errorf("verify projection: %s rows: %w", s.typ, err)
		}
		rep.Repaired[s.typ] = int(tag.RowsAffected())
		var missing, orphans int
		err = q.QueryRow(ctx, `
			SELECT (SELECT count(*) FROM `+s.table+` s
			         WHERE NOT EXISTS (SELECT 1 FROM authz_projection p WHERE p.type = $1 AND p.id = s.id AND NOT p.draft)),
			       (SELECT count(*) FROM authz_projection p
			         WHERE p.type = $1 AND NOT p.draft AND NOT EXISTS (SELECT 1 FROM `+s.table+` s WHERE s.id = p.id))`,
			s.typ).Scan(&missing, &orphans)
		if err != nil {
			return rep, fmt.Errorf("verify projection: %s counts: %w", s.typ, err)
		}
		rep.Missing[s.typ], rep.Orphans[s.typ] = missing, orphans
	}
	return rep, nil
}
