package command

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Journal states.
const (
	stateAccepted  = "accepted"
	stateSucceeded = "succeeded"
	stateFailed    = "failed"
	stateCancelled = "cancelled"
	stateRejected  = "rejected"
)

// JournalDir is the journal's directory under the agent's root (the same
// directory as state's journal id, so losing one loses the other).
const JournalDir = "journal"

// entry is one command's journal record, <root>/journal/cmd-<seq>.json.
type entry struct {
	Seq    int64  `json:"seq"`
	ID     string `json:"id"`
	Kind   string `json:"kind"`
	State  string `json:"state"`
	Reject string `json:"reject,omitempty"` // the RejectCode's name, for rejected
	Reason string `json:"reason,omitempty"`
	Result []byte `json:"result,omitempty"` // a serialized CommandResult
	// Signature is the serialized NodeSignature over the entry's update
	// (proto/resultsig), for a finished command of a daemon with a
	// Config.ResultKey.
	Signature []byte    `json:"signature,omitempty"`
	BootID    string    `json:"boot_id"`
	At        time.Time `json:"at"`
}

// final reports whether the entry will never change again.
func (e *entry) final() bool { return e.State != stateAccepted }

// update is the CommandUpdate the entry answers a re-delivery with.
func (e *entry) update() *agentv1.CommandUpdate {
	u := &agentv1.CommandUpdate{Id: e.ID, Seq: e.Seq, Reason: e.Reason}
	switch e.State {
	case stateAccepted:
		u.Outcome = agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED
	case stateSucceeded:
		u.Outcome = agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED
	case stateFailed:
		u.Outcome = agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED
	case stateCancelled:
		u.Outcome = agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED
	case stateRejected:
		u.Outcome = agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED
		u.Reject = agentv1.RejectCode(agentv1.RejectCode_value[e.Reject])
	}
	if len(e.Result) > 0 {
		r := &agentv1.CommandResult{}
		if proto.Unmarshal(e.Result, r) == nil {
			u.Result = r
		}
	}
	if len(e.Signature) > 0 {
		s := &agentv1.NodeSignature{}
		if proto.Unmarshal(e.Signature, s) == nil {
			u.NodeSignature = s
		}
	}
	return u
}

// journal is the durable record of commands by seq: one small JSON file
// per seq, written atomically and fsynced (state.WriteAtomic) before the
// daemon answers for it. It is not safe for concurrent use; the Executor
// serialises access.
type journal struct {
	dir     string
	entries map[int64]*entry
}

func entryName(seq int64) string { return "cmd-" + strconv.FormatInt(seq, 10) + ".json" }

// openJournal loads every entry under dir, creating it when missing, and
// deletes final entries older than retention.
func openJournal(dir string, retention time.Duration, now time.Time) (*journal, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("command: journal: %w", err)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("command: journal: %w", err)
	}
	j := &journal{dir: dir, entries: map[int64]*entry{}}
	for _, de := range des {
		name := de.Name()
		if !strings.HasPrefix(name, "cmd-") || !strings.HasSuffix(name, ".json") {
			continue
		}
		path := filepath.Join(dir, name)
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("command: journal: %w", err)
		}
		e := &entry{}
		if err := json.Unmarshal(b, e); err != nil {
			// WriteAtomic never leaves a torn file, so this is foreign
			// or corrupted: refuse to start rather than risk running a
			// command twice.
			return nil, fmt.Errorf("command: journal %s: %w", path, err)
		}
		if e.final() && now.Sub(e.At) > retention {
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("command: journal: %w", err)
			}
			continue
		}
		j.entries[e.Seq] = e
	}
	return j, nil
}

func (j *journal) get(seq int64) *entry { return j.entries[seq] }

// put writes e durably, then records it in memory.
func (j *journal) put(e *entry) error {
	b, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("command: journal: %w", err)
	}
	if err := state.WriteAtomic(filepath.Join(j.dir, entryName(e.Seq)), b, 0o600); err != nil {
		return fmt.Errorf("command: journal seq %d: %w", e.Seq, err)
	}
	j.entries[e.Seq] = e
	return nil
}
