package dev_test

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/dev"
)

func TestMain(m *testing.M) {
	// TestTunnelOpenSSH's ssh runs this binary as its ProxyCommand
	// (`better-compute tunnel --stdio`).
	if os.Getenv(asCLI) == "1" {
		os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
	}
	pgtest.Main(m)
}

func TestDevBootsAndAnswers(t *testing.T) {
	t.Parallel()
	port := 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir()},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	env, err := dev.StartRun(t.Context(), cfg, nil, dev.RunOptions{SimMig: true})
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop(context.Background())

	if !strings.HasPrefix(env.NATSURL, "nats://127.0.0.1:") {
		t.Fatalf("dev did not embed NATS: %q", env.NATSURL)
	}
	if _, err := os.Stat(filepath.Join(cfg.Dev.DataDir, "nats")); err != nil {
		t.Fatalf("NATS store is not under the data dir: %v", err)
	}
	banner := env.Banner()
	for _, want := range []string{env.BaseURL() + "/readyz", env.BaseURL() + "/api/compute/openapi.json", env.BaseURL() + "/console/", env.BaseURL() + "/mcp", env.NATSURL, "roles: api", "3 simulated nodes", "3 simulated machines", "metal.list tenantId=root",
		"2 simulated hosts", "fake provider at http://127.0.0.1:", "better-compute tunnel " + env.Fleet.Nodes()[0], "instances.create tenantId=root poolId=" + env.VPSPoolID} {
		if !strings.Contains(banner, want) {
			t.Errorf("banner lacks %q:\n%s", want, banner)
		}
	}

	resp, err := http.Get(env.BaseURL() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	var rep struct {
		Ready, Degraded bool
	}
	if err := json.Unmarshal(body, &rep); err != nil || resp.StatusCode != http.StatusOK || !rep.Ready || rep.Degraded {
		t.Fatalf("readyz %d %s: the embedded bus must be up too", resp.StatusCode, body)
	}

	resp, err = http.Post(env.BaseURL()+"/api/compute/system/version", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"requiredSchemaVersion"`) {
		t.Fatalf("REST version %d %s", resp.StatusCode, body)
	}

	conn, err := grpc.NewClient(env.App.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	v, err := computev1.NewSystemServiceClient(conn).Version(t.Context(), &computev1.VersionRequest{})
	if err != nil || v.GetSchemaVersion() != migrate.Latest() {
		t.Fatalf("gRPC version = %v, %v", v, err)
	}

	// The simulated fleet joins through the real gateway and is adopted.
	if len(env.Fleet.Nodes()) != 3 {
		t.Fatalf("fleet %v", env.Fleet.Nodes())
	}
	poll.UntilNil(t, 30*time.Second, "the simulated fleet to be adopted", func() error {
		var list struct {
			Nodes []struct {
				ID, State string
				Devices   []struct{ ID string }
			}
		}
		call(t, env, "nodes/list", map[string]any{"tenantId": "root"}, &list)
		adopted := 0
		for _, n := range list.Nodes {
			if slices.Contains(env.Fleet.Nodes(), n.ID) && n.State == "adopted" && len(n.Devices) == 8 {
				adopted++
			}
		}
		if adopted == 3 {
			return nil
		}
		return fmt.Errorf("%+v", list)
	})

	// The pool wires a container runtime (set before the fleet joins, so
	// from generation 1): every simulated node's spec has the runtime
	// section, and each node applies it (its observed generation reaches
	// the spec's, whatever the section's own state).
	for _, node := range env.Fleet.Nodes() {
		poll.UntilNil(t, 30*time.Second, "node "+node+" applying the pool's runtime settings", func() error {
			var got struct {
				Node struct {
					Generation, ObservedGeneration string
				}
			}
			call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &got)
			n := got.Node
			if n.Generation == "0" || n.ObservedGeneration != n.Generation {
				return fmt.Errorf("%+v", n)
			}
			return nil
		})
		var spec struct {
			Spec struct {
				Runtime struct{ Engines, CdiSpecDirs []string }
			}
		}
		call(t, env, "nodes/getSpec", map[string]any{"tenantId": "root", "nodeId": node}, &spec)
		if rt := spec.Spec.Runtime; !slices.Equal(rt.Engines, []string{"containerd"}) || !slices.Equal(rt.CdiSpecDirs, []string{"/var/run/cdi"}) {
			t.Fatalf("node %s's runtime section %+v", node, rt)
		}
	}

	// The first simulated node carries a MIG layout on its GPU 0, which
	// its mock NVML has once the node observed its generation.
	node := env.Fleet.Nodes()[0]
	var spec struct {
		Spec struct {
			Mig struct {
				Gpus []struct {
					GpuUuid   string
					Instances []struct{ Profile string }
				}
			}
		}
	}
	call(t, env, "nodes/getSpec", map[string]any{"tenantId": "root", "nodeId": node}, &spec)
	if g := spec.Spec.Mig.Gpus; len(g) != 1 || len(g[0].Instances) != 4 {
		t.Fatalf("node %s's mig section %+v", node, spec.Spec.Mig)
	}
	poll.UntilNil(t, 30*time.Second, "node "+node+" laying its GPU 0 out", func() error {
		l, err := env.Fleet.Inventory(0).MIGLayout(spec.Spec.Mig.Gpus[0].GpuUuid)
		if err != nil || len(l.Instances) != 4 || l.Instances[0].UUID == "" {
			return fmt.Errorf("%v %v", l, err)
		}
		return nil
	})
}

// TestDevBinary runs the real better-compute binary: `dev` prints its URLs,
// serves /readyz, and exits 0 on SIGTERM.
func TestDevBinary(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "better-compute")
	build := exec.Command("go", "build", "-o", bin, "github.com/bettercompute/bettercompute/services/cmd/better-compute")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	// Prometheus, where installed, is TestDevPrometheus's.
	cmd := exec.Command(bin, "dev", "--port", "0", "--log-level", "warn", "--prometheus=false")
	cmd.Env = append(os.Environ(), "BC_DATABASE_URL="+pgtest.NewDB(t), "BC_DEV_DATA_DIR="+t.TempDir(), "BC_CONFIG=", "BC_GATEWAY_LISTEN=127.0.0.1:0")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill() }()

	readyz := regexp.MustCompile(`(http://127\.0\.0\.1:\d+)/readyz`)
	base := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := readyz.FindStringSubmatch(sc.Text()); m != nil {
				base <- m[1]
			}
		}
		close(base)
	}()
	var url string
	select {
	case u, ok := <-base:
		if !ok {
			t.Fatalf("dev exited without printing its URLs:\n%s", stderr.String())
		}
		url = u
	case <-time.After(2 * time.Minute):
		t.Fatalf("dev printed no URLs:\n%s", stderr.String())
	}
	resp, err := http.Get(url + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("readyz = %d", resp.StatusCode)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("dev exited with %v after SIGTERM:\n%s", err, stderr.String())
		}
	case <-time.After(time.Minute):
		t.Fatal("dev did not exit after SIGTERM")
	}
	if resp, err := http.Get(url + "/healthz"); err == nil {
		_ = resp.Body.Close()
		t.Fatal("still serving after exit")
	}
}

