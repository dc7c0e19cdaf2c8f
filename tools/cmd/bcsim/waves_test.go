package main

import (
	"strings"
	"testing"
)

// TestWavesTimeAFleetChange: joining reports start no wave; a change is
// reported in progress until every node has moved past its generation,
// then once as done; repeated reports of one generation count once.
func TestWavesTimeAFleetChange(t *testing.T) {
	w := newWaves(3)
	for i := range 3 {
		w.observed(i, 1) // joined and converged
	}
	if line := w.report(); line != "" {
		t.Fatalf("after joining: %q, want no wave", line)
	}
	w.observed(0, 2)
	w.observed(0, 2)
	w.observed(1, 3) // a node may skip a generation
	if line := w.report(); !strings.Contains(line, "2/3 nodes") {
		t.Fatalf("in progress: %q", line)
	}
	w.observed(2, 2)
	if line := w.report(); !strings.Contains(line, "all 3 nodes") {
		t.Fatalf("done: %q", line)
	}
	if line := w.report(); line != "" {
		t.Fatalf("after the wave: %q, want nothing", line)
	}
	w.observed(0, 3) // the next change starts a new wave
	if line := w.report(); !strings.Contains(line, "1/3 nodes") {
		t.Fatalf("next wave: %q", line)
	}
}
