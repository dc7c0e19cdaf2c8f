package serve_test

import (
	"bytes"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestDeployableFixesItsRole(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	t.Setenv("DATABASE_URL", "")
	var out, errb bytes.Buffer
	cmd := serve.Deployable("iam", &out, &errb)
	cmd.SetArgs([]string{"--port", "0"})
	code := serve.Report(&errb, cmd.ExecuteContext(t.Context()))
	// The database check comes after roles: iam is not built yet.
	if code != serve.ExitConfig || !strings.Contains(errb.String(), `role "iam" is not built yet`) {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
}

func TestDeployableTakesServeFlagsButNotRoles(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	t.Setenv("DATABASE_URL", "")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"bad port", []string{"--port", "70000"}, "error: INVALID_CONFIG server.port"},
		{"bad log level", []string{"--log-level", "loud"}, "error: INVALID_CONFIG log.level"},
		{"no roles flag of its own", []string{"--roles", "gateway"}, `role "iam" is not built yet`},
		{"unknown flag", []string{"--rolez", "api"}, "unknown flag: --rolez"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			cmd := serve.Deployable("iam", &out, &errb)
			cmd.SetArgs(tc.args)
			code := serve.Report(&errb, cmd.ExecuteContext(t.Context()))
			if code != serve.ExitConfig || !strings.Contains(errb.String(), tc.want) {
				t.Fatalf("exit %d, stderr:\n%s\nwant exit %d and %q", code, errb.String(), serve.ExitConfig, tc.want)
			}
		})
	}
}

func TestDeployableVersion(t *testing.T) {
	var out, errb bytes.Buffer
	cmd := serve.Deployable("api", &out, &errb)
	cmd.SetArgs([]string{"version"})
	if code := serve.Report(&errb, cmd.ExecuteContext(t.Context())); code != serve.ExitOK || !strings.HasPrefix(out.String(), "better-compute ") {
		t.Fatalf("exit %d %q %s", code, out.String(), errb.String())
	}
}
