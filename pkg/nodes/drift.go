package nodes

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The Drifted condition (the fleet.drift job's): a node whose sections
// stay not converged, whose inventory differs from its pool's, or whose
// daemon reports a section drifted. It is stored in nodes.conditions with
// the inventory controller's conditions, which carries it over when it
// rewrites them; nodes.drift_sections is the job's memory of since when
// each section has been seen not converged.

// ConditionDrifted is the fleet.drift job's condition type.
const ConditionDrifted = "Drifted"

// DriftedReasonPrefix starts the reason of a section the daemon reports
// drifted: what it converged had been changed behind its back (a CDI spec
// edited by hand; a MIG layout changed) and it restored it. The section's
// state says nothing of it (a restored section is CONVERGED): this prefix
// is the whole contract, for every section.
const DriftedReasonPrefix = "drifted:"

// Drifted reports whether the daemon says the section drifted (its reason
// starts with [DriftedReasonPrefix]).
func (s SectionStatus) Drifted() bool { return strings.HasPrefix(s.Reason, DriftedReasonPrefix) }

// Section states as daemons report them (agentv1.SectionState's names).
const (
	SectionConverged      = "SECTION_STATE_CONVERGED"
	SectionFailedTerminal = "SECTION_STATE_FAILED_TERMINAL"
)

// Settled reports whether the section is done converging: converged, or
// failed terminally (it will not be retried, and counts as observed).
// Anything else — progressing, failed and retried, a state this code does
// not know — is not.
func (s SectionStatus) Settled() bool {
	return s.State == SectionConverged || s.State == SectionFailedTerminal
}

// driftedJSON matches, with @>, the conditions of a Drifted node.
var driftedJSON = fmt.Sprintf(`[{"type": %q, "status": true}]`, ConditionDrifted)

// DriftFacts is what fleet.drift reads of one node.
type DriftFacts struct {
	ID       string
	TenantID string
	PoolID   string
	State    string
	// Sections are the sections of the node's last report that matter to
	// drift: those not settled, and those reported drifted.
	Sections []SectionStatus
	// Pending is nodes.drift_sections: since when each section has been
	// seen not settled.
	Pending map[string]time.Time
	// Drifted is the node's Drifted condition; nil before the first pass.
	Drifted *Condition
	// GPUs counts the node's GPUs that are still reported (missing ones
	// aside); Models are their models, sorted, each once.
	GPUs   int
	Models []string
	// Reported: the node has an inventory report. DriverVersion and
	// CUDAVersion are its host section's; empty when it has none.
	Reported      bool
	DriverVersion string
	CUDAVersion   string
}

// DriftFactsOfPool reads what fleet.drift needs of every node of pool
// that is not retired (or is, and is still Drifted), in id order, without locking them: the node row,
// its GPUs (the devices table) and its latest inventory report's host
// (node_inventory, which it only reads).
func DriftFactsOfPool(ctx context.Context, q Querier, pool string) ([]DriftFacts, error) {
	rows, err := q.Query(ctx, `
		SELECT n.id, n.tenant_id, n.pool_id, n.state,
		       CASE WHEN jsonb_typeof(n.section_status) = 'array' THEN (
			SELECT coalesce(jsonb_agg(s), '[]') FROM jsonb_array_elements(n.section_status) s
			 WHERE s->>'state' NOT IN ($4, $5) OR starts_with(s->>'reason', $6)) ELSE '[]' END,
		       n.drift_sections,
		       (SELECT c FROM jsonb_array_elements(n.conditions) c WHERE c->>'type' = $2 LIMIT 1),
		       coalesce(d.gpus, 0), coalesce(d.models, '{}'),
		       i.node_id IS NOT NULL, coalesce(i.report->'host'->>'driverVersion', ''), coalesce(i.report->'host'->>'cudaVersion', '')
		  FROM nodes n
		  LEFT JOIN node_inventory i ON i.node_id = n.id
		  LEFT JOIN (
			SELECT d.node_id, count(*) AS gpus, array_agg(DISTINCT d.model ORDER BY d.model) AS models
			  FROM devices d JOIN nodes dn ON dn.id = d.node_id
			 WHERE dn.pool_id = $1 AND d.kind = 'gpu' AND d.missing_since IS NULL
			 GROUP BY d.node_id) d ON d.node_id = n.id
		 WHERE n.pool_id = $1 AND (n.state <> 'retired' OR n.conditions @> $3::jsonb)
		 ORDER BY n.id`, pool, ConditionDrifted, driftedJSON, SectionConverged, SectionFailedTerminal, DriftedReasonPrefix)
	if err != nil {
		return nil, fmt.Errorf("drift facts of pool %s: %w", pool, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DriftFacts, error) {
		var f DriftFacts
		var pending map[string]time.Time
		var drifted []byte
		err := r.Scan(&f.ID, &f.TenantID, &f.PoolID, &f.State, &f.Sections, &pending, &drifted,
			&f.GPUs, &f.Models, &f.Reported, &f.DriverVersion, &f.CUDAVersion)
		if err != nil {
			return f, err
		}
		f.Pending = pending
		if len(drifted) > 0 && string(drifted) != "null" {
			var c Condition
			if err := json.Unmarshal(drifted, &c); err != nil {
				return f, fmt.Errorf("decode Drifted of %s: %w", f.ID, err)
			}
			f.Drifted = &c
		}
		return f, nil
	})
	if err != nil {
		return nil, fmt.Errorf("drift facts of pool %s: %w", pool, err)
	}
	return out, nil
}

// DriftUpdate is fleet.drift's write of one node.
type DriftUpdate struct {
	ID string
	// Drifted replaces the node's Drifted condition.
	Drifted Condition
	// Pending replaces nodes.drift_sections.
	Pending map[string]time.Time
}

// SetDrift writes each node's Drifted condition (replacing the one in
// nodes.conditions, the others left as they are) and drift_sections, in
// one statement that locks the nodes in id order. A node gone since is
// skipped.
func SetDrift(ctx context.Context, q Querier, us []DriftUpdate) error {
	if len(us) == 0 {
		return nil
	}
	ids := make([]string, len(us))
	conds := make([]string, len(us))
	pending := make([]string, len(us))
	for i, u := range us {
		u.Drifted.Type = ConditionDrifted
		c, err := json.Marshal(u.Drifted)
		if err != nil {
			return err
		}
		p := u.Pending
		if p == nil {
			p = map[string]time.Time{}
		}
		b, err := json.Marshal(p)
		if err != nil {
			return err
		}
		ids[i], conds[i], pending[i] = u.ID, string(c), string(b)
	}
	_, err := q.Exec(ctx, `
		WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS u(id, cond, pending)),
		     l AS MATERIALIZED (SELECT n.id FROM nodes n JOIN u ON u.id = n.id ORDER BY n.id FOR NO KEY UPDATE OF n)
		UPDATE nodes n
		   SET conditions = coalesce((SELECT jsonb_agg(c) FROM jsonb_array_elements(n.conditions) c WHERE c->>'type' <> $4), '[]') || jsonb_build_array(u.cond::jsonb),
		       drift_sections = u.pending::jsonb, updated_at = now()
		  FROM u JOIN l ON l.id = u.id
		 WHERE n.id = u.id`, ids, conds, pending, ConditionDrifted)
	if err != nil {
		return fmt.Errorf("set Drifted: %w", err)
	}
	return nil
}

// PoolsWithNodes returns the pools with a node that is not retired, in
// id order: fleet.drift's keys.
func PoolsWithNodes(ctx context.Context, q Querier) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT pool_id FROM nodes WHERE state <> 'retired' ORDER BY pool_id`)
	if err != nil {
		return nil, fmt.Errorf("pools with nodes: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// CountDrifted counts the nodes of pool whose Drifted condition holds.
func CountDrifted(ctx context.Context, q Querier, pool string) (int, error) {
	var n int
	err := q.QueryRow(ctx, `SELECT count(*) FROM nodes WHERE pool_id = $1 AND state <> 'retired' AND conditions @> $2::jsonb`,
		pool, driftedJSON).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count drifted nodes of pool %s: %w", pool, err)
	}
	return n, nil
}
