package nodes

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Census is how many nodes of a pool are in one state with one Ready value.
type Census struct {
	PoolID, State, Ready string
	Nodes                int
}

// CountByState counts the nodes (retired ones included: operators watch
// them leave) by pool, state and Ready: one grouped scan, for the fleet
// gauges read at scrape time.
func CountByState(ctx context.Context, q Querier) ([]Census, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, state, ready, count(*) FROM nodes GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`)
	if err != nil {
		return nil, fmt.Errorf("count nodes by state: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Census, error) {
		var c Census
		err := r.Scan(&c.PoolID, &c.State, &c.Ready, &c.Nodes)
		return c, err
	})
}

// ConditionCensus is how many nodes of a pool have a condition of one type
// with one status.
type ConditionCensus struct {
	PoolID, Type string
	Status       bool
	Nodes        int
}

// CountByCondition counts the not-retired nodes by pool and by the type and
// status of each condition the inventory controller keeps (nodes.conditions;
// Ready has its own column, see [CountByState]).
func CountByCondition(ctx context.Context, q Querier) ([]ConditionCensus, error) {
	rows, err := q.Query(ctx, `
		SELECT n.pool_id, c->>'type', coalesce((c->>'status')::boolean, false), count(*)
		  FROM nodes n, jsonb_array_elements(n.conditions) c
		 WHERE n.state <> 'retired' AND c->>'type' IS NOT NULL
		 GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`)
	if err != nil {
		return nil, fmt.Errorf("count nodes by condition: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (ConditionCensus, error) {
		var c ConditionCensus
		err := r.Scan(&c.PoolID, &c.Type, &c.Status, &c.Nodes)
		return c, err
	})
}
