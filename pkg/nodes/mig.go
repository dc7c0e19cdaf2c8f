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
