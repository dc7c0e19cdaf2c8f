-- MIG slices a pending layout removes, and GPUs whose change waits, are
-- not bookable (issue 28).
--
-- mig_slice_doomed(spec, gpu, profile, start) is true when the node's
-- stored desired state (nodes.spec, its "mig" section) names the GPU and
-- does not keep an instance of that profile at that start (MIG off, or a
-- layout without it): the slice is about to go, so placement never books
-- it (pkg/capacity sliceEligibleSQL) and node_slices_free does not count
-- it. protojson leaves out a start of 0, hence the coalesce.
--
-- A GPU with a mig_layouts_draining mark (its layout change waits for its
-- bookings: migrations 00034 and 00038) takes no new booking, whole or of
-- a slice: capacity_recount leaves it out, and a mark made or removed
-- recounts its node (trigger mig_layouts_draining_count).

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION mig_slice_doomed(spec jsonb, gpu text, profile text, start integer) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM jsonb_array_elements(CASE WHEN jsonb_typeof($1->'mig'->'gpus') = 'array' THEN $1->'mig'->'gpus' ELSE '[]' END) g
         WHERE g->>'gpuUuid' = $2
           AND NOT (coalesce((g->>'migEnabled')::boolean, false)
                    AND EXISTS (SELECT 1 FROM jsonb_array_elements(CASE WHEN jsonb_typeof(g->'instances') = 'array' THEN g->'instances' ELSE '[]' END) i
                                 WHERE i->>'profile' = $3 AND coalesce((i->>'start')::integer, 0) = $4)))
$$;
-- +goose StatementEnd

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
           AND NOT EXISTS (SELECT 1 FROM mig_layouts_draining w WHERE w.node_id = n AND w.gpu_uuid = d.id)
         GROUP BY d.model, d.memory_bytes;
        DELETE FROM node_slices_free WHERE node_id = n;
        INSERT INTO node_slices_free (node_id, profile, model, free)
        SELECT n, s.profile, p.model, count(*) FROM devices s JOIN devices p ON p.node_id = n AND p.id = s.parent_id AND p.kind = 'gpu'
         WHERE s.node_id = n AND s.kind = 'mig' AND s.missing_since IS NULL
           AND p.healthy AND p.missing_since IS NULL AND p.quarantined_at IS NULL
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = s.id AND b.active)
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = p.id AND b.active)
           AND NOT EXISTS (SELECT 1 FROM mig_layouts_draining w WHERE w.node_id = n AND w.gpu_uuid = p.id)
           AND NOT EXISTS (SELECT 1 FROM nodes m WHERE m.id = n AND mig_slice_doomed(m.spec, p.id, s.profile, s.mig_start))
         GROUP BY s.profile, p.model;
    END LOOP;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION mig_draining_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM capacity_recount(ARRAY[OLD.node_id]);
    ELSE
        PERFORM capacity_recount(ARRAY[NEW.node_id]);
    END IF;
    RETURN NULL;
END $$;
-- +goose StatementEnd

CREATE TRIGGER mig_layouts_draining_count AFTER INSERT OR DELETE ON mig_layouts_draining
    FOR EACH ROW EXECUTE FUNCTION mig_draining_changed();

SELECT capacity_recount(ARRAY(SELECT id FROM nodes));

-- +goose Down
DROP TRIGGER mig_layouts_draining_count ON mig_layouts_draining;
DROP FUNCTION mig_draining_changed();
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

DROP FUNCTION mig_slice_doomed(jsonb, text, text, integer);

SELECT capacity_recount(ARRAY(SELECT id FROM nodes));
