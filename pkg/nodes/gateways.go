package nodes

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Gateways returns the gateway holding the session of each of ids that has
// one (nodes.gateway_id): where a node's command wake goes.
func Gateways(ctx context.Context, q Querier, ids []string) (map[string]string, error) {
	rows, err := q.Query(ctx, `SELECT id, gateway_id FROM nodes WHERE id = ANY($1) AND gateway_id <> ''`, ids)
	if err != nil {
		return nil, fmt.Errorf("read gateways of nodes: %w", err)
	}
	out := map[string]string{}
	var id, gw string
	_, err = pgx.ForEachRow(rows, []any{&id, &gw}, func() error {
		out[id] = gw
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read gateways of nodes: %w", err)
	}
	return out, nil
}
