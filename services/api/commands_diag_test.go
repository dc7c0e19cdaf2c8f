package api_test

import (
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// diag.nvml's level: one the daemon does not know (DCGM's bare run-level
// numbers included) is INVALID_INPUT on payload.level before anything is
// queued; quick, medium, long, full and none are taken.
func TestCommandsRunDiagUnknownLevelRefused(t *testing.T) {
	t.Parallel()
	h, acmeKey, _, node := commandNode(t)
	cmds := computev1.NewCommandsServiceClient(h.conn)
	run := func(level string) error {
		_, err := cmds.Run(as(acmeKey), &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml",
			Payload: payload(t, map[string]any{"level": level})})
		return err
	}
	for _, l := range []string{"extreme", "3", "QUICK", " quick"} {
		t.Run(l, func(t *testing.T) { wantCode(t, run(l), fault.InvalidInput, "payload.level") })
	}
	if n := h.count(t, `SELECT count(*) FROM commands WHERE node_id = $1`, node); n != 0 {
		t.Fatalf("%d commands queued by refused requests", n)
	}
	for _, l := range []string{"", "quick", "medium", "long", "full"} {
		if err := run(l); err != nil {
			t.Fatalf("level %q: %v", l, err)
		}
	}
}
