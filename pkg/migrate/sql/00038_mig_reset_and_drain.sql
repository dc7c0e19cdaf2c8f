-- MIG, the control plane acting on the node's side (issue 28).
--
-- mig_pool_settings holds a pool's MIG settings other than its layouts
-- (pools.update, mask "mig"): reset_policy is what the health job sends
-- when a GPU of the pool reports reset-required in its node's mig section:
-- 'gpu-reset' (the braked gpu.reset of that GPU, the default) or
-- 'node-reboot' (the node drained, then node.reboot). No row means the
-- defaults.
--
-- remediations.cause says why a ladder ran: 'quarantine' (quarantined
-- GPUs, the ladder of migration 00019) or 'mig' (a MIG mode change that
-- waits for a reset: one step, gpu.reset or node.reboot, no escalation).
-- Both count against the node's budget and the pool's concurrency.
--
-- mig_layouts_draining.devices lists the booked devices (whole GPU, or
-- the MIG slices) that the GPU's waiting layout change removes: under
-- capacity.lostNode replace or fail the placer moves or fails exactly
-- those bookings, then the change proceeds.

-- +goose Up
CREATE TABLE mig_pool_settings (
    pool_id      text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    reset_policy text NOT NULL DEFAULT 'gpu-reset' CHECK (reset_policy IN ('gpu-reset', 'node-reboot'))
);

ALTER TABLE remediations ADD COLUMN cause text NOT NULL DEFAULT 'quarantine' CHECK (cause IN ('quarantine', 'mig'));

ALTER TABLE mig_layouts_draining ADD COLUMN devices text[] NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE mig_layouts_draining DROP COLUMN devices;
ALTER TABLE remediations DROP COLUMN cause;
DROP TABLE mig_pool_settings;
