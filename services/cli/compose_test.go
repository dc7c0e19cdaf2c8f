package cli_test

import (
	"os"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/cli"
)

// compose is the part of a Compose file this test reads.
type compose struct {
	Services map[string]struct {
		Image       string
		Build       any
		Command     []string
		Environment map[string]string
		DependsOn   map[string]struct{ Condition string } `yaml:"depends_on"`
		Healthcheck *struct{ Test []string }
		Restart     string
	}
	Volumes map[string]any
}

// TestComposeFile checks compose.yaml without a Docker engine: its services,
// images, dependencies and health checks, and that every better-compute
// command in it is one the CLI accepts.
func TestComposeFile(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../compose.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var c compose
	if err := yaml.Unmarshal(b, &c); err != nil {
		t.Fatalf("compose.yaml: %v", err)
	}
	for _, name := range []string{"postgres", "nats", "migrate", "api"} {
		if _, ok := c.Services[name]; !ok {
			t.Fatalf("compose.yaml lacks service %q", name)
		}
	}

	pg, nats := c.Services["postgres"], c.Services["nats"]
	if !strings.HasPrefix(pg.Image, "postgres:15") || pg.Healthcheck == nil || !slices.Contains(pg.Healthcheck.Test, "pg_isready -U bc -d bc") {
		t.Errorf("postgres: image %q, healthcheck %+v", pg.Image, pg.Healthcheck)
	}
	if !strings.HasPrefix(nats.Image, "nats:") || !slices.Contains(nats.Command, "--jetstream") || nats.Healthcheck == nil {
		t.Errorf("nats must run JetStream with a health check: %+v", nats)
	}

	mig := c.Services["migrate"]
	if mig.DependsOn["postgres"].Condition != "service_healthy" || mig.Restart != "no" {
		t.Errorf("migrate must be one-shot after a healthy postgres: %+v", mig)
	}
	if !slices.Equal(mig.Command, []string{"migrate", "up"}) {
		t.Errorf("migrate command %v", mig.Command)
	}

	for name, s := range c.Services {
		if s.Image != "better-compute:dev" {
			continue
		}
		if s.Build == nil {
			t.Errorf("%s: no build section for the local image", name)
		}
		if !strings.HasPrefix(s.Environment["DATABASE_URL"], "postgres://") {
			t.Errorf("%s: DATABASE_URL = %q", name, s.Environment["DATABASE_URL"])
		}
		checkCommand(t, name, s.Command)
		if name == "migrate" {
			continue
		}
		if s.DependsOn["migrate"].Condition != "service_completed_successfully" || s.DependsOn["nats"].Condition != "service_healthy" {
			t.Errorf("%s must start after migrate completes and nats is healthy: %+v", name, s.DependsOn)
		}
		if !slices.Contains(s.Command, "--no-migrate") {
			t.Errorf("%s must not migrate (the one-shot does): %v", name, s.Command)
		}
		if s.Healthcheck == nil || len(s.Healthcheck.Test) < 3 {
			t.Fatalf("%s has no health check", name)
		}
		// The image is distroless: the check is the binary's own probe.
		test := s.Healthcheck.Test
		if test[0] != "CMD" || test[1] != "/usr/local/bin/better-compute" {
			t.Errorf("%s health check %v", name, test)
		}
		checkCommand(t, name+" healthcheck", test[2:])
		if !strings.HasSuffix(test[len(test)-1], "/readyz") {
			t.Errorf("%s health check should probe /readyz: %v", name, test)
		}
	}

	docker, err := os.ReadFile("../../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(docker), `ENTRYPOINT ["/usr/local/bin/better-compute"]`) {
		t.Error("deploy/Dockerfile must have better-compute as its entrypoint")
	}
}

// checkCommand parses args as the better-compute CLI would, without running
// them, and checks serve's roles.
func checkCommand(t *testing.T, where string, args []string) {
	t.Helper()
	root := cli.NewRoot(nil, nil)
	cmd, rest, err := root.Find(args)
	if err != nil || cmd == root {
		t.Errorf("%s: %v is not a better-compute command: %v", where, args, err)
		return
	}
	if err := cmd.ParseFlags(rest); err != nil {
		t.Errorf("%s: %v: %v", where, args, err)
		return
	}
	if cmd.Name() == "serve" {
		roles, err := cmd.Flags().GetStringSlice("roles")
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := app.ResolveRoles(roles); err != nil {
			t.Errorf("%s: %v", where, err)
		}
	}
}
