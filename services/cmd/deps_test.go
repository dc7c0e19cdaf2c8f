// Package cmd_test checks what the mains under services/cmd link: each
// deployable links only what it runs, never the dev environment or the
// simulators and fakes it starts.
package cmd_test

import (
	"bytes"
	"maps"
	"os"
	"os/exec"
	"path"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const module = "github.com/bettercompute/bettercompute/"

// forbidden are the packages no deployable may link, as go's patterns: "/..."
// takes in the subpackages. The full CLI brings the rest in; only dev runs
// the simulated nodes, the fake BMCs and the PXE server.
var forbidden = []string{
	module + "services/cli", // the full CLI; a deployable's main imports services/cli/serve
	module + "services/dev/...",
	module + "agent/sim/...",
	module + "agent/site/fakebmc/...",
	module + "agent/site/pxe/...",
}

// full is the one main that runs everything, dev included.
const full = module + "services/cmd/better-compute"

// links returns, for each main under this directory, the packages it links
// (go list's Deps), listed for linux/amd64 with cgo and no extra build tags
// so the answer is the same on every machine.
func links(t *testing.T) map[string][]string {
	t.Helper()
	cmd := exec.Command("go", "list", "-f", `{{if eq .Name "main"}}{{.ImportPath}}{{range .Deps}} {{.}}{{end}}{{end}}`, "./...")
	cmd.Env = append(os.Environ(), "GOOS=linux", "GOARCH=amd64", "CGO_ENABLED=1", "GOFLAGS=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	mains := map[string][]string{}
	for line := range strings.Lines(string(out)) {
		fields := strings.Fields(line)
		if len(fields) > 0 {
			mains[fields[0]] = fields[1:]
		}
	}
	return mains
}

// forbiddenIn returns the packages of deps that a forbidden pattern matches.
func forbiddenIn(deps []string) []string {
	var found []string
	for _, d := range deps {
		if slices.ContainsFunc(forbidden, func(pattern string) bool { return matches(pattern, d) }) {
			found = append(found, d)
		}
	}
	return found
}

// matches reports whether pkg is pattern, or under it when pattern ends in
// "/...".
func matches(pattern, pkg string) bool {
	if tree, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == tree || strings.HasPrefix(pkg, tree+"/")
	}
	return pkg == pattern
}

func TestDeployablesLinkOnlyWhatTheyRun(t *testing.T) {
	mains := links(t)
	deployables := 0
	for name, deps := range mains {
		if name == full {
			continue
		}
		deployables++
		if bad := forbiddenIn(deps); len(bad) > 0 {
			t.Errorf("%s links %s: a deployable's main builds its command with services/cli/serve, and nothing its roles run may import these",
				path.Base(name), strings.Join(bad, ", "))
		}
	}
	if deployables < 10 {
		t.Errorf("found %d deployable mains under services/cmd, want every role's (api, gateway, …): %v", deployables, slices.Sorted(maps.Keys(mains)))
	}

	// The check proves itself on better-compute, which runs dev and so must
	// link what the deployables must not.
	deps, ok := mains[full]
	if !ok {
		t.Fatalf("go list did not list %s", full)
	}
	if bad := forbiddenIn(deps); !slices.Contains(bad, module+"services/dev") || !slices.Contains(bad, module+"agent/site/fakebmc") {
		t.Errorf("the check finds %v in better-compute, which runs dev: it would miss a deployable that linked dev", bad)
	}
}
