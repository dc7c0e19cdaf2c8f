package converge_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/state"
)

// TestConvergeWritesThroughConfigWrite: every file a convergence writes —
// the sections', the persisted desired state, the observed generation — goes
// through Config.Write, so a simulated node's store can skip the fsyncs; and
// an unsynced store still writes whole files.
func TestConvergeWritesThroughConfigWrite(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	st, err := state.OpenUnsynced(root)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var wrote []string
	c, err := converge.New(converge.Config{Root: root, NodeID: "node_1",
		GPUs: func(context.Context) ([]string, error) { return []string{"GPU-a", "GPU-b", "GPU-c"}, nil },
		Write: func(path string, data []byte, mode os.FileMode) error {
			mu.Lock()
			rel, _ := filepath.Rel(root, path)
			wrote = append(wrote, rel)
			mu.Unlock()
			return st.WriteAtomic(path, data, mode)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if _, obs := c.Converge(context.Background(), &agentv1.DesiredState{Generation: 1, Spec: fullSpec()}); obs != 1 {
		t.Fatalf("observed %d", obs)
	}
	for _, f := range []string{converge.SiteFile, converge.ObservedGenerationFile, converge.DesiredStateFile} {
		if !slices.Contains(wrote, f) {
			t.Errorf("%s was not written through Config.Write (wrote %v)", f, wrote)
		}
	}
	b, err := os.ReadFile(filepath.Join(root, converge.ObservedGenerationFile))
	if err != nil || string(b) != "1\n" {
		t.Fatalf("observed generation file %q, %v", b, err)
	}
	// No temporary file is left behind.
	entries, _ := os.ReadDir(root)
	for _, e := range entries {
		if len(e.Name()) > 0 && e.Name()[0] == '.' {
			t.Errorf("left %s", e.Name())
		}
	}
}
