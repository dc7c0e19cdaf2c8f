-- Rollouts (issue 29 item 1): a change of a pool's settings rolled out to
-- its nodes in batches by the rollout job (services/lifecycle, pool shards).
--
-- rollouts.change holds the patch: {"mask": [...], "site": {...},
-- "health": {...}, "runtime": {...}} (proto3 JSON sections, validated as
-- pools.update validates them); previous holds the pool's sections the mask
-- names as they were when the rollout was made, for a rollback after
-- success. One active (pending, progressing, paused) rollout per pool: the
-- partial unique index.
--
-- rollout_nodes is the plan, written when the job starts the rollout: each
-- node's batch, and its state in it — waiting (its batch not released),
-- updating (released: it has the new content), healthy, failed (turned
-- unhealthy after its change; acked once a resume acknowledged it) or
-- skipped (unhealthy when its batch came: it keeps the old content). While
-- the rollout is progressing or paused, the nodespec controller's pool part
-- gives a released node the rollout's sections instead of the pool's.

-- +goose Up
CREATE TABLE rollouts (
    id                text PRIMARY KEY,
    tenant_id         text NOT NULL REFERENCES tenants (id),
    pool_id           text NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    state             text NOT NULL DEFAULT 'pending'
                      CHECK (state IN ('pending', 'progressing', 'paused', 'succeeded', 'failed', 'cancelled', 'rolled-back')),
    selector          jsonb NOT NULL DEFAULT '{}',
    change            jsonb NOT NULL,
    previous          jsonb NOT NULL DEFAULT '{}',
    -- {"batches": [{"percent": n} | {"count": n}], "bakeMs": n, "maxUnavailable": n}
    strategy          jsonb NOT NULL,
    success_percent   integer NOT NULL DEFAULT 0,
    success_count     integer NOT NULL DEFAULT 0,
    failure_percent   integer NOT NULL DEFAULT 0,
    failure_count     integer NOT NULL DEFAULT 1,
    current_batch     integer NOT NULL DEFAULT -1,
    batch_released_at timestamptz,
    -- When every released node of the current batch was first seen healthy.
    batch_converged_at timestamptz,
    message           text NOT NULL DEFAULT '',
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX rollouts_active ON rollouts (pool_id) WHERE state IN ('pending', 'progressing', 'paused');
CREATE INDEX rollouts_tenant ON rollouts (tenant_id, id);

CREATE TABLE rollout_nodes (
    rollout_id  text NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE,
    node_id     text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    batch       integer NOT NULL,
    state       text NOT NULL DEFAULT 'waiting'
                CHECK (state IN ('waiting', 'updating', 'healthy', 'failed', 'skipped')),
    acked       boolean NOT NULL DEFAULT false,
    -- The node's generation when its batch was released: it has the new
    -- content once its observed generation passes this.
    released_generation bigint NOT NULL DEFAULT 0,
    released_at timestamptz,
    reason      text NOT NULL DEFAULT '',
    PRIMARY KEY (rollout_id, node_id)
);
CREATE INDEX rollout_nodes_node ON rollout_nodes (node_id);

-- +goose Down
DROP TABLE rollout_nodes;
DROP TABLE rollouts;
