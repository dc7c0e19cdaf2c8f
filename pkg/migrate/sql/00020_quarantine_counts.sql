-- Quarantined GPUs (issue 14, DESIGN §12) are not bookable, and the
-- capacity counts say so apart.
--
-- capacity_recount (00010) counts a node's free atoms; it now leaves out
-- quarantined devices (devices.quarantined_at), and the devices trigger
-- recounts a node when a device's quarantine changes. capacity_rollup
-- gains a quarantined count: capacity.rollup counts a quarantined GPU there
-- (booked or not) instead of as free, booked or unavailable.
--
-- remediations.cleared_at: nodes.clearRepair resets a node's remediation
-- budget by marking its rows cleared; the health job's brakes count only
-- the rows that are not (the rows stay, for the record, until pruned).

-- +goose Up
ALTER TABLE capacity_rollup ADD COLUMN quarantined integer NOT NULL DEFAULT 0;
ALTER TABLE remediations ADD COLUMN cleared_at timestamptz;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION capacity_recount(node_ids text[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    n text;
BEGIN
    -- Sorted, so that transactions recounting several nodes lock them in one
    -- order.
    FOR n IN SELECT DISTINCT x FROM unnest(node_ids) AS x WHERE x IS NOT NULL ORDER BY x LOOP
        -- Create or lock the node's row; a node deleted in this transaction
        -- has none.
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION capacity_devices_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM capacity_recount(ARRAY(SELECT node_id FROM new_rows));
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM capacity_recount(ARRAY(SELECT node_id FROM old_rows));
    ELSE
        -- Only what placement reads: an inventory report rewrites every
        -- device, mostly unchanged.
        PERFORM capacity_recount(ARRAY(
            SELECT coalesce(o.node_id, w.node_id) FROM old_rows o
              FULL JOIN new_rows w ON (w.node_id, w.id) = (o.node_id, o.id)
             WHERE o.node_id IS NULL OR w.node_id IS NULL
                OR (o.kind, o.model, o.memory_bytes, o.mig_enabled, o.healthy, o.missing_since IS NULL, o.quarantined_at IS NULL)
                   IS DISTINCT FROM (w.kind, w.model, w.memory_bytes, w.mig_enabled, w.healthy, w.missing_since IS NULL, w.quarantined_at IS NULL)));
    END IF;
    RETURN NULL;
END $$;
-- +goose StatementEnd

SELECT capacity_recount(ARRAY(SELECT id FROM nodes));

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION capacity_devices_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM capacity_recount(ARRAY(SELECT node_id FROM new_rows));
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM capacity_recount(ARRAY(SELECT node_id FROM old_rows));
    ELSE
        PERFORM capacity_recount(ARRAY(
            SELECT coalesce(o.node_id, w.node_id) FROM old_rows o
              FULL JOIN new_rows w ON (w.node_id, w.id) = (o.node_id, o.id)
             WHERE o.node_id IS NULL OR w.node_id IS NULL
                OR (o.kind, o.model, o.memory_bytes, o.mig_enabled, o.healthy, o.missing_since IS NULL)
                   IS DISTINCT FROM (w.kind, w.model, w.memory_bytes, w.mig_enabled, w.healthy, w.missing_since IS NULL)));
    END IF;
    RETURN NULL;
END $$;
-- +goose StatementEnd

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
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = d.id AND b.active)
         GROUP BY d.model, d.memory_bytes;
    END LOOP;
END $$;
-- +goose StatementEnd

SELECT capacity_recount(ARRAY(SELECT id FROM nodes));
ALTER TABLE remediations DROP COLUMN cleared_at;
ALTER TABLE capacity_rollup DROP COLUMN quarantined;
