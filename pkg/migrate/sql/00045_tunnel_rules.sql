-- The tunnels allowlists (issue 30, docs/tunnels.md): a pool's default
-- (pools.update mask "tunnels") and a node's own narrowing of it
-- (nodes.update mask "tunnels"), each the proto3 JSON of the rules
-- (agentv1.TunnelRule, at most 64, checked by proto/tunnelspec). The
-- "tunnels" nodespec contributor (pkg/tunnels) puts them in each node's
-- NodeSpec tunnels section: allow from the pool, narrow from the node. A
-- row goes with its pool or node.

-- +goose Up
CREATE TABLE pool_tunnel_rules (
    pool_id    text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    rules      jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE node_tunnel_rules (
    node_id    text PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    rules      jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE node_tunnel_rules;
DROP TABLE pool_tunnel_rules;
