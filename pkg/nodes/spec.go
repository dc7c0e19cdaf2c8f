package nodes

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// SpecState is what the nodespec controller reads of a node to recompute
// its desired state.
type SpecState struct {
	ID, TenantID, PoolID, State string
	Labels                      map[string]string
	// Spec is the stored desired state (proto3 JSON), "{}" before the first.
	Spec       []byte
	Generation int64
	// SpecError is the stored conflict, "" when none.
	SpecError string
}

// LockForSpec reads the nodes ids that exist, locked in id order (so two
// batches over overlapping nodes never deadlock) until q's transaction
// ends, in one statement. The lock is FOR NO KEY UPDATE: it keeps other
// writers of the nodes out but not the inserts of rows that reference them
// (devices, commands), whose foreign keys take KEY SHARE.
func LockForSpec(ctx context.Context, q Querier, ids []string) ([]SpecState, error) {
	rows, err := q.Query(ctx, `SELECT id, tenant_id, pool_id, state, labels, spec::text, generation, coalesce(spec_error, '')
		FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE`, ids)
	if err != nil {
		return nil, fmt.Errorf("lock nodes for their desired state: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[SpecState])
	if err != nil {
		return nil, fmt.Errorf("lock nodes for their desired state: %w", err)
	}
	return out, nil
}

// SpecWrite is a node's new desired state: the canonical proto3 JSON of
// bettercompute.agent.v1.NodeSpec.
type SpecWrite struct {
	ID   string
	Spec []byte
}

// StoredSpec is what [StoreSpecs] did to one node.
type StoredSpec struct {
	ID         string
	Generation int64
	TenantID   string
	// GatewayID is the gateway that holds (or last held) the node's
	// session; "" when none ever did.
	GatewayID string
}

// StoreSpecs stores each write as its node's desired state, clears the
// node's spec error and bumps its generation by one, in one statement, and
// returns the nodes it wrote (a node that is gone is left out), in id
// order. The generation only ever goes up: the caller (the nodespec
// controller, holding the nodes locked by [LockForSpec]) stores only specs
// whose canonical JSON changed.
func StoreSpecs(ctx context.Context, q Querier, writes []SpecWrite) ([]StoredSpec, error) {
	if len(writes) == 0 {
		return nil, nil
	}
	ids := make([]string, len(writes))
	specs := make([]string, len(writes))
	for i, w := range writes {
		ids[i], specs[i] = w.ID, string(w.Spec)
	}
	rows, err := q.Query(ctx, `
		WITH u AS (
			UPDATE nodes n SET spec = s.spec::jsonb, generation = n.generation + 1, spec_error = NULL, updated_at = now()
			  FROM unnest($1::text[], $2::text[]) AS s(id, spec) WHERE n.id = s.id
			RETURNING n.id, n.generation, n.tenant_id, n.gateway_id)
		SELECT * FROM u ORDER BY id`, ids, specs)
	if err != nil {
		return nil, fmt.Errorf("store desired state of %d nodes: %w", len(writes), err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[StoredSpec])
	if err != nil {
		return nil, fmt.Errorf("store desired state of %d nodes: %w", len(writes), err)
	}
	return out, nil
}

// IDsPastAdoptionInShards returns the id of every node of shards that is
// past adopting (has desired state): the nodespec controller's resync keys.
func IDsPastAdoptionInShards(ctx context.Context, q Querier, shards []int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM nodes WHERE shard = ANY($1) AND state <> 'adopting'`, shards)
	if err != nil {
		return nil, fmt.Errorf("nodes past adoption in shards: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("nodes past adoption in shards: %w", err)
	}
	return ids, nil
}
