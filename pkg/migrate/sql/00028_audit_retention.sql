-- Audit retention: audit.checkpoint deletes chained rows older than
-- audit.retention, below a checkpoint. The anchor is that checkpoint's
-- position and the hash of the row before it: verification starts at the
-- anchor's row, recomputes its hash from prev_hash and checks it against
-- the (signed) checkpoint there, then goes on as before; it says the rows
-- before it were pruned. One row at most.

-- +goose Up
CREATE TABLE audit_prune_anchor (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    chain_seq  bigint NOT NULL,
    prev_hash  bytea NOT NULL,
    -- The newest pruned row's time: everything pruned is older.
    before     timestamptz NOT NULL,
    pruned_at  timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE audit_prune_anchor;
