-- Commands: one-shot actions with a deadline, queued for one node and
-- delivered over its session by the gateway holding it (found by a join on
-- nodes.gateway_id at dispatch time; routing never goes in the payload).
--
-- seq is the node's command sequence (nodes.next_cmd_seq), the daemon's
-- journal key. payload is the serialized bettercompute.agent.v1.CommandBody,
-- result the serialized CommandResult. idempotency_key is unique per node: a
-- repeat returns the existing command. States: pending → in_flight →
-- succeeded | failed, pending → expired | cancelled (and in_flight →
-- pending again on a BUSY rejection or a lost journal of a retry-safe kind).
-- owner_kind/owner_key name the work-queue key woken on a final state.

-- +goose Up
CREATE TABLE commands (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL REFERENCES tenants (id),
    node_id             text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    seq                 bigint NOT NULL,
    kind                text NOT NULL,
    payload             bytea NOT NULL,
    idempotency_key     text NOT NULL,
    not_after           timestamptz NOT NULL,
    min_generation      bigint NOT NULL DEFAULT 0,
    state               text NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'in_flight', 'succeeded', 'failed', 'expired', 'cancelled')),
    reason              text NOT NULL DEFAULT '',
    attempts            integer NOT NULL DEFAULT 0,
    -- BUSY rejections so far: the back-off doubles with each.
    busy_count          integer NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    result              bytea,
    cancel_requested_at timestamptz,
    owner_kind          text NOT NULL DEFAULT '',
    owner_key           text NOT NULL DEFAULT '',
    -- Who asked (an identity id for commands.run; '' for modules).
    created_by          text NOT NULL DEFAULT '',
    dispatched_at       timestamptz,
    accepted_at         timestamptz,
    finished_at         timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (node_id, seq),
    UNIQUE (node_id, idempotency_key)
);
-- Dispatch: a node's due pending commands, and its in-flight ones.
CREATE INDEX commands_dispatch ON commands (node_id, state, next_attempt_at);
-- The sweeper: live commands by deadline.
CREATE INDEX commands_sweep ON commands (state, not_after) WHERE state IN ('pending', 'in_flight');
-- commands.list: a node's commands, newest first.
CREATE INDEX commands_node_created ON commands (node_id, created_at DESC, id DESC);

-- +goose Down
DROP TABLE commands;
