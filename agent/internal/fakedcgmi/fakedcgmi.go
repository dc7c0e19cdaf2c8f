// Package fakedcgmi writes a stand-in for DCGM's dcgmi binary, for tests:
// a shell script that records its arguments, prints recorded `dcgmi diag
// -j` output and exits with a given status.
package fakedcgmi

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Pass is dcgmi diag -r 1 -j on two GPUs (ids 0 and 1) where every test
// passed, in DCGM 3.x's JSON shape (the version, the deployment checks
// node-wide, the others per GPU).
const Pass = `{
  "DCGM GPU Diagnostic" : {
    "test_categories" : [
      { "category" : "Deployment", "tests" : [
        { "name" : "Denylist", "results" : [ { "status" : "Pass" } ] },
        { "name" : "NVML Library", "results" : [ { "status" : "Pass" } ] },
        { "name" : "Environmental Variables", "results" : [ { "status" : "Pass" } ] }
      ] },
      { "category" : "Integration", "tests" : [
        { "name" : "PCIe", "results" : [ { "gpu_ids" : "0", "status" : "Pass" }, { "gpu_ids" : "1", "status" : "Pass" } ] }
      ] },
      { "category" : "Hardware", "tests" : [
        { "name" : "GPU Memory", "results" : [ { "gpu_ids" : "0", "status" : "Pass" }, { "gpu_ids" : "1", "status" : "Skip" } ] }
      ] }
    ]
  },
  "version" : "3.3.5"
}`

// FailPCIe is like Pass but the PCIe test failed on GPU 1, with a
// warning; dcgmi exits non-zero with it.
const FailPCIe = `{
  "DCGM GPU Diagnostic" : {
    "test_categories" : [
      { "category" : "Deployment", "tests" : [
        { "name" : "Denylist", "results" : [ { "status" : "Pass" } ] }
      ] },
      { "category" : "Integration", "tests" : [
        { "name" : "PCIe", "results" : [
          { "gpu_ids" : "0", "status" : "Pass" },
          { "gpu_ids" : "1", "status" : "Fail", "warnings" : [ { "warning" : "GPU 1 PCIe replay count 250 above 8", "error_id" : 31, "error_category" : 4, "error_severity" : 2 } ] }
        ] }
      ] }
    ]
  },
  "version" : "3.3.5"
}`

// Fake is a fake dcgmi under a test's temp dir.
type Fake struct {
	// Path is the script, to pass as the dcgmi binary.
	Path string
	dir  string
}

// New writes a fake dcgmi that prints output and exits with code.
func New(t testing.TB, output string, code int) *Fake {
	t.Helper()
	dir := t.TempDir()
	f := &Fake{Path: filepath.Join(dir, "dcgmi"), dir: dir}
	if err := os.WriteFile(filepath.Join(dir, "out"), []byte(output), 0o600); err != nil {
		t.Fatal(err)
	}
	script := fmt.Sprintf("#!/bin/sh\nprintf '%%s\\n' \"$*\" >> '%s'\ncat '%s'\nexit %d\n",
		filepath.Join(dir, "calls"), filepath.Join(dir, "out"), code)
	if err := os.WriteFile(f.Path, []byte(script), 0o700); err != nil { //nolint:gosec // an executable, in a test's temp dir
		t.Fatal(err)
	}
	return f
}

// Calls returns each run's arguments, space-separated, oldest first.
func (f *Fake) Calls(t testing.TB) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(f.dir, "calls"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}
