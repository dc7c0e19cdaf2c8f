package tunnels

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// The allowlists (migration 00045): a pool's default rules and a node's own
// narrowing, stored as the proto3 JSON of an agentv1.TunnelSettings whose
// allow holds the rules. The caller validates them (proto/tunnelspec).

// Module is the nodespec contributor's name.
const Module = "tunnels"

// RulesJSON is the stored form of rules.
func RulesJSON(rules []*agentv1.TunnelRule) ([]byte, error) {
	return protojson.Marshal(&agentv1.TunnelSettings{Allow: rules})
}

func parseRules(b []byte) ([]*agentv1.TunnelRule, error) {
	var s agentv1.TunnelSettings
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, &s); err != nil {
		return nil, err
	}
	return s.GetAllow(), nil
}

// SetPoolRules sets pool's default rules; none removes them (the pool's
// nodes then allow nothing). The caller invalidates the pool's nodes'
// desired state in the same transaction (nodespec.InvalidatePool).
func SetPoolRules(ctx context.Context, q Querier, poolID string, rules []*agentv1.TunnelRule) error {
	return setRules(ctx, q, "pool_tunnel_rules", "pool_id", poolID, rules)
}

// SetNodeRules sets node's own narrowing; none removes it (the pool's
// rules then apply alone). The caller invalidates the node's desired state
// (nodespec.Invalidate).
func SetNodeRules(ctx context.Context, q Querier, nodeID string, rules []*agentv1.TunnelRule) error {
	return setRules(ctx, q, "node_tunnel_rules", "node_id", nodeID, rules)
}

func setRules(ctx context.Context, q Querier, table, key, id string, rules []*agentv1.TunnelRule) error {
	if len(rules) == 0 {
		_, err := q.Exec(ctx, `DELETE FROM `+table+` WHERE `+key+` = $1`, id)
		return err
	}
	b, err := RulesJSON(rules)
	if err != nil {
		return err
	}
	_, err = q.Exec(ctx, `INSERT INTO `+table+` (`+key+`, rules) VALUES ($1, $2)
		ON CONFLICT (`+key+`) DO UPDATE SET rules = excluded.rules, updated_at = now()`, id, b)
	return err
}

// PoolRules returns pool's default rules (none when unset).
func PoolRules(ctx context.Context, q Querier, poolID string) ([]*agentv1.TunnelRule, error) {
	return getRules(ctx, q, "pool_tunnel_rules", "pool_id", poolID)
}

// NodeRules returns node's own narrowing (none when unset).
func NodeRules(ctx context.Context, q Querier, nodeID string) ([]*agentv1.TunnelRule, error) {
	return getRules(ctx, q, "node_tunnel_rules", "node_id", nodeID)
}

func getRules(ctx context.Context, q Querier, table, key, id string) ([]*agentv1.TunnelRule, error) {
	var b []byte
	err := q.QueryRow(ctx, `SELECT rules FROM `+table+` WHERE `+key+` = $1`, id).Scan(&b)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return parseRules(b)
}

// Register adds the tunnels contributor to reg: each node's tunnels
// section, allow from its pool's rules and narrow from its own, read for
// the whole batch in one statement. A node whose pool has no rules gets no
// section (nothing is allowed).
func Register(reg *nodespec.Registry) error {
	return reg.RegisterBatch(Module, contribute)
}

func contribute(ctx context.Context, q reconcile.Querier, nodes []nodespec.Node) ([]*agentv1.NodeSpec, error) {
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		ids[i] = n.ID
	}
	rows, err := q.Query(ctx, `
		SELECT n.id, p.rules, nr.rules
		FROM unnest($1::text[]) AS n(id)
		JOIN nodes nd ON nd.id = n.id
		JOIN pool_tunnel_rules p ON p.pool_id = nd.pool_id
		LEFT JOIN node_tunnel_rules nr ON nr.node_id = n.id`, ids)
	if err != nil {
		return nil, fmt.Errorf("read tunnel rules: %w", err)
	}
	type row struct {
		ID         string
		Pool, Node []byte
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		return nil, fmt.Errorf("read tunnel rules: %w", err)
	}
	byNode := map[string]*agentv1.TunnelSettings{}
	for _, r := range got {
		allow, err := parseRules(r.Pool)
		if err != nil {
			return nil, fmt.Errorf("node %s: pool tunnel rules: %w", r.ID, err)
		}
		s := &agentv1.TunnelSettings{Allow: allow}
		if r.Node != nil {
			if s.Narrow, err = parseRules(r.Node); err != nil {
				return nil, fmt.Errorf("node %s: tunnel rules: %w", r.ID, err)
			}
		}
		if len(s.GetAllow()) > 0 {
			byNode[r.ID] = s
		}
	}
	out := make([]*agentv1.NodeSpec, len(nodes))
	for i, n := range nodes {
		if s, ok := byNode[n.ID]; ok {
			out[i] = &agentv1.NodeSpec{Tunnels: s}
		}
	}
	return out, nil
}
