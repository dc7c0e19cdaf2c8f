-- The node lifecycle (issue 14, DESIGN §12): drain and retire, the latched
-- NeedsRepair condition, GPU quarantine, the remediation ladder and the
-- eviction brakes.
--
-- Drain: nodes.drain sets state 'draining' with a deadline; the drain job
-- (services/lifecycle) moves it to 'drained' at the deadline or as soon as
-- it has no active booking, or to 'retired' when the drain was a retire.
-- drain_by says who drained it ('operator' through the API, 'remediation'
-- for the remediation ladder's reboot step), so the ladder undrains only
-- the nodes it drained itself.
--
-- NeedsRepair latches (needs_repair) until nodes.clearRepair: the
-- remediation ladder gave up, or the node spent its remediation budget.
--
-- A quarantined GPU (devices.quarantined_at) is out of service until the
-- health job sees it healthy again: placement never books it.
--
-- remediations is the ladder's journal, one row per step (gpu.reset,
-- node.reboot, needs_repair), so its brakes count from the database: steps
-- per node in the last 7 days, running steps per pool. Finished rows are
-- pruned after 30 days (the budget's window is 7).
--
-- brakes holds the eviction brakes' state: the fleet-wide token bucket
-- (scope 'rate') and one circuit-breaker row per pool ('pool:<id>') and per
-- gateway ('gateway:<id>') that is paused, or was, so that each
-- fleet.eviction_paused and fleet.eviction_resumed event is written once.
--
-- None of the nodes columns is indexed but drain_deadline (partial, on the
-- few draining nodes): the gateways' liveness writes stay HOT (00013).

-- +goose Up
ALTER TABLE nodes
    ADD COLUMN drain_deadline      timestamptz,
    ADD COLUMN drain_reason        text        NOT NULL DEFAULT '',
    ADD COLUMN drain_by            text        NOT NULL DEFAULT '' CHECK (drain_by IN ('', 'operator', 'remediation')),
    ADD COLUMN drain_started_at    timestamptz,
    ADD COLUMN retiring            boolean     NOT NULL DEFAULT false,
    ADD COLUMN retired_at          timestamptz,
    ADD COLUMN needs_repair        boolean     NOT NULL DEFAULT false,
    ADD COLUMN needs_repair_reason text        NOT NULL DEFAULT '',
    ADD COLUMN needs_repair_since  timestamptz;
CREATE INDEX nodes_draining ON nodes (drain_deadline) WHERE state = 'draining';

ALTER TABLE devices
    ADD COLUMN quarantined_at    timestamptz,
    ADD COLUMN quarantine_reason text NOT NULL DEFAULT '';

CREATE TABLE remediations (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    node_id     text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    pool_id     text NOT NULL,
    step        text NOT NULL CHECK (step IN ('gpu.reset', 'node.reboot', 'needs_repair')),
    state       text NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'succeeded', 'failed')),
    -- The step's command (gpu.reset, node.reboot); '' for needs_repair.
    command_id  text NOT NULL DEFAULT '',
    -- The GPUs the step is for (UUIDs).
    devices     text[] NOT NULL DEFAULT '{}',
    reason      text NOT NULL DEFAULT '',
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
CREATE INDEX remediations_node ON remediations (node_id, started_at);
CREATE INDEX remediations_running ON remediations (pool_id) WHERE state = 'running';
CREATE INDEX remediations_finished ON remediations (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE brakes (
    scope       text PRIMARY KEY,
    -- The token bucket (scope 'rate'): tokens left at refilled_at.
    tokens      double precision NOT NULL DEFAULT 0,
    refilled_at timestamptz NOT NULL DEFAULT now(),
    -- A circuit breaker: whether it is open (actions paused), how many of
    -- the scope's nodes were not ready of how many when last evaluated, why
    -- and since when.
    paused      boolean NOT NULL DEFAULT false,
    not_ready   integer NOT NULL DEFAULT 0,
    total       integer NOT NULL DEFAULT 0,
    reason      text NOT NULL DEFAULT '',
    since       timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE brakes;
DROP TABLE remediations;
ALTER TABLE devices DROP COLUMN quarantined_at, DROP COLUMN quarantine_reason;
DROP INDEX nodes_draining;
ALTER TABLE nodes
    DROP COLUMN drain_deadline, DROP COLUMN drain_reason, DROP COLUMN drain_by, DROP COLUMN drain_started_at,
    DROP COLUMN retiring, DROP COLUMN retired_at,
    DROP COLUMN needs_repair, DROP COLUMN needs_repair_reason, DROP COLUMN needs_repair_since;
