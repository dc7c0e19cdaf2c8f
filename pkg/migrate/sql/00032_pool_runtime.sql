-- The pool's container runtime settings (issue 27 item 1): pools.runtime
-- holds the proto3 JSON of bettercompute.agent.v1.RuntimeSettings (the
-- engines to wire to CDI, the CDI spec directories, a minimum NVIDIA
-- Container Toolkit version), stored like pools.site and pools.health
-- (00006); '{}' sets nothing, and nodes of the pool get no runtime section.

-- +goose Up
ALTER TABLE pools ADD COLUMN runtime jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE pools DROP COLUMN runtime;
