-- Commands are signed when they are admitted, not when they are sent.
--
-- The api (or any module queuing through a signing registry) signs a
-- destructive command in the transaction that queues it and stores the
-- signature here; the gateway sends it unchanged and holds no signing key,
-- so neither it nor anything else that can write this table can make a
-- destructive command a daemon accepts. The signature covers the timeout the
-- daemon is sent, so that is stored too (timeout_ms; 0 for rows from before,
-- which are sent the kind's timeout). key_id names the key (hex of the first
-- 8 bytes of SHA-256 of its public key); '' and a NULL signature when the
-- command is unsigned.

-- +goose Up
ALTER TABLE commands
    ADD COLUMN timeout_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN signature  bytea,
    ADD COLUMN key_id     text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE commands
    DROP COLUMN timeout_ms,
    DROP COLUMN signature,
    DROP COLUMN key_id;
