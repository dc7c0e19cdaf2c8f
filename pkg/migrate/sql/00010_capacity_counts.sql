-- Capacity counts: each node's free atoms by (model, memory), and how many
-- of its atoms are booked, so placement reads about one row per node instead
-- of every device of the pool and its bookings.
--
-- The counts are derived, never adjusted: statement triggers on bookings and
-- devices recount every node a statement touched, from the rows themselves,
-- after locking the node's node_capacity row. Recounts of a node therefore
-- run one at a time, and each reads (READ COMMITTED, a statement at a time)
-- every change committed before it plus its own transaction's. A transaction
-- that changes a node's bookings or devices holds the node's row from its
-- recount to its end, so the last recount to commit saw every committed
-- change: the counts equal the truth whenever no transaction is in flight.
--
-- The row lock is also what placement takes (pkg/capacity.Place) before it
-- reads a node's free atoms and books them: creates that pick the same node
-- book it one after the other, and one that finds the node locked tries
-- another instead of waiting.

-- +goose Up
CREATE TABLE node_capacity (
    node_id text PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    -- Active bookings on the node (any device, any model).
    booked  integer NOT NULL DEFAULT 0
);

-- Free atoms of a node: healthy, present, whole (not MIG-enabled) GPUs
-- without an active booking, by model and memory. Only counts above zero.
CREATE TABLE node_capacity_free (
    node_id      text NOT NULL REFERENCES node_capacity (node_id) ON DELETE CASCADE,
    model        text NOT NULL,
    memory_bytes bigint NOT NULL,
    free         integer NOT NULL CHECK (free > 0),
    PRIMARY KEY (node_id, model, memory_bytes)
);

-- +goose StatementBegin
CREATE FUNCTION capacity_recount(node_ids text[]) RETURNS void LANGUAGE plpgsql AS $$
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
           AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n AND b.device_id = d.id AND b.active)
         GROUP BY d.model, d.memory_bytes;
    END LOOP;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION capacity_bookings_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM capacity_recount(ARRAY(SELECT node_id FROM new_rows));
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM capacity_recount(ARRAY(SELECT node_id FROM old_rows));
    ELSE
        PERFORM capacity_recount(ARRAY(
            SELECT coalesce(o.node_id, w.node_id) FROM old_rows o
              FULL JOIN new_rows w ON (w.reservation_id, w.node_id, w.device_id) = (o.reservation_id, o.node_id, o.device_id)
             WHERE o.node_id IS NULL OR w.node_id IS NULL OR o.active IS DISTINCT FROM w.active));
    END IF;
    RETURN NULL;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION capacity_devices_changed() RETURNS trigger LANGUAGE plpgsql AS $$
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
                OR (o.kind, o.model, o.memory_bytes, o.mig_enabled, o.healthy, o.missing_since IS NULL)
                   IS DISTINCT FROM (w.kind, w.model, w.memory_bytes, w.mig_enabled, w.healthy, w.missing_since IS NULL)));
    END IF;
    RETURN NULL;
END $$;
-- +goose StatementEnd

CREATE TRIGGER bookings_count_insert AFTER INSERT ON bookings
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION capacity_bookings_changed();
CREATE TRIGGER bookings_count_update AFTER UPDATE ON bookings
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION capacity_bookings_changed();
CREATE TRIGGER bookings_count_delete AFTER DELETE ON bookings
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION capacity_bookings_changed();
CREATE TRIGGER devices_count_insert AFTER INSERT ON devices
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION capacity_devices_changed();
CREATE TRIGGER devices_count_update AFTER UPDATE ON devices
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION capacity_devices_changed();
CREATE TRIGGER devices_count_delete AFTER DELETE ON devices
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION capacity_devices_changed();

SELECT capacity_recount(ARRAY(SELECT id FROM nodes));

-- +goose Down
DROP TRIGGER devices_count_delete ON devices;
DROP TRIGGER devices_count_update ON devices;
DROP TRIGGER devices_count_insert ON devices;
DROP TRIGGER bookings_count_delete ON bookings;
DROP TRIGGER bookings_count_update ON bookings;
DROP TRIGGER bookings_count_insert ON bookings;
DROP FUNCTION capacity_devices_changed();
DROP FUNCTION capacity_bookings_changed();
DROP FUNCTION capacity_recount(text[]);
DROP TABLE node_capacity_free;
DROP TABLE node_capacity;
