package nodes

import (
	"context"
	"fmt"
)

// MigInputs is what the capacity.mig contributor reads of one node: its
// GPUs as reported (by index) and its stored desired state.
type MigInputs struct {
	Devices []Device
	// Spec is the stored NodeSpec JSON ("{}" before the first).
	Spec []byte
}

// MigInputsOf reads the devices and stored specs of ids in two
// statements; a node gone is absent.
func MigInputsOf(ctx context.Context, q Querier, ids []string) (map[string]*MigInputs, error) {
	out := map[string]*MigInputs{}
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := q.Query(ctx, `SELECT id, spec::text FROM nodes WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("read specs: %w", err)
	}
	var ns []Node
	for rows.Next() {
		var id, spec string
		if err := rows.Scan(&id, &spec); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read specs: %w", err)
		}
		out[id] = &MigInputs{Spec: []byte(spec)}
		ns = append(ns, Node{ID: id})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read specs: %w", err)
	}
	if err := withDevices(ctx, q, ns); err != nil {
		return nil, err
	}
	for _, n := range ns {
		out[n.ID].Devices = n.Devices
	}
	return out, nil
}

// MigLayoutOf returns the profiles of each GPU (by UUID) that node id's
// stored desired state puts in MIG mode (its mig section).
func MigLayoutOf(ctx context.Context, q Querier, id string) (map[string][]string, error) {
	rows, err := q.Query(ctx, `
		SELECT g->>'gpuUuid', ARRAY(SELECT jsonb_array_elements_text(coalesce(g->'profiles', '[]')))
		  FROM nodes, jsonb_array_elements(coalesce(spec->'mig'->'gpus', '[]')) g
		 WHERE id = $1 AND coalesce((g->>'migEnabled')::boolean, false)`, id)
	if err != nil {
		return nil, fmt.Errorf("read mig layout of %s: %w", id, err)
	}
	defer rows.Close()
	out := map[string][]string{}
	for rows.Next() {
		var gpu string
		var profiles []string
		if err := rows.Scan(&gpu, &profiles); err != nil {
			return nil, fmt.Errorf("read mig layout of %s: %w", id, err)
		}
		out[gpu] = profiles
	}
	return out, rows.Err()
}