func TestDevKeepsItsRootCredential(t *testing.T) {
	t.Parallel()
	port := 0
	dir := t.TempDir()
	url := pgtest.NewDB(t)
	startDev := func() *dev.Env {
		t.Helper()
		cfg := &config.Config{
			Database: config.Database{URL: url},
			Server:   config.Server{Host: "127.0.0.1", Port: &port},
			Dev:      config.Dev{DataDir: dir},
			Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
		}
		cfg.Defaults()
		env, err := dev.Start(t.Context(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		return env
	}

	first := startDev()
	if !first.CredentialNew || !strings.HasPrefix(first.Credential, "bck_") || !strings.Contains(first.Banner(), first.Credential) {
		t.Fatalf("first start: new=%v %q\n%s", first.CredentialNew, first.Credential, first.Banner())
	}
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, first.BaseURL()+"/api/compute/system/whoAmI", strings.NewReader("{}"))
	req.Header.Set("Authorization", "Bearer "+first.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"tenantId":"root"`) {
		t.Fatalf("whoAmI with the dev credential: %d %s", resp.StatusCode, body)
	}
	if fi, err := os.Stat(filepath.Join(dir, dev.CredentialFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("credential file: %v %v", fi, err)
	}
	first.Stop(context.Background())

	second := startDev()
	defer second.Stop(context.Background())
	if second.CredentialNew || second.Credential != first.Credential {
		t.Fatalf("a later start keeps the credential: new=%v %q", second.CredentialNew, second.Credential)
	}
	// Security review 13 #18: the root credential was printed on every
	// start. A later start's banner names only the file keeping it.
	if banner := second.Banner(); strings.Contains(banner, first.Credential) || !strings.Contains(banner, filepath.Join(dir, dev.CredentialFile)) {
		t.Fatalf("a later start's banner shows the credential or not its file:\n%s", banner)
	}
	if banner := first.Banner(); !strings.Contains(banner, "shown this once") || !strings.Contains(banner, filepath.Join(dir, dev.CredentialFile)) {
		t.Fatalf("the first start's banner:\n%s", banner)
	}
	// The command-signing key is made once and kept too.
	if len(first.CommandKey) != ed25519.PublicKeySize || !first.CommandKey.Equal(second.CommandKey) {
		t.Fatalf("command key %x, then %x", first.CommandKey, second.CommandKey)
	}
}
