-- Console sessions: the console's cookie carries a random session id, never
-- the API key. A row is found by SHA-256 of that id (the id itself is not
-- stored); it holds the API key the user signed in with, sealed under a key
-- derived from the session id (so neither the table nor the cookie alone is
-- a credential). A session ends at sign-out (its row deleted), idle after
-- console.sessionIdle, and console.sessionLifetime after sign-in
-- (expires_at). Retention: ended rows are pruned at each sign-in, and an
-- identity keeps at most a bounded number of sessions.

-- +goose Up
CREATE TABLE console_sessions (
    id_hash      bytea PRIMARY KEY CHECK (length(id_hash) = 32),
    key_id       text NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    identity_id  text NOT NULL,
    sealed_key   bytea NOT NULL CHECK (length(sealed_key) <= 1024),
    created_at   timestamptz NOT NULL,
    last_seen_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);
CREATE INDEX console_sessions_identity ON console_sessions (identity_id, created_at);
CREATE INDEX console_sessions_expires ON console_sessions (expires_at);
CREATE INDEX console_sessions_last_seen ON console_sessions (last_seen_at);

-- +goose Down
DROP TABLE console_sessions;
