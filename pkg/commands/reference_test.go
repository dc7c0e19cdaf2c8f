package commands_test

import (
	"flag"
	"os"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/commands"
)

var update = flag.Bool("update", false, "rewrite docs/command-kinds.md from the registry")

// TestKindsReference fails when docs/command-kinds.md is not what the
// registry generates; -update rewrites it.
func TestKindsReference(t *testing.T) {
	const path = "../../docs/command-kinds.md"
	want := commands.Builtin().Reference()
	if *update {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./commands -run TestKindsReference -update in pkg/)", err)
	}
	if string(got) != want {
		t.Fatalf("%s is stale: run go test ./commands -run TestKindsReference -update in pkg/", path)
	}
}
