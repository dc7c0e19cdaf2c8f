package events_test

import (
	"flag"
	"os"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/events"
)

var update = flag.Bool("update", false, "rewrite docs/events.md from the catalog")

// TestEventsReference fails when docs/events.md is not what the catalog
// generates; -update rewrites it.
func TestEventsReference(t *testing.T) {
	const path = "../../docs/events.md"
	want := events.Reference()
	if *update {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./events -run TestEventsReference -update in pkg/)", err)
	}
	if string(got) != want {
		t.Fatalf("%s is stale: run go test ./events -run TestEventsReference -update in pkg/", path)
	}
}
