-- Events leave the database: the outbox becomes the event log, webhooks and
-- their deliveries, and the audit hash chain.
--
-- Commit order. Outbox ids come from an identity, so a transaction that took
-- id 10 can commit after one that took id 11: a reader that remembered "11"
-- would never see 10. So an event's place in the feed is not its id but its
-- seq, which the outbox relay (one holder of a fenced lease at a time)
-- assigns to committed rows in batches. Every cursor (the fan-out's, a
-- watcher's Last-Event-ID, events.list's after) is a seq, and no row ever
-- gets a seq below one a reader has seen. The audit chain uses the same
-- trick: chain_seq is assigned by one chainer, in order.
--
-- Dead rows. Autovacuum may be off (it is on this project's CI): every scan
-- below is bounded by a cursor or a partial index, and events.prune VACUUMs
-- the tables it deletes from.

-- +goose Up
CREATE SEQUENCE events_seq AS bigint;

ALTER TABLE outbox ADD COLUMN seq bigint UNIQUE;
ALTER TABLE outbox ADD COLUMN resource_id text NOT NULL DEFAULT '';
DROP INDEX outbox_unsent;
-- Rows the relay has not sequenced yet.
CREATE INDEX outbox_unsequenced ON outbox (id) WHERE seq IS NULL;
-- Sequenced rows not yet acknowledged by JetStream (the bus was down).
CREATE INDEX outbox_unpublished ON outbox (seq) WHERE sent_at IS NULL AND seq IS NOT NULL;
CREATE INDEX outbox_tenant_seq ON outbox (tenant_id, seq);
CREATE INDEX outbox_resource_seq ON outbox (resource_id, seq) WHERE resource_id <> '';
CREATE INDEX outbox_created ON outbox (created_at);

-- Durable positions in the event feed: 'fanout' is the last seq turned into
-- deliveries.
CREATE TABLE event_cursors (
    name       text PRIMARY KEY,
    seq        bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO event_cursors (name) VALUES ('fanout');

-- Webhook endpoints. secret signs deliveries (HMAC-SHA256, so it is kept,
-- not hashed); previous_secret signs beside it until it expires.
CREATE TABLE webhooks (
    id                         text PRIMARY KEY,
    tenant_id                  text NOT NULL REFERENCES tenants (id),
    url                        text NOT NULL,
    event_types                text[] NOT NULL,
    description                text NOT NULL DEFAULT '',
    include_descendants        boolean NOT NULL DEFAULT false,
    secret                     bytea NOT NULL,
    previous_secret            bytea,
    previous_secret_expires_at timestamptz,
    enabled                    boolean NOT NULL DEFAULT true,
    disabled_reason            text NOT NULL DEFAULT '',
    -- The first failed attempt since the last success.
    failing_since              timestamptz,
    created_by                 text NOT NULL DEFAULT '',
    created_at                 timestamptz NOT NULL DEFAULT now(),
    updated_at                 timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhooks_tenant ON webhooks (tenant_id, id);

-- One event on its way to one webhook.
CREATE TABLE webhook_deliveries (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    webhook_id      text NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_id        bigint NOT NULL REFERENCES outbox (id) ON DELETE CASCADE,
    tenant_id       text NOT NULL,
    state           text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'succeeded', 'failed')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_status     integer NOT NULL DEFAULT 0,
    last_error      text NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    UNIQUE (webhook_id, event_id)
);
-- The claim probes each webhook's due deliveries, oldest first.
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (webhook_id, next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_webhook ON webhook_deliveries (webhook_id, id);
CREATE INDEX webhook_deliveries_event ON webhook_deliveries (event_id);

-- The audit hash chain: hash = SHA-256(previous hash, canonical fields).
ALTER TABLE audit ADD COLUMN chain_seq bigint UNIQUE;
ALTER TABLE audit ADD COLUMN hash bytea;
CREATE INDEX audit_unchained ON audit (id) WHERE chain_seq IS NULL;

-- Signed chain heads.
CREATE TABLE audit_checkpoints (
    chain_seq  bigint PRIMARY KEY,
    head_hash  bytea NOT NULL,
    signature  bytea,
    key_id     text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE audit_checkpoints;
DROP INDEX audit_unchained;
ALTER TABLE audit DROP COLUMN hash;
ALTER TABLE audit DROP COLUMN chain_seq;
DROP TABLE webhook_deliveries;
DROP TABLE webhooks;
DROP TABLE event_cursors;
DROP INDEX outbox_created;
DROP INDEX outbox_resource_seq;
DROP INDEX outbox_tenant_seq;
DROP INDEX outbox_unpublished;
DROP INDEX outbox_unsequenced;
ALTER TABLE outbox DROP COLUMN resource_id;
ALTER TABLE outbox DROP COLUMN seq;
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL;
DROP SEQUENCE events_seq;
