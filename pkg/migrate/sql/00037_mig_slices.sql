-- MIG slices as bookable atoms (issue 28 item 4).
--
-- A GPU's MIG slices are devices of kind 'mig' (id: the slice's MIG-…
-- UUID), written by the inventory controller from each report's
-- GPU.mig_slices and marked missing like a GPU when no longer reported:
-- parent_id is the GPU's UUID, profile, mig_start (first memory slice),
-- compute_slices (from proto/migcatalog) and gpu_instance_id say which
-- slice it is. A booking of a slice is a bookings row like a GPU's
-- (device_id the MIG UUID, so bookings_active_atom keeps one active
-- booking per slice), with its mig_profile and compute_slices (7 for a
-- whole GPU): GPU-hours weigh a booking by compute_slices / 7.
--
-- A GPU is not bookable whole while it has slices or its node's desired
-- state puts it in MIG mode (the mig section of nodes.spec names it with
-- migEnabled): capacity_recount leaves such GPUs out, and a change of a
-- node's mig section recounts the node.
--
-- node_slices_free counts each node's free slices per profile and model
-- (bookable: see pkg/capacity sliceEligibleSQL), kept by capacity_recount
-- like node_capacity_free, so slice placement reads a row per node instead
-- of every slice of the pool.
--
-- Quotas gain mig_profile: a quota on one profile's slices (gpu_limit in
-- slices); a quota without one counts whole GPUs only.

-- +goose Up
ALTER TABLE devices
    ADD COLUMN parent_id       text NOT NULL DEFAULT '',
    ADD COLUMN profile         text NOT NULL DEFAULT '',
    ADD COLUMN mig_start       integer NOT NULL DEFAULT 0,
    ADD COLUMN compute_slices  integer NOT NULL DEFAULT 0,
    ADD COLUMN gpu_instance_id integer NOT NULL DEFAULT 0;
CREATE INDEX devices_mig_parent ON devices (node_id, parent_id) WHERE kind = 'mig';
CREATE INDEX devices_mig_profile ON devices (profile, node_id) WHERE kind = 'mig' AND missing_since IS NULL;

ALTER TABLE bookings
    ADD COLUMN mig_profile    text NOT NULL DEFAULT '',
    ADD COLUMN compute_slices integer NOT NULL DEFAULT 7;

ALTER TABLE reservations ADD COLUMN mig_profile text NOT NULL DEFAULT '';

ALTER TABLE quotas ADD COLUMN mig_profile text NOT NULL DEFAULT '';
ALTER TABLE quotas DROP CONSTRAINT quotas_pkey;
ALTER TABLE quotas ADD PRIMARY KEY (pool_id, tenant_id, model, mig_profile);

CREATE TABLE node_slices_free (
    node_id text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    profile text NOT NULL,
    model   text NOT NULL,
    free    integer NOT NULL,
    PRIMARY KEY (node_id, profile, model)
);
CREATE INDEX node_slices_free_profile ON node_slices_free (profile, node_id);

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION capacity_recount(node_ids text[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    n text;
BEGIN
    -- Sorted, so that transactions recounting several nodes lock them in one
    -- order.
    FOR n IN SELECT DISTINCT x FROM unnest(node_ids) AS x WHERE x IS NOT NULL ORDER BY x LOOP
        INSERT INTO node_capacity (node_id) SELECT id FROM nodes WHERE id = n
        ON CONFLICT (node_id) DO UPDATE SET booked = node_capacity.booked;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE node_capacity SET booked = (SELECT count(*) FROM bookings WHERE node_id = n AND active)
         WHERE node_id = n;
        DELETE FROM node_capacity_free WHERE node_id = n;
        INSERT INTO node_capacity_free (node_id, model, memory_bytes, free)
        SELECT n, d.model, d.memory_bytes, count(*) FROM devices d
         WHERE d.node_id = n AND d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND NOT d.mig_enabled
           AND d.quarantined_at IS NULL
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = d.id AND b.active)
           AND NOT EXISTS (SELECT 1 FROM devices s WHERE s.node_id = n AND s.kind = 'mig' AND s.parent_id = d.id AND s.missing_since IS NULL)
           AND NOT EXISTS (SELECT 1 FROM nodes m WHERE m.id = n
                            AND m.spec->'mig'->'gpus' @> jsonb_build_array(jsonb_build_object('gpuUuid', d.id, 'migEnabled', true)))
         GROUP BY d.model, d.memory_bytes;
        DELETE FROM node_slices_free WHERE node_id = n;
        INSERT INTO node_slices_free (node_id, profile, model, free)
        SELECT n, s.profile, p.model, count(*) FROM devices s JOIN devices p ON p.node_id = n AND p.id = s.parent_id AND p.kind = 'gpu'
         WHERE s.node_id = n AND s.kind = 'mig' AND s.missing_since IS NULL
           AND p.healthy AND p.missing_since IS NULL AND p.quarantined_at IS NULL
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = s.id AND b.active)
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = p.id AND b.active)
         GROUP BY s.profile, p.model;
    END LOOP;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION capacity_mig_spec_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM capacity_recount(ARRAY[NEW.id]);
    RETURN NULL;
END $$;
-- +goose StatementEnd

CREATE TRIGGER nodes_mig_spec_count AFTER UPDATE OF spec ON nodes
    FOR EACH ROW WHEN (OLD.spec->'mig' IS DISTINCT FROM NEW.spec->'mig')
    EXECUTE FUNCTION capacity_mig_spec_changed();

SELECT capacity_recount(ARRAY(SELECT id FROM nodes));

-- +goose Down
DROP TRIGGER nodes_mig_spec_count ON nodes;
DROP TABLE node_slices_free;
DROP FUNCTION capacity_mig_spec_changed();
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION capacity_recount(node_ids text[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    n text;
BEGIN
    FOR n IN SELECT DISTINCT x FROM unnest(node_ids) AS x WHERE x IS NOT NULL ORDER BY x LOOP
        INSERT INTO node_capacity (node_id) SELECT id FROM nodes WHERE id = n
        ON CONFLICT (node_id) DO UPDATE SET booked = node_capacity.booked;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE node_capacity SET booked = (SELECT count(*) FROM bookings WHERE node_id = n AND active)
         WHERE node_id = n;
        DELETE FROM node_capacity_free WHERE node_id = n;
        INSERT INTO node_capacity_free (node_id, model, memory_bytes, free)
        SELECT n, d.model, d.memory_bytes, count(*) FROM devices d
         WHERE d.node_id = n AND d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND NOT d.mig_enabled
           AND d.quarantined_at IS NULL
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = d.id AND b.active)
         GROUP BY d.model, d.memory_bytes;
    END LOOP;
END $$;
-- +goose StatementEnd
ALTER TABLE quotas DROP CONSTRAINT quotas_pkey;
DELETE FROM quotas WHERE mig_profile <> '';
ALTER TABLE quotas ADD PRIMARY KEY (pool_id, tenant_id, model);
ALTER TABLE quotas DROP COLUMN mig_profile;
ALTER TABLE reservations DROP COLUMN mig_profile;
ALTER TABLE bookings DROP COLUMN compute_slices, DROP COLUMN mig_profile;
DELETE FROM devices WHERE kind = 'mig';
DROP INDEX devices_mig_profile;
DROP INDEX devices_mig_parent;
ALTER TABLE devices DROP COLUMN gpu_instance_id, DROP COLUMN compute_slices, DROP COLUMN mig_start,
    DROP COLUMN profile, DROP COLUMN parent_id;
