-- fleet.drift (issue 29 item 2): the Drifted condition lives in
-- nodes.conditions with the inventory controller's (which carries it over
-- when it rewrites them); nodes.drift_sections is the job's own memory of
-- since when each section of the node has been seen not converged
-- ({"<section>": "<RFC 3339 time>"}), for the fleet.stuckAfter reason.
-- Only fleet.drift writes it (pkg/nodes.SetDrift).

-- +goose Up
ALTER TABLE nodes ADD COLUMN drift_sections jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE nodes DROP COLUMN drift_sections;
