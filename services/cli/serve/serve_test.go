package serve_test

import (
	"bytes"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wantGateway is what the gateway deployable says with a database and no
// node CA: its own role's requirement.
const wantGateway = "error: INVALID_CONFIG joinService.caCertFile: required"

func TestDeployableFixesItsRole(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
	var out, errb bytes.Buffer
	cmd := serve.Deployable("gateway", &out, &errb)
	cmd.SetArgs([]string{"--port", "0"})
	code := serve.Report(&errb, cmd.ExecuteContext(t.Context()))
	// The gateway's own requirement, checked before the database is
	// dialled: the role is the deployable's.
	if code != serve.ExitConfig || !strings.Contains(errb.String(), wantGateway) {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
}

func TestDeployableTakesServeFlagsButNotRoles(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"bad port", []string{"--port", "70000"}, "error: INVALID_CONFIG server.port"},
		{"bad log level", []string{"--log-level", "loud"}, "error: INVALID_CONFIG log.level"},
		{"no roles flag of its own", []string{"--roles", "api"}, wantGateway},
		{"unknown flag", []string{"--rolez", "api"}, "unknown flag: --rolez"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			cmd := serve.Deployable("gateway", &out, &errb)
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
