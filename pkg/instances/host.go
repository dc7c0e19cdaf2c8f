package instances

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// HostReport is what a host reported about one instance in an Observed
// report (SectionStatus.instances).
type HostReport struct {
	ID string
	Observation
}

// HostObservation is one host's report of its instances.
type HostObservation struct {
	NodeID  string
	Reports []HostReport
	// Complete: the host's instances section converged, so Reports lists
	// every instance its runtime has for the spec; a deleting instance
	// placed on it and not reported is gone (absent).
	Complete bool
}

// Change is one instance whose state an observation moved.
type Change struct {
	ID, TenantID, NodeID string
	From, To             string
}

// ObserveHosts records hosts' reports of their instances in q (the
// transaction that stores their Observed reports), as [Observe] does for
// each: only instances placed on the reporting host are touched (a host
// cannot speak for another's), an instance it does not report moves only
// when deleting and the report is Complete. It reads every reporting
// host's instances in one statement, locked in id order, and returns the
// changes.
func ObserveHosts(ctx context.Context, q Querier, obs []HostObservation) ([]Change, error) {
	if len(obs) == 0 {
		return nil, nil
	}
	nodes := make([]string, 0, len(obs))
	for _, o := range obs {
		nodes = append(nodes, o.NodeID)
	}
	// Every live or deleting instance of the reporting hosts, locked in id
	// order (as Lock and Observe lock one), so two batches never wait on
	// each other in a cycle.
	rows, err := q.Query(ctx, `SELECT id, tenant_id, node_id, state FROM instances
		WHERE node_id = ANY($1) AND state <> 'deleted' ORDER BY id FOR UPDATE`, nodes)
	if err != nil {
		return nil, fmt.Errorf("instances of reporting hosts: %w", err)
	}
	type row struct{ id, tenant, node, state string }
	have, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.id, &x.tenant, &x.node, &x.state)
	})
	if err != nil {
		return nil, fmt.Errorf("instances of reporting hosts: %w", err)
	}
	if len(have) == 0 {
		return nil, nil
	}
	byNode := make(map[string]HostObservation, len(obs))
	for _, o := range obs {
		byNode[o.NodeID] = o
	}
	var out []Change
	for _, in := range have {
		o := byNode[in.node]
		var rep *HostReport
		for i := range o.Reports {
			if o.Reports[i].ID == in.id {
				rep = &o.Reports[i]
				break
			}
		}
		var ob Observation
		switch {
		case rep != nil:
			ob = rep.Observation
		case o.Complete && in.state == StateDeleting:
			ob = Observation{State: "absent"}
		default:
			continue
		}
		state, changed, err := Observe(ctx, q, in.id, ob)
		if err != nil {
			return nil, err
		}
		if changed {
			out = append(out, Change{ID: in.id, TenantID: in.tenant, NodeID: in.node, From: in.state, To: state})
		}
	}
	return out, nil
}

// Hosting returns which of nodes host a live instance (not deleting or
// deleted): the hosts whose NodeSpec has an instances section.
func Hosting(ctx context.Context, q Querier, nodes []string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT node_id FROM instances
		WHERE node_id = ANY($1) AND state NOT IN ('deleting', 'deleted')`, nodes)
	if err != nil {
		return nil, fmt.Errorf("hosts of instances: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("hosts of instances: %w", err)
	}
	return out, nil
}
