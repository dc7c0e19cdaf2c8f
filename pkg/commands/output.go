package commands

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// appendOutput keeps one chunk of in-flight c's streamed output (the
// command_output table; c's row is locked in tx). A chunk already kept
// under its seq changes nothing (a re-send after a reconnect). A chunk
// that is empty, longer than commandkinds.MaxOutputChunk, past
// commandkinds.MaxOutputChunks, or that would take c's output past its
// kind's budget (commandkinds.OutputBudget; none for kinds without
// output) is INVALID_INPUT "output" and kept not.
func appendOutput(ctx context.Context, tx pgx.Tx, c Command, o *agentv1.CommandOutput) error {
	n := len(o.GetData())
	switch {
	case n == 0 || n > commandkinds.MaxOutputChunk:
		return fault.New(fault.InvalidInput, "output", "command %s: a chunk of %d bytes (1 to %d)", c.ID, n, commandkinds.MaxOutputChunk)
	case o.GetSeq() >= commandkinds.MaxOutputChunks:
		return fault.New(fault.InvalidInput, "output", "command %s: chunk %d, at most %d chunks", c.ID, o.GetSeq(), commandkinds.MaxOutputChunks)
	}
	body, err := c.Body()
	if err != nil {
		return err
	}
	budget := commandkinds.OutputBudget(body)
	var kept, size int64
	var same bool
	err = tx.QueryRow(ctx, `
		SELECT count(*), coalesce(sum(length(data)), 0), coalesce(bool_or(seq = $2), false)
		  FROM command_output WHERE command_id = $1`, c.ID, int32(o.GetSeq())).Scan(&kept, &size, &same)
	if err != nil {
		return fmt.Errorf("command %s output: %w", c.ID, err)
	}
	switch {
	case same:
		return nil // sent again: kept once
	case size+int64(n) > int64(budget):
		return fault.New(fault.InvalidInput, "output", "command %s: %d bytes of output past its budget of %d", c.ID, size+int64(n), budget)
	case o.GetOffset() > uint64(budget):
		return fault.New(fault.InvalidInput, "output", "command %s: chunk offset %d past its budget of %d", c.ID, o.GetOffset(), budget)
	}
	_, err = tx.Exec(ctx, `INSERT INTO command_output (command_id, seq, "offset", data) VALUES ($1, $2, $3, $4)
		ON CONFLICT (command_id, seq) DO NOTHING`, c.ID, int32(o.GetSeq()), int64(o.GetOffset()), o.GetData())
	if err != nil {
		return fmt.Errorf("command %s output: %w", c.ID, err)
	}
	return nil
}

// dropOutput deletes c's streamed chunks in tx: c finished with a result
// that carries the whole output, the one copy kept.
func dropOutput(ctx context.Context, tx pgx.Tx, id string) error {
	if _, err := tx.Exec(ctx, `DELETE FROM command_output WHERE command_id = $1`, id); err != nil {
		return fmt.Errorf("command %s output: %w", id, err)
	}
	return nil
}

// Output is a stretch of a command's output (see [ReadOutput]).
type Output struct {
	// Data is the output from Offset on.
	Data   []byte
	Offset int64
	// Total is the output's size so far: the bytes of the chunks kept, or
	// the whole output of a finished command's result.
	Total int64
	// Done: c is finished and nothing after Offset+len(Data) will come.
	Done bool
}

// ReadOutput reads at most limit bytes of c's output from offset on: from
// the result of a finished command whose result carries its whole output
// (logs.collect's data), else from the chunks the node streamed, in order,
// up to the first one not (yet) there.
func ReadOutput(ctx context.Context, q Querier, c Command, offset int64, limit int) (Output, error) {
	out := Output{Offset: offset}
	if c.State.Final() && len(c.Result) > 0 {
		r := &agentv1.CommandResult{}
		if err := proto.Unmarshal(c.Result, r); err != nil {
			return Output{}, fmt.Errorf("command %s: decode result: %w", c.ID, err)
		}
		if data, ok := commandkinds.ResultOutput(r); ok {
			out.Total = int64(len(data))
			if offset < out.Total {
				out.Data = data[offset:min(offset+int64(limit), out.Total)]
			}
			out.Done = offset+int64(len(out.Data)) >= out.Total
			return out, nil
		}
	}
	if err := q.QueryRow(ctx, `SELECT coalesce(sum(length(data)), 0) FROM command_output WHERE command_id = $1`, c.ID).Scan(&out.Total); err != nil {
		return Output{}, fmt.Errorf("command %s output: %w", c.ID, err)
	}
	rows, err := q.Query(ctx, `
		SELECT "offset", data FROM command_output
		 WHERE command_id = $1 AND "offset" + length(data) > $2 AND "offset" < $2 + $3
		 ORDER BY "offset", seq`, c.ID, offset, int64(limit))
	if err != nil {
		return Output{}, fmt.Errorf("command %s output: %w", c.ID, err)
	}
	pos := offset
	var from int64
	var data []byte
	_, err = pgx.ForEachRow(rows, []any{&from, &data}, func() error {
		if from > pos || len(out.Data) >= limit {
			return nil // a gap: a chunk not there yet
		}
		part := data[pos-from:]
		part = part[:min(len(part), limit-len(out.Data))]
		out.Data = append(out.Data, part...)
		pos += int64(len(part))
		return nil
	})
	if err != nil {
		return Output{}, fmt.Errorf("command %s output: %w", c.ID, err)
	}
	out.Done = c.State.Final() && len(out.Data) < limit
	return out, nil
}
