-- The latest inventory report of each node, as its current session sent it,
-- and the node conditions the inventory controller derives from it.
--
-- The gateway writes a report only while the session's epoch is the node's,
-- so a superseded session's late report changes nothing.

-- +goose Up
CREATE TABLE node_inventory (
    node_id       text PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    session_epoch bigint NOT NULL,
    report        jsonb NOT NULL,
    received_at   timestamptz NOT NULL DEFAULT now(),
    -- When the inventory controller last derived devices from this report;
    -- NULL or older than received_at means it has not yet.
    applied_at    timestamptz
);

-- Conditions: [{"type": "InventoryReported", "status": true, "reason": "…",
-- "since": "…"}, …], as the inventory controller last derived them.
ALTER TABLE nodes ADD COLUMN conditions jsonb NOT NULL DEFAULT '[]';

-- +goose Down
ALTER TABLE nodes DROP COLUMN conditions;
DROP TABLE node_inventory;
