-- The iam role's key jobs: when an API key's expiry warning went out
-- (apiKey.expiring, once per key), and an index for the keys the warning
-- and the pruning look for.

-- +goose Up
ALTER TABLE api_keys ADD COLUMN expiry_warned_at timestamptz;
CREATE INDEX api_keys_expiring ON api_keys (expires_at) WHERE revoked_at IS NULL AND expiry_warned_at IS NULL;
CREATE INDEX api_keys_ended ON api_keys ((coalesce(revoked_at, expires_at))) WHERE revoked_at IS NOT NULL OR expires_at IS NOT NULL;

-- +goose Down
DROP INDEX api_keys_ended;
DROP INDEX api_keys_expiring;
ALTER TABLE api_keys DROP COLUMN expiry_warned_at;
