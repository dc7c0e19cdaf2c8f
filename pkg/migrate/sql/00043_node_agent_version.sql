-- What a node's bcd says of itself (issue 29 item 3): agent_version is the
-- version its latest session's Hello reported (the gateway writes it when
-- the session opens); upgrade_failed is the reason of its agent section
-- while that reports FAILED_TERMINAL "UpgradeFailed: …" (the latch bcd
-- keeps until nodes.clearUpgrade), '' otherwise, with since when. Both are
-- per-node columns of a fixed size: no retention needed.

-- +goose Up
ALTER TABLE nodes
    ADD COLUMN agent_version text NOT NULL DEFAULT '',
    ADD COLUMN upgrade_failed text NOT NULL DEFAULT '',
    ADD COLUMN upgrade_failed_at timestamptz;

-- +goose Down
ALTER TABLE nodes
    DROP COLUMN agent_version,
    DROP COLUMN upgrade_failed,
    DROP COLUMN upgrade_failed_at;
