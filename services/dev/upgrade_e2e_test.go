package dev_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/dev"
)

// signedBuild serves a simulated build of version at base/<version> (srv)
// and returns its signed manifest's JSON text.
func signedBuild(t *testing.T, key ed25519.PrivateKey, base, version string, counter uint64) string {
	t.Helper()
	build := []byte("simulated bcd " + version)
	sum := sha256.Sum256(build)
	m := &agentrelease.Manifest{Version: version, URL: base + "/" + version, SHA256: hex.EncodeToString(sum[:]), Size: int64(len(build)),
		Platform: runtime.GOOS + "/" + runtime.GOARCH, NotAfter: time.Now().Add(time.Hour), Counter: counter}
	if err := agentrelease.Sign(m, key); err != nil {
		t.Fatal(err)
	}
	b, err := agentrelease.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// agentVersions counts ids' nodes by the version their Hello reported.
func agentVersions(t *testing.T, db *pgxpool.Pool, ids []string) map[string]int {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT agent_version, count(*) FROM nodes WHERE id = ANY($1) GROUP BY agent_version`, ids)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var v string
		var n int
		if err := rows.Scan(&v, &n); err != nil {
			t.Fatal(err)
		}
		out[v] = n
	}
	return out
}

// TestAgentUpgradeRollout upgrades a pool's simulated nodes (bcd's real
// installer, a simulated handover: agent/sim) as a rollout with mask
// agent: only released batches get the agent section; a node counts
// healthy once its section converged and its Hello reports the new
// version; one node whose trial fails latches UpgradeFailed, which sets its
// condition (nodes.list condition=UpgradeFailed, node.upgrade_failed) and
// counts as a failure that pauses the rollout naming it; resumed, the
// rollout succeeds and the manifest becomes the pool's agent settings;
// nodes.clearUpgrade clears the latch, the node retries the manifest at its
// next periodic converge and upgrades, and the condition clears.
func TestAgentUpgradeRollout(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := lifecycleEnv(t, dbURL, ns.URL())
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("simulated bcd " + strings.TrimPrefix(r.URL.Path, "/")))
	}))
	t.Cleanup(srv.Close)

	// Daemon 3's first trial fails; every other trial passes.
	var failed atomic.Bool
	f := simFleet(t, env, db, "upg", 10, func(c *sim.Config) {
		c.HealthCheckInterval = 100 * time.Millisecond
		c.AgentVersion, c.ReleaseKey = "v0.1.0", pub
		c.ReconvergeInterval = time.Second // a cleared latch is retried at the next periodic converge
		c.FailUpgrade = func(i int, _ string) bool { return i == 3 && failed.CompareAndSwap(false, true) }
	})
	ids := f.Nodes()
	pool := poolOf(t, db, ids[0])
	bad := ids[3]
	if v := agentVersions(t, db, ids); v["v0.1.0"] != 10 {
		t.Fatalf("versions before: %v", v)
	}
	manifest := signedBuild(t, priv, srv.URL, "v0.2.0", 1)
	var created struct{ Rollout rolloutJSON }
	call(t, env, "rollouts/create", map[string]any{"tenantId": "root", "poolId": pool, "idempotencyKey": "upgrade-" + pool,
		"change":   map[string]any{"updateMask": "agent", "agent": map[string]any{"releaseManifest": manifest}},
		"strategy": map[string]any{"batches": []any{map[string]any{"count": 4}, map[string]any{"count": 3}}, "bake": "0.2s"}}, &created)
	r := created.Rollout
	var answered struct {
		Rollout struct {
			Change struct {
				UpdateMask string
				Agent      struct{ ReleaseManifest string }
			}
		}
	}
	call(t, env, "rollouts/get", map[string]any{"tenantId": "root", "rolloutId": r.ID}, &answered)
	if m, err := agentrelease.Parse([]byte(answered.Rollout.Change.Agent.ReleaseManifest)); err != nil || m.Version != "v0.2.0" ||
		answered.Rollout.Change.UpdateMask != "agent" {
		t.Fatalf("rollouts.get change %+v: %v", answered.Rollout.Change, err)
	}
	const hasAgent = `spec ? 'agent'`
	poll.Until(t, 2*time.Minute, "the rollout paused at the failed upgrade", func() bool {
		cur := getRollout(t, env, r.ID)
		if cur.State == "succeeded" || cur.State == "failed" {
			t.Fatalf("rollout %+v", cur)
		}
		// Only released nodes have the agent section.
		released := rolloutNodes(t, db, r.ID, `state IN ('updating', 'healthy', 'failed')`)
		for _, id := range idsWhere(t, db, ids, hasAgent) {
			if !slices.Contains(released, id) {
				t.Fatalf("%s has the agent section outside a released batch (%v)", id, released)
			}
		}
		return cur.State == "paused"
	})
	paused := getRollout(t, env, r.ID)
	if !slices.Equal(paused.FailedNodes, []string{bad}) || !strings.Contains(paused.Message, bad) {
		t.Fatalf("paused rollout %+v, want %s failed", paused, bad)
	}
	var list struct {
		Nodes []struct{ ID, AgentVersion string }
	}
	call(t, env, "nodes/list", map[string]any{"tenantId": "root", "poolId": pool, "condition": "UpgradeFailed"}, &list)
	if len(list.Nodes) != 1 || list.Nodes[0].ID != bad || list.Nodes[0].AgentVersion != "v0.1.0" {
		t.Fatalf("nodes.list condition=UpgradeFailed: %+v", list)
	}
	var events int
	if err := db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'node.upgrade_failed' AND payload->>'nodeId' = $1
		AND payload->>'reason' LIKE 'UpgradeFailed:%'`, bad).Scan(&events); err != nil || events != 1 {
		t.Fatalf("node.upgrade_failed events: %d %v", events, err)
	}
	var got struct {
		Node struct {
			Conditions []struct{ Type, Value, Reason string }
		}
	}
	call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": bad}, &got)
	if !slices.ContainsFunc(got.Node.Conditions, func(c struct{ Type, Value, Reason string }) bool {
		return c.Type == "UpgradeFailed" && c.Value == "True" && strings.Contains(c.Reason, "v0.2.0")
	}) {
		t.Fatalf("nodes.get conditions: %+v", got.Node.Conditions)
	}

	rolloutAction(t, env, "resume", r.ID)
	poll.Until(t, 2*time.Minute, "the rollout succeeded", func() bool {
		cur := getRollout(t, env, r.ID)
		if cur.State == "failed" || cur.State == "paused" {
			t.Fatalf("rollout %+v", cur)
		}
		return cur.State == "succeeded"
	})
	if v := agentVersions(t, db, ids); v["v0.2.0"] != 9 || v["v0.1.0"] != 1 {
		t.Fatalf("versions after: %v", v)
	}
	var poolAgent string
	if err := db.QueryRow(t.Context(), `SELECT agent->>'releaseManifest' FROM pools WHERE id = $1`, pool).Scan(&poolAgent); err != nil || poolAgent == "" {
		t.Fatalf("the pool's agent settings after success: %q %v", poolAgent, err)
	}

	// The latch cleared, the node upgrades and the condition clears.
	var cleared struct{ Command struct{ ID string } }
	call(t, env, "nodes/clearUpgrade", map[string]any{"tenantId": "root", "nodeId": bad, "reason": "fixed"}, &cleared)
	deadline := time.Now().Add(time.Minute)
	for len(idsWhere(t, db, []string{bad}, `agent_version = 'v0.2.0' AND upgrade_failed = ''`)) == 0 {
		if time.Now().After(deadline) {
			var v, uf, sections string
			_ = db.QueryRow(t.Context(), `SELECT agent_version, upgrade_failed, section_status::text FROM nodes WHERE id = $1`, bad).Scan(&v, &uf, &sections)
			t.Fatalf("the node did not upgrade after the clear: %s %q %s; agent.upgrade %v", v, uf, sections, commandsOf(t, db, bad, "agent.upgrade"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	call(t, env, "nodes/list", map[string]any{"tenantId": "root", "poolId": pool, "condition": "UpgradeFailed"}, &list)
	if len(list.Nodes) != 0 {
		t.Fatalf("nodes.list condition=UpgradeFailed after the clear: %+v", list)
	}
}

// bannerCommand returns the banner's line that starts with prefix, split
// into arguments as a shell would (single quotes only).
func bannerCommand(t *testing.T, banner, prefix string) []string {
	t.Helper()
	for _, line := range strings.Split(banner, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		var args []string
		var cur strings.Builder
		quoted, started := false, false
		for _, r := range line {
			switch {
			case r == '\'':
				quoted, started = !quoted, true
			case r == ' ' && !quoted:
				if started {
					args = append(args, cur.String())
				}
				cur.Reset()
				started = false
			default:
				cur.WriteRune(r)
				started = true
			}
		}
		if started {
			args = append(args, cur.String())
		}
		return args
	}
	t.Fatalf("the banner has no line %q:\n%s", prefix, banner)
	return nil
}

// TestDevRollsItsSimulatedNodesToASecondBuild: dev publishes a second,
// simulated bcd build signed with its release key and served by the api
// role; the exact command its banner prints (run through the real CLI)
// rolls the simulated pool to it, and every simulated node reconnects
// reporting the new version.
func TestDevRollsItsSimulatedNodesToASecondBuild(t *testing.T) {
	t.Parallel()
	port, three, none, no := 0, 3, 0, false
	dataDir := t.TempDir()
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: dataDir, SimNodes: &three, SimMachines: &none, SimInstances: &no},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop(context.Background())
	banner := env.Banner()
	args := bannerCommand(t, banner, "better-compute api rollouts.create")
	if !strings.Contains(banner, "a second simulated bcd build "+dev.SimUpgradeVersion) || !slices.Contains(args, "change.agent.releaseManifest=@"+env.SimUpgradeManifest) {
		t.Fatalf("banner:\n%s", banner)
	}
	// The manifest verifies against dev's release key and names a build the
	// api role serves with its size and SHA-256.
	keyPEM, err := os.ReadFile(filepath.Join(dataDir, "pki", dev.ReleaseKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	key, err := agentrelease.ParsePrivateKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(env.SimUpgradeManifest)
	if err != nil {
		t.Fatal(err)
	}
	m, err := agentrelease.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if err := agentrelease.Verify(m, key.Public().(ed25519.PublicKey), time.Now()); err != nil || m.Version != dev.SimUpgradeVersion {
		t.Fatalf("manifest %+v: %v", m, err)
	}
	resp, err := http.Get(m.URL)
	if err != nil {
		t.Fatal(err)
	}
	build, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if sum := sha256.Sum256(build); resp.StatusCode != http.StatusOK || int64(len(build)) != m.Size || hex.EncodeToString(sum[:]) != m.SHA256 {
		t.Fatalf("GET %s: %d, %d bytes", m.URL, resp.StatusCode, len(build))
	}

	ids := env.Fleet.Nodes()
	var stdout, stderr strings.Builder
	if code := cli.Main(append([]string{"api", "--url", env.BaseURL(), "--token", env.Credential}, args[2:]...), &stdout, &stderr); code != 0 {
		t.Fatalf("%v: exit %d\n%s\n%s", args, code, stdout.String(), stderr.String())
	}
	db, err := pgxpool.New(t.Context(), cfg.Database.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	poll.Until(t, 2*time.Minute, "every simulated node reporting "+dev.SimUpgradeVersion, func() bool {
		return agentVersions(t, db, ids)[dev.SimUpgradeVersion] == len(ids)
	})
	for i := range ids {
		if v := env.Fleet.Version(i); v != dev.SimUpgradeVersion {
			t.Fatalf("simulated node %d reports %s", i, v)
		}
	}
	poll.Until(t, time.Minute, "the rollout succeeded", func() bool {
		var state string
		if err := db.QueryRow(t.Context(), `SELECT state FROM rollouts WHERE pool_id = $1`, env.SimPoolID).Scan(&state); err != nil {
			t.Fatal(err)
		}
		return state == "succeeded"
	})
}
