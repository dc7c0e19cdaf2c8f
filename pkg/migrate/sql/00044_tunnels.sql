-- Tunnels (issue 30, docs/tunnels.md): one row per port forward a caller
-- opened to a node's target through its gateway.
--
-- tunnels.open inserts the row with the SHA-256 of a connect token
-- (bctt_<id>.<secret>, valid token_not_after, spent by the first connect:
-- connected_at). The API process relaying the caller's connection
-- (relay_process) adds bytes_in (caller to target) and bytes_out (target to
-- caller) as they flow and closes the row with closed_at and close_reason
-- on expiry (not_after), tunnels.close, the opener's key or identity
-- revoked, the node retired, the node's session ending or either side
-- closing. Open rows are counted per node and per tenant for the limits.
-- Closed rows are deleted tunnels.Retention after they closed (the relay's
-- prune).

-- +goose Up
CREATE TABLE tunnels (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants (id),
    node_id         text NOT NULL,
    target          text NOT NULL,
    reason          text NOT NULL DEFAULT '',
    opened_by       text NOT NULL,
    opened_by_key   text NOT NULL DEFAULT '',
    token_hash      bytea NOT NULL,
    token_not_after timestamptz NOT NULL,
    not_after       timestamptz NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    connected_at    timestamptz,
    relay_process   text NOT NULL DEFAULT '',
    closed_at       timestamptz,
    close_reason    text NOT NULL DEFAULT '',
    bytes_in        bigint NOT NULL DEFAULT 0,
    bytes_out       bigint NOT NULL DEFAULT 0
);
CREATE INDEX tunnels_live_tenant ON tunnels (tenant_id, id) WHERE closed_at IS NULL;
CREATE INDEX tunnels_live_node ON tunnels (node_id) WHERE closed_at IS NULL;
CREATE INDEX tunnels_closed ON tunnels (closed_at) WHERE closed_at IS NOT NULL;
CREATE INDEX tunnels_unused ON tunnels (token_not_after) WHERE closed_at IS NULL AND connected_at IS NULL;

-- +goose Down
DROP TABLE tunnels;
