package converge_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/bettercompute/bettercompute/agent/converge"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

func readCDI(t *testing.T, root string) *converge.CDISpec {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, converge.CDISpecFile))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var s converge.CDISpec
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

// TestDevices_RestartRepairsDrift: a node restarted after its devices file
// was changed (or removed) while it was down exposes exactly the last
// desired state again, before the control plane sends anything, and the
// section reports what it exposes.
func TestDevices_RestartRepairsDrift(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ss, obs := c.Converge(context.Background(), &agentv1.DesiredState{Generation: 3, Spec: fullSpec()})
	if obs != 3 {
		t.Fatalf("observed %d", obs)
	}
	if got := states(ss)["devices"].GetReason(); got != "exposes 2 GPUs: rsv_1 (GPU-b,GPU-a)" {
		t.Fatalf("devices reason %q", got)
	}
	want := readCDI(t, root)
	if want == nil || len(want.Devices) != 1 {
		t.Fatalf("cdi %+v", want)
	}

	for _, tamper := range []func() error{
		func() error { // a stale reservation left over
			return os.WriteFile(filepath.Join(root, converge.CDISpecFile), []byte(`{"cdiVersion":"0.6.0","kind":"bettercompute.com/gpu","devices":[{"name":"rsv_old","containerEdits":{"env":["NVIDIA_VISIBLE_DEVICES=GPU-c"]}}]}`), 0o644)
		},
		func() error { return os.Remove(filepath.Join(root, converge.CDISpecFile)) }, // removed
	} {
		if err := tamper(); err != nil {
			t.Fatal(err)
		}
		restarted := newConverger(t, root)
		if restarted.ObservedGeneration() != 3 {
			t.Fatalf("observed after restart %d", restarted.ObservedGeneration())
		}
		got := readCDI(t, root)
		if got == nil || len(got.Devices) != 1 || got.Devices[0].Name != "rsv_1" || got.Devices[0].ContainerEdits.Env[0] != want.Devices[0].ContainerEdits.Env[0] {
			t.Fatalf("after restart the node exposes %+v, want %+v", got, want)
		}
	}

	// Releasing everything removes the file, and a restart keeps it removed.
	ss, _ = c.Converge(context.Background(), &agentv1.DesiredState{Generation: 4, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: "node_1"}}})
	if got := states(ss)["devices"].GetReason(); got != "exposes no GPUs" {
		t.Fatalf("devices reason %q", got)
	}
	newConverger(t, root)
	if got := readCDI(t, root); got != nil {
		t.Fatalf("a released node exposes %+v after restart", got)
	}
}
