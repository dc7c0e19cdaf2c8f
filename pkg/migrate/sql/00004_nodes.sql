-- Nodes and how they join: join tokens, nodes, their devices, and the node
-- certificates the node CA issued (for revocation).
--
-- A join token is bcjt_<id>.<secret>; only SHA-256 of the secret is kept.
-- Redeeming it is one conditional UPDATE (uses_left > 0, not revoked, not
-- expired), so concurrent joins can never spend more uses than it has.

-- +goose Up
CREATE TABLE join_tokens (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    pool_id     text NOT NULL REFERENCES pools (id),
    name        text NOT NULL DEFAULT '',
    secret_hash bytea NOT NULL,
    uses        integer NOT NULL CHECK (uses > 0),
    uses_left   integer NOT NULL CHECK (uses_left >= 0 AND uses_left <= uses),
    -- Hardware claims a joining node must present (attest.Expect as JSON).
    expect      jsonb NOT NULL DEFAULT '{}',
    -- Whether a node presenting a known hardware key takes back its old id.
    reclaim     boolean NOT NULL DEFAULT false,
    -- Labels every node that joins with the token starts with.
    labels      jsonb NOT NULL DEFAULT '{}',
    created_by  text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz,
    revoked_at  timestamptz
);
CREATE INDEX join_tokens_tenant ON join_tokens (tenant_id, id);

-- Nodes: one GPU server (or VPS host) joined to a pool. shard is
-- shard.Of(id), fixed at insert. generation is the desired state's (adoption
-- writes 1); observed_generation is the highest the node reported.
CREATE TABLE nodes (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL REFERENCES tenants (id),
    pool_id             text NOT NULL REFERENCES pools (id),
    state               text NOT NULL DEFAULT 'adopting'
                        CHECK (state IN ('adopting', 'adopted', 'draining', 'drained', 'failed', 'retired')),
    shard               smallint NOT NULL CHECK (shard BETWEEN 0 AND 255),
    labels              jsonb NOT NULL DEFAULT '{}',
    hostname            text NOT NULL DEFAULT '',
    -- A hash of the node's stable hardware claims (pkg/attest); one node per
    -- piece of hardware.
    hardware_key        text NOT NULL UNIQUE,
    -- The join token that admitted (or last reclaimed) it.
    join_token_id       text REFERENCES join_tokens (id),
    spec                jsonb NOT NULL DEFAULT '{}',
    generation          bigint NOT NULL DEFAULT 0,
    observed_generation bigint NOT NULL DEFAULT 0,
    next_cmd_seq        bigint NOT NULL DEFAULT 1,
    boot_id             text NOT NULL DEFAULT '',
    journal_id          text NOT NULL DEFAULT '',
    session_epoch       bigint NOT NULL DEFAULT 0,
    -- The gateway holding the node's session; '' when none.
    gateway_id          text NOT NULL DEFAULT '',
    last_seen_at        timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX nodes_tenant ON nodes (tenant_id, id);
CREATE INDEX nodes_pool ON nodes (pool_id, id);
CREATE INDEX nodes_shard ON nodes (shard);
CREATE INDEX nodes_gateway ON nodes (gateway_id) WHERE gateway_id <> '';

-- Devices of a node, derived from its inventory. A device that disappears is
-- marked (missing_since), never silently deleted.
CREATE TABLE devices (
    node_id       text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    id            text NOT NULL, -- the GPU's UUID (GPU-…)
    kind          text NOT NULL DEFAULT 'gpu',
    index         integer NOT NULL DEFAULT 0,
    model         text NOT NULL DEFAULT '',
    serial        text NOT NULL DEFAULT '',
    memory_bytes  bigint NOT NULL DEFAULT 0,
    pci_bus_id    text NOT NULL DEFAULT '',
    mig_enabled   boolean NOT NULL DEFAULT false,
    healthy       boolean NOT NULL DEFAULT true,
    health_reason text NOT NULL DEFAULT '',
    missing_since timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, id)
);

-- Every certificate the node CA issued to a node, by serial (lowercase hex),
-- so the gateway can refuse revoked ones.
CREATE TABLE node_certificates (
    serial     text PRIMARY KEY,
    node_id    text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    not_before timestamptz NOT NULL,
    not_after  timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX node_certificates_node ON node_certificates (node_id);
CREATE INDEX node_certificates_not_after ON node_certificates (not_after);

-- +goose Down
DROP TABLE node_certificates;
DROP TABLE devices;
DROP TABLE nodes;
DROP TABLE join_tokens;
