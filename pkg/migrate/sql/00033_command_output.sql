-- A running command's streamed output (issue 27 item 6: logs.collect
-- streamed): each chunk the daemon sends (CommandUpdate.output) is a row,
-- kept once per (command, seq) — a chunk sent again after a reconnect
-- changes nothing. offset is where the chunk starts in the whole output.
-- A command keeps at most its kind's output budget in bytes and
-- commandkinds.MaxOutputChunks chunks (pkg/commands refuses the rest).
-- When the command finishes with a result that carries the whole output
-- (logs.collect's data), its chunks are deleted in that transaction: the
-- result is the one copy kept. Otherwise they stay with the command and go
-- with it (ON DELETE CASCADE: the node's deletion).

-- +goose Up
CREATE TABLE command_output (
    command_id text NOT NULL REFERENCES commands (id) ON DELETE CASCADE,
    seq        integer NOT NULL CHECK (seq >= 0),
    "offset"   bigint NOT NULL CHECK ("offset" >= 0),
    data       bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (command_id, seq)
);

-- +goose Down
DROP TABLE command_output;
