-- Desired state (NodeSpec): the pool settings the nodespec controller merges
-- into every node's spec, and what it reports on a node.
--
-- pools.site and pools.health hold the proto3 JSON of
-- bettercompute.agent.v1.SiteSettings and HealthSettings; '{}' sets nothing.
-- nodes.spec (00004) holds the merged NodeSpec; nodes.spec_error says why
-- the latest merge failed (the last good spec and its generation stay);
-- nodes.section_status is the daemon's per-section convergence status,
-- {"<section>": {"state": "converged|progressing|failed|failed_terminally",
-- "reason": "…", "generation": n}}.

-- +goose Up
ALTER TABLE pools ADD COLUMN site jsonb NOT NULL DEFAULT '{}';
ALTER TABLE pools ADD COLUMN health jsonb NOT NULL DEFAULT '{}';
ALTER TABLE nodes ADD COLUMN spec_error text;
ALTER TABLE nodes ADD COLUMN section_status jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE nodes DROP COLUMN section_status;
ALTER TABLE nodes DROP COLUMN spec_error;
ALTER TABLE pools DROP COLUMN health;
ALTER TABLE pools DROP COLUMN site;
