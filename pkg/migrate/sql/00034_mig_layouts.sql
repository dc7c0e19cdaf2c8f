-- MIG layouts as desired state (issue 28 items 1 and 2): a pool's named
-- layouts (pools.update, mask "mig") and a node's overrides (nodes.update,
-- mask "mig"), in order; the capacity.mig nodespec contributor turns them
-- into each node's "mig" section. Exactly one of pool_id and node_id is
-- set. Validated at admission against proto/migcatalog.
--
-- mig_layouts_draining marks a GPU whose new layout waits for a booking to
-- end: the reservation.device_draining event is written once, when the mark
-- is made, and the mark goes when the layout applies (or no longer
-- differs).

-- +goose Up
CREATE TABLE mig_layouts (
    pool_id  text REFERENCES pools (id) ON DELETE CASCADE,
    node_id  text REFERENCES nodes (id) ON DELETE CASCADE,
    position integer NOT NULL CHECK (position >= 0),
    name     text NOT NULL,
    model    text NOT NULL DEFAULT '', -- a migcatalog model's name; '' with indices
    indices  integer[] NOT NULL DEFAULT '{}',
    profiles text[] NOT NULL DEFAULT '{}',
    disabled boolean NOT NULL DEFAULT false,
    CHECK ((pool_id IS NULL) <> (node_id IS NULL))
);
CREATE UNIQUE INDEX mig_layouts_pool ON mig_layouts (pool_id, position) WHERE pool_id IS NOT NULL;
CREATE UNIQUE INDEX mig_layouts_node ON mig_layouts (node_id, position) WHERE node_id IS NOT NULL;

CREATE TABLE mig_layouts_draining (
    node_id  text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    gpu_uuid text NOT NULL,
    since    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, gpu_uuid)
);

-- +goose Down
DROP TABLE mig_layouts_draining;
DROP TABLE mig_layouts;
