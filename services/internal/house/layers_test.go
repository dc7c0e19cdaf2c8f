package house_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"slices"
	"testing"

	"github.com/bettercompute/bettercompute/services/internal/house"
)

const m = house.Module

func TestLateralFindsPlantedEdges(t *testing.T) {
	t.Parallel()
	got := house.Lateral(map[string][]string{
		m + "/api":         {m + "/inventory", "github.com/bettercompute/bettercompute/pkg/nodes", "context"},
		m + "/lifecycle":   {m + "/capacity"},
		m + "/console":     {m + "/api", m + "/app"},
		m + "/mcpserver":   {m + "/api"},
		m + "/app":         {m + "/api", m + "/dev"},
		m + "/cmd/api":     {m + "/app"},
		m + "/chaos":       {m + "/dev"},
		m + "/gateway":     {m + "/gateway/internal/x"},
		m + "/joinservice": {"github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"},
	})
	want := []house.Edge{
		{From: m + "/api", To: m + "/inventory"},
		{From: m + "/console", To: m + "/app"},
		{From: m + "/lifecycle", To: m + "/capacity"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("Lateral = %v, want %v", got, want)
	}
}

// TestRolesAreLeaves reads the imports of every non-test file of every
// package of the services module and fails on a role importing another.
func TestRolesAreLeaves(t *testing.T) {
	t.Parallel()
	cmd := exec.CommandContext(t.Context(), "go", "list", "-json=ImportPath,Imports", m+"/...")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	imports := map[string][]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath string
			Imports    []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		imports[p.ImportPath] = p.Imports
	}
	if len(imports) < 20 || imports[m+"/api"] == nil {
		t.Fatalf("go list named %d packages; expected the whole services module", len(imports))
	}
	for _, e := range house.Lateral(imports) {
		t.Errorf("%v: role packages are leaves; move what they share into pkg/", e)
	}
}
