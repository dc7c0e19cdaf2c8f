-- The first schema: the tables every later module builds on.
-- Leases are rows, never advisory locks, so every access works behind
-- PgBouncer in transaction mode.

-- +goose Up
CREATE TABLE tenants (
    id         text PRIMARY KEY,
    parent_id  text REFERENCES tenants (id),
    name       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Only the root tenant has no parent.
    CONSTRAINT tenants_root_has_no_parent CHECK ((id = 'root') = (parent_id IS NULL))
);
CREATE INDEX tenants_parent ON tenants (parent_id);
INSERT INTO tenants (id, parent_id, name) VALUES ('root', NULL, 'root');

-- Processes taking part in shard membership. id is '<membership>/<uuid>',
-- membership is 'controllers' or 'scheduler'. A row whose expires_at has passed
-- (database time) is dead and is removed by the janitor.
CREATE TABLE workers (
    id           text PRIMARY KEY,
    membership   text NOT NULL,
    hostname     text NOT NULL DEFAULT '',
    version      text NOT NULL DEFAULT '',
    roles        text[] NOT NULL DEFAULT '{}',
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX workers_membership_expires ON workers (membership, expires_at);

-- Fenced leases: 'shard:<n>', 'scheduler/shard:<n>', 'singleton:<name>'.
-- Taking a lease increments fence; writes made under it check the fence in the
-- same statement.
CREATE TABLE leases (
    name        text PRIMARY KEY,
    holder      text,
    fence       bigint NOT NULL DEFAULT 0,
    acquired_at timestamptz,
    expires_at  timestamptz NOT NULL DEFAULT '-infinity'
);

-- Level-triggered work: one row per (kind, key). Enqueueing an existing key
-- bumps generation; a run deletes the row only if generation did not move.
CREATE TABLE work_queue (
    kind        text NOT NULL,
    key         text NOT NULL,
    shard       smallint NOT NULL CHECK (shard BETWEEN 0 AND 255),
    generation  bigint NOT NULL DEFAULT 1,
    run_after   timestamptz NOT NULL DEFAULT now(),
    attempts    integer NOT NULL DEFAULT 0,
    last_error  text,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, key)
);
CREATE INDEX work_queue_ready ON work_queue (shard, run_after);

-- Committed events waiting to be published to JetStream (BC_EVENTS).
CREATE TABLE outbox (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id  text NOT NULL REFERENCES tenants (id),
    type       text NOT NULL,
    subject    text NOT NULL,
    payload    jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz
);
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL;

-- Idempotent admission: the same key from the same identity replays the stored
-- result; another request under it is CONFLICT.
CREATE TABLE idempotency (
    tenant_id    text NOT NULL,
    identity_id  text NOT NULL,
    method       text NOT NULL,
    key          text NOT NULL,
    request_hash bytea NOT NULL,
    resource_id  text,
    response     jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, identity_id, method, key)
);
CREATE INDEX idempotency_expires ON idempotency (expires_at);

-- Append-only record of every authorised mutation.
CREATE TABLE audit (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    tenant_id  text NOT NULL,
    actor      text NOT NULL,
    action     text NOT NULL,
    resource   text NOT NULL,
    decision   text NOT NULL DEFAULT 'allow',
    request_id text NOT NULL DEFAULT '',
    detail     jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_tenant_at ON audit (tenant_id, at);

-- +goose Down
DROP TABLE audit;
DROP TABLE idempotency;
DROP TABLE outbox;
DROP TABLE work_queue;
DROP TABLE leases;
DROP TABLE workers;
DROP TABLE tenants;
