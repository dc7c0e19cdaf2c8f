-- Rollout gates (issue 29 item 1): commands a released node must pass
-- before it counts healthy. rollouts.gates holds them
-- ([{"command": "diag.nvml", "level": "quick", "timeoutMs": n}]);
-- rollout_nodes.gate_commands the ids of the commands the job queued for
-- the node (one per gate, queued once it reported the new content), whose
-- states judge it.
--
-- A rollout's change may now also name "mig" (the pool's MIG layouts,
-- {"mig": {"layouts": [...]}} in change and previous), and a rollout with
-- a selector keeps its change as its planned nodes' layer after it
-- succeeded (docs/rollouts.md): no column needed for either.

-- +goose Up
ALTER TABLE rollouts ADD COLUMN gates jsonb NOT NULL DEFAULT '[]';
ALTER TABLE rollout_nodes ADD COLUMN gate_commands text[] NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE rollout_nodes DROP COLUMN gate_commands;
ALTER TABLE rollouts DROP COLUMN gates;
