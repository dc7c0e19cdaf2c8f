package inventory_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/internal/fakedcgmi"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// dcgmi's JSON as other DCGM 3 builds write it: gpu_id a number, warnings
// plain strings, "Not Run" and "Warn" statuses; and bounds on what a
// hostile or broken dcgmi prints.
func TestRunDCGMReadsOutputShapesWithinBounds(t *testing.T) {
	t.Parallel()
	uuids := map[uint32]string{0: "GPU-a", 2: "GPU-c"}
	out := `{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Stress", "tests": [
	  {"name": "Diagnostic", "results": [{"gpu_id": 2, "status": "Warn", "warnings": ["clocks throttled"], "info": "ran 60 s"},
	                                     {"gpu_id": 0, "status": "Not Run"}]}]}]}, "version": "3.1.8"}`
	d := inventory.RunDCGM(t.Context(), fakedcgmi.New(t, out, 0).Path, 1, []uint32{0, 2}, uuids)
	if d.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_PASSED || len(d.GetTests()) != 2 {
		t.Fatalf("%v", d)
	}
	if w := d.GetTests()[0]; w.GetGpuUuid() != "GPU-c" || w.GetResult() != "warn" || w.GetDetail() != "clocks throttled; ran 60 s" {
		t.Fatalf("warn %v", w)
	}
	if s := d.GetTests()[1]; s.GetGpuUuid() != "GPU-a" || s.GetResult() != "skip" {
		t.Fatalf("not run %v", s)
	}

	var tests []string
	for i := range 300 {
		tests = append(tests, fmt.Sprintf(`{"name": %q, "results": [{"gpu_ids": "0", "status": "Fail", "warnings": [{"warning": %q}]}]}`,
			strings.Repeat("n", 500), strings.Repeat("w", 5000)+fmt.Sprint(i)))
	}
	big := `{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [` + strings.Join(tests, ",") + `]}]}, "version": "` + strings.Repeat("9", 500) + `"}`
	d = inventory.RunDCGM(t.Context(), fakedcgmi.New(t, big, 226).Path, 3, nil, uuids)
	if d.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_FAILED || len(d.GetTests()) != 256 || len([]rune(d.GetReason())) > 1024 ||
		len(d.GetVersion()) > 64 || len(d.GetTests()[0].GetName()) > 128 || len(d.GetTests()[0].GetDetail()) > 1024 {
		t.Fatalf("status %v, %d tests, reason %d, version %d", d.GetStatus(), len(d.GetTests()), len(d.GetReason()), len(d.GetVersion()))
	}
}
