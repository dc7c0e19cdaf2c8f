package cli_test

import (
	"os"
	"os/exec"
	"path"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/cli"
)

// composeService is the part of a Compose service this test reads.
type composeService struct {
	Image       string
	Build       *struct{ Target string }
	Command     []string
	Entrypoint  []string
	Environment map[string]string
	DependsOn   map[string]struct{ Condition string } `yaml:"depends_on"`
	Healthcheck *struct{ Test []string }
	Restart     string
	Ports       []string
	Volumes     []string
}

type compose struct {
	Services map[string]composeService
	Volumes  map[string]any
}

const (
	pkiMount    = "/var/lib/better-compute/pki"
	publicMount = "/var/lib/better-compute/pki-public"
)

// TestComposeFile checks compose.yaml without a Docker engine: every service
// the control plane needs is there; every better-compute command is one the
// CLI accepts, with real roles; every setting is a real configuration key
// and the configuration each service gets loads and validates; ports,
// volumes, dependencies and health checks hang together.
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
	for _, name := range []string{"postgres", "pgbouncer", "nats", "migrate", "pki", "pki-export", "gateway-cert", "api", "joinservice", "gateway",
		"nodespec-controller", "controllers", "placer", "command-sweeper", "outbox-relay", "vps", "enroll", "fleet"} {
		if _, ok := c.Services[name]; !ok {
			t.Fatalf("compose.yaml lacks service %q", name)
		}
	}
	for name, s := range c.Services {
		for _, v := range s.Volumes {
			if vol, _, _ := strings.Cut(v, ":"); !strings.HasPrefix(vol, ".") && !strings.HasPrefix(vol, "/") {
				if _, ok := c.Volumes[vol]; !ok {
					t.Errorf("%s mounts undeclared volume %q", name, vol)
				}
			}
		}
		for dep := range s.DependsOn {
			if _, ok := c.Services[dep]; !ok {
				t.Errorf("%s depends on a service %q that is not there", name, dep)
			}
		}
	}

	pg, pgb, nats := c.Services["postgres"], c.Services["pgbouncer"], c.Services["nats"]
	if !strings.HasPrefix(pg.Image, "postgres:15") || pg.Healthcheck == nil || !slices.Contains(pg.Healthcheck.Test, "pg_isready -U bc -d bc") {
		t.Errorf("postgres: image %q, healthcheck %+v", pg.Image, pg.Healthcheck)
	}
	if !strings.Contains(pgb.Image, "pgbouncer") || pgb.Environment["POOL_MODE"] != "transaction" || pgb.Environment["DB_HOST"] != "postgres" ||
		pgb.Environment["LISTEN_PORT"] != "6432" || pgb.DependsOn["postgres"].Condition != "service_healthy" || pgb.Healthcheck == nil {
		t.Errorf("pgbouncer must pool postgres in transaction mode on 6432, with a health check: %+v", pgb)
	}
	// database.idleInTransactionTimeout is not sent through PgBouncer; its
	// own idle_transaction_timeout must stand in for it.
	if v, err := strconv.Atoi(pgb.Environment["IDLE_TRANSACTION_TIMEOUT"]); err != nil || v <= 0 || v > 3600 {
		t.Errorf("pgbouncer IDLE_TRANSACTION_TIMEOUT %q, want 1–3600 seconds", pgb.Environment["IDLE_TRANSACTION_TIMEOUT"])
	}
	if !strings.HasPrefix(nats.Image, "nats:") || !slices.Contains(nats.Command, "--jetstream") || nats.Healthcheck == nil {
		t.Errorf("nats must run JetStream with a health check: %+v", nats)
	}
	mig := c.Services["migrate"]
	if mig.DependsOn["pgbouncer"].Condition != "service_healthy" || mig.Restart != "no" || !slices.Equal(mig.Command, []string{"migrate", "up"}) {
		t.Errorf("migrate must be a one-shot `migrate up` after a healthy pgbouncer: %+v", mig)
	}

	// The PKI one-shots: init into the pki volume, idempotent on restart;
	// export after it into the public volume.
	pki, export := c.Services["pki"], c.Services["pki-export"]
	if !slices.Equal(pki.Command[:4], []string{"pki", "init", "--dir", pkiMount}) || !slices.Contains(pki.Command, "--exist-ok") ||
		pki.Restart != "no" || !slices.Contains(pki.Volumes, "pki:"+pkiMount) {
		t.Errorf("pki must init %s in the pki volume, keeping it on restart: %+v", pkiMount, pki)
	}
	if !slices.Equal(export.Command, []string{"pki", "export", "--dir", pkiMount, "--out", publicMount}) ||
		export.DependsOn["pki"].Condition != "service_completed_successfully" || !slices.Contains(export.Volumes, "pki-public:"+publicMount) {
		t.Errorf("pki-export: %+v", export)
	}

	served := map[config.Role]bool{}
	for name, s := range c.Services {
		if s.Image != "better-compute:dev" {
			continue
		}
		if s.Build == nil || s.Build.Target != "control-plane" {
			t.Errorf("%s: no build of the control-plane target for the local image", name)
		}
		checkCommand(t, name, s.Command)
		cfg := composeConfig(t, name, s)
		if s.Environment["DATABASE_URL"] != "" {
			if !strings.Contains(cfg.Database.URL, "@pgbouncer:6432/") || !cfg.Database.PgBouncer {
				t.Errorf("%s must reach the database through pgbouncer with database.pgbouncer: %q, %v", name, cfg.Database.URL, cfg.Database.PgBouncer)
			}
		}
		for _, v := range s.Volumes {
			if strings.HasPrefix(v, "pki:") && name != "pki" && !strings.HasSuffix(v, ":ro") {
				t.Errorf("%s mounts the pki volume writable: %q", name, v)
			}
		}
		if s.Restart == "no" {
			continue
		}
		if s.Command[0] != "serve" {
			t.Errorf("%s: a long-running service that does not serve: %v", name, s.Command)
			continue
		}
		roles := serveRoles(t, name, s.Command)
		for _, r := range roles {
			served[r] = true
		}
		for dep, cond := range map[string]string{"migrate": "service_completed_successfully", "nats": "service_healthy", "pki": "service_completed_successfully"} {
			if s.DependsOn[dep].Condition != cond {
				t.Errorf("%s must start after %s is %s: %+v", name, dep, cond, s.DependsOn)
			}
		}
		if !slices.Contains(s.Command, "--no-migrate") {
			t.Errorf("%s must not migrate (the one-shot does): %v", name, s.Command)
		}
		if s.Healthcheck == nil || len(s.Healthcheck.Test) < 3 {
			t.Fatalf("%s has no health check", name)
		}
		// The image is distroless: the check is the binary's own probe of
		// the port it serves.
		test := s.Healthcheck.Test
		if test[0] != "CMD" || test[1] != "/usr/local/bin/better-compute" {
			t.Errorf("%s health check %v", name, test)
		}
		checkCommand(t, name+" healthcheck", test[2:])
		if want := "http://127.0.0.1:" + flagValue(s.Command, "--port") + "/readyz"; test[len(test)-1] != want {
			t.Errorf("%s health check probes %s, want %s", name, test[len(test)-1], want)
		}
		checkKeys(t, name, s, cfg, roles)
	}
	for _, r := range append(slices.Clone(config.BuiltRoles), config.RoleJoinService) {
		if !served[r] {
			t.Errorf("no service runs the %s role", r)
		}
	}

	// The gateway: its daemon port published, and no key material at all.
	gw := c.Services["gateway"]
	gwCfg := composeConfig(t, "gateway", gw)
	_, port, _ := strings.Cut(gwCfg.Gateway.Listen, ":")
	if port == "" || !slices.Contains(gw.Ports, port+":"+port) {
		t.Errorf("the gateway listens on %q but publishes %v", gwCfg.Gateway.Listen, gw.Ports)
	}
	if slices.ContainsFunc(gw.Volumes, func(v string) bool { return strings.HasPrefix(v, "pki:") }) ||
		gwCfg.JoinService.CAKeyFile != "" || gwCfg.JoinService.HPKEKeyFile != "" || gwCfg.Commands.SigningKeyFile != "" {
		t.Errorf("the gateway holds keys: %+v", gw)
	}
	js := composeConfig(t, "joinservice", c.Services["joinservice"])
	_, jsPort, _ := strings.Cut(js.JoinService.Listen, ":")
	if len(gwCfg.Gateway.JoinService) == 0 || gwCfg.Gateway.JoinService[0] != "joinservice:"+jsPort || gw.DependsOn["joinservice"].Condition != "service_healthy" ||
		!slices.Contains(js.JoinService.Hosts, "joinservice") {
		t.Errorf("the gateway must relay to a healthy joinservice at its listener %q: %v", js.JoinService.Listen, gwCfg.Gateway.JoinService)
	}
	// Its own certificate, from the gateway-cert one-shot, for its id and
	// the name daemons dial.
	gc := c.Services["gateway-cert"]
	tlsDir := flagValue(gc.Command, "--out")
	if gc.Command[1] != "gateway-cert" || flagValue(gc.Command, "--dir") != pkiMount || flagValue(gc.Command, "--id") != gwCfg.Gateway.ID ||
		!slices.Contains(gc.Command, "gateway") || gc.Restart != "no" {
		t.Errorf("gateway-cert: %v", gc.Command)
	}
	tls := gwCfg.Gateway.TLS
	if tls.CertFile != path.Join(tlsDir, cli.PKIGatewayCert) || tls.KeyFile != path.Join(tlsDir, cli.PKIGatewayKey) || tls.CAFile != path.Join(tlsDir, cli.PKIExportCA) ||
		gw.DependsOn["gateway-cert"].Condition != "service_completed_successfully" || !slices.Contains(gw.Volumes, "gateway-tls:"+tlsDir+":ro") {
		t.Errorf("the gateway's tls %+v, volumes %v, want the files gateway-cert writes to %s", tls, gw.Volumes, tlsDir)
	}
	if !slices.Contains(c.Services["api"].Ports, "8080:8080") {
		t.Error("the api port is not published")
	}

	// The fleet: bcsim against the gateway's port with the exported files
	// and the token enroll keeps.
	enroll, fleet := c.Services["enroll"], c.Services["fleet"]
	for name, s := range map[string]composeService{"enroll": enroll, "fleet": fleet} {
		if s.Build == nil || s.Build.Target != "tools" || s.Entrypoint[0] != "/busybox/sh" {
			t.Errorf("%s must run in the tools image's shell: %+v", name, s)
		}
	}
	if enroll.Restart != "no" || enroll.DependsOn["api"].Condition != "service_healthy" || !strings.HasSuffix(enroll.Entrypoint[1], "/compose-enroll.sh") {
		t.Errorf("enroll: %+v", enroll)
	}
	fleetCmd := strings.Join(fleet.Entrypoint, " ")
	for _, want := range []string{"/usr/local/bin/bcsim ", "--gateway gateway:" + port, "--ca " + path.Join(publicMount, cli.PKIExportCA),
		"--joinservice-key " + path.Join(publicMount, cli.PKIExportJoin), "--token ", enroll.Environment["FLEET_DIR"] + "/join-token", "--nodes " + enroll.Environment["FLEET_NODES"]} {
		if !strings.Contains(fleetCmd, want) {
			t.Errorf("fleet's command lacks %q: %s", want, fleetCmd)
		}
	}
	for dep, cond := range map[string]string{"enroll": "service_completed_successfully", "pki-export": "service_completed_successfully", "gateway": "service_healthy"} {
		if fleet.DependsOn[dep].Condition != cond {
			t.Errorf("fleet must start after %s is %s: %+v", dep, cond, fleet.DependsOn)
		}
	}
	if !slices.Contains(fleet.Volumes, "pki-public:"+publicMount+":ro") {
		t.Errorf("fleet does not mount the export: %v", fleet.Volumes)
	}

	docker, err := os.ReadFile("../../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`ENTRYPOINT ["/usr/local/bin/better-compute"]`, " AS control-plane", " AS tools", "./cmd/bcsim",
		"COPY deploy/compose-enroll.sh /usr/local/share/better-compute/compose-enroll.sh"} {
		if !strings.Contains(string(docker), want) {
			t.Errorf("deploy/Dockerfile lacks %q", want)
		}
	}
	if sh, err := exec.LookPath("sh"); err == nil {
		if out, err := exec.Command(sh, "-n", "../../deploy/compose-enroll.sh").CombinedOutput(); err != nil {
			t.Errorf("deploy/compose-enroll.sh: %v: %s", err, out)
		}
	}
}

