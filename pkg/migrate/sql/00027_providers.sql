-- Provider pools (issue 17 item 5, DESIGN §14): a pool of class 'provider'
-- names a provider's API and the secret holding its credentials; the
-- vps.provider workflow (services/vps) creates, starts, stops and deletes
-- each instance's machine there, keyed by the instance id.

-- +goose Up

-- A provider account's credentials ({"token"}, pkg/providers.Credentials)
-- are a secret of their own kind.
ALTER TABLE secrets DROP CONSTRAINT secrets_kind_check;
ALTER TABLE secrets ADD CONSTRAINT secrets_kind_check CHECK (kind IN ('bmc', 'provider'));

-- A provider pool's settings (pools.update "provider").
CREATE TABLE provider_pool_settings (
    pool_id         text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    endpoint        text NOT NULL CHECK (length(endpoint) BETWEEN 1 AND 2048),
    credentials_ref text NOT NULL REFERENCES secrets (id),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- The workflow's step of a provider instance: what it is doing (create,
-- start, stop, delete; '' when settled), until when, and how many provider
-- calls of the step failed. provider_create_sent is set in its own
-- transaction before the first create call, so a delete knows whether a
-- machine may exist under the instance's key even when no machine id was
-- recorded (the crash between the call and the write).
ALTER TABLE instances
    ADD COLUMN provider_step          text NOT NULL DEFAULT ''
        CHECK (provider_step IN ('', 'create', 'start', 'stop', 'delete')),
    ADD COLUMN provider_deadline      timestamptz,
    ADD COLUMN provider_attempts      integer NOT NULL DEFAULT 0 CHECK (provider_attempts >= 0),
    ADD COLUMN provider_create_sent   boolean NOT NULL DEFAULT false,
    ADD COLUMN provider_machine_state text NOT NULL DEFAULT '';

-- What the resync walks: provider instances (no host) not settled.
CREATE INDEX instances_provider_unsettled ON instances (id)
    WHERE node_id IS NULL AND state IN ('pending', 'running', 'stopped', 'deleting');

-- +goose Down
DROP INDEX instances_provider_unsettled;
ALTER TABLE instances
    DROP COLUMN provider_machine_state,
    DROP COLUMN provider_create_sent,
    DROP COLUMN provider_attempts,
    DROP COLUMN provider_deadline,
    DROP COLUMN provider_step;
DROP TABLE provider_pool_settings;
DELETE FROM secrets WHERE kind = 'provider';
ALTER TABLE secrets DROP CONSTRAINT secrets_kind_check;
ALTER TABLE secrets ADD CONSTRAINT secrets_kind_check CHECK (kind IN ('bmc'));
