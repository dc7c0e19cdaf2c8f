-- Acceptance checks: the command kinds a node joining the pool must pass
-- before it is adopted (today "diag.nvml"). The inventory controller queues
-- them once a joining node's inventory is in; a node that fails one stays
-- out of service (state failed) with the reason in its AcceptancePassed
-- condition.

-- +goose Up
ALTER TABLE pools ADD COLUMN acceptance text[] NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE pools DROP COLUMN acceptance;