// composeConfig loads the configuration a better-compute service of
// compose.yaml gets: its environment (every variable a real setting) and its
// flags, then defaults and validation.
func composeConfig(t *testing.T, name string, s composeService) *config.Config {
	t.Helper()
	known := map[string]bool{}
	for _, v := range config.EnvVars() {
		for n := range strings.SplitSeq(v[1], ", ") {
			known[n] = true
		}
	}
	for k := range s.Environment {
		if !known[k] {
			t.Errorf("%s sets %s, which is no configuration setting", name, k)
		}
	}
	cfg, err := config.Load(config.LoadOptions{LookupEnv: func(k string) (string, bool) {
		v, ok := s.Environment[k]
		return v, ok
	}})
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if p := flagValue(s.Command, "--port"); p != "" {
		n, err := config.ParsePort(p)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		cfg.Server.Port = &n
	}
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		t.Errorf("%s: its configuration does not validate: %v", name, err)
	}
	return cfg
}

// checkKeys checks the key files a service is configured with: the
// roles that need them have them, each is a file pki init writes, in the pki
// volume the service mounts.
func checkKeys(t *testing.T, name string, s composeService, cfg *config.Config, roles []config.Role) {
	t.Helper()
	has := func(r config.Role) bool { return slices.Contains(roles, r) }
	files := map[string]string{}
	if has(config.RoleJoinService) {
		if err := cfg.RequireJoinServiceKeys(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		files[cfg.JoinService.CACertFile] = cli.PKINodeCACert
		files[cfg.JoinService.CAKeyFile] = cli.PKINodeCAKey
		files[cfg.JoinService.HPKEKeyFile] = cli.PKIHPKEKey
	}
	if has(config.RoleAPI) || has(config.RoleControllers) || has(config.RoleMetal) {
		files[cfg.Commands.SigningKeyFile] = cli.PKICommandKey
		files[cfg.Audit.SigningKeyFile] = cli.PKIAuditKey
	}
	if has(config.RoleAPI) || has(config.RoleMetal) || has(config.RoleVPS) {
		files[cfg.Secrets.KeyFile] = cli.PKISecretsKey
	}
	for file, want := range files {
		if file != path.Join(pkiMount, want) {
			t.Errorf("%s: key file %q, want %s as pki init writes it", name, file, path.Join(pkiMount, want))
		}
	}
	if len(files) > 0 && !slices.Contains(s.Volumes, "pki:"+pkiMount+":ro") {
		t.Errorf("%s uses keys but does not mount the pki volume read-only: %v", name, s.Volumes)
	}
	if len(files) == 0 && slices.ContainsFunc(s.Volumes, func(v string) bool { return strings.HasPrefix(v, "pki:") }) {
		t.Errorf("%s mounts the pki volume but uses no key", name)
	}
}

func flagValue(args []string, name string) string {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
	}
	return ""
}

// serveRoles returns the roles of a serve command line.
func serveRoles(t *testing.T, where string, args []string) []config.Role {
	t.Helper()
	roles, err := config.ParseRoles(strings.Split(flagValue(args, "--roles"), ","))
	if err != nil {
		t.Errorf("%s: %v", where, err)
	}
	return roles
}

// checkCommand parses args as the better-compute CLI would, without running
// them, and checks serve's roles are built.
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
