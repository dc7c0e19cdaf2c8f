package commandkinds

import agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

// Bounds of a command's streamed output (CommandUpdate.output): the daemon
// cuts its output into chunks of at most MaxOutputChunk bytes, and the
// control plane keeps at most OutputBudget bytes and MaxOutputChunks
// chunks of a command, refusing the rest.
const (
	// MaxOutputChunk bounds one chunk, in bytes.
	MaxOutputChunk = 64 << 10
	// MaxOutputChunks bounds a command's chunks (a chunk's seq is below
	// it): logs.collect's largest budget in whole chunks plus one short
	// chunk per source, and room to spare.
	MaxOutputChunks = 256
)

// LogsBudget is the byte budget of a logs.collect payload: max_bytes, 0
// meaning DefaultLogsBytes, capped at MaxLogsBytes.
func LogsBudget(p *agentv1.LogsCollect) int {
	limit := int(min(p.GetMaxBytes(), MaxLogsBytes))
	if limit == 0 {
		limit = DefaultLogsBytes
	}
	return limit
}

// OutputBudget is how many bytes of output a command with body may stream:
// logs.collect's budget; 0 (none) for every other kind.
func OutputBudget(body *agentv1.CommandBody) int {
	if p := body.GetLogsCollect(); p != nil {
		return LogsBudget(p)
	}
	return 0
}

// ResultOutput returns the whole output a finished command's result
// carries (logs.collect's data), and whether it carries one: the streamed
// chunks are a copy of it.
func ResultOutput(r *agentv1.CommandResult) ([]byte, bool) {
	if lc := r.GetLogsCollect(); lc != nil {
		return lc.GetData(), true
	}
	return nil, false
}
