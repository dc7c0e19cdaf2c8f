-- The pool's agent settings (issue 29 item 3): pools.agent holds the proto3
-- JSON of bettercompute.agent.v1.AgentSettings — {"releaseManifest": the
-- signed release manifest, base64} — stored like pools.site, pools.health
-- and pools.runtime; '{}' sets nothing, and nodes of the pool get no agent
-- section (they keep the build they run).

-- +goose Up
ALTER TABLE pools ADD COLUMN agent jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE pools DROP COLUMN agent;
