package dev_test

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/state"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// call posts a JSON body to an API method with the root credential and
// decodes the answer into out, failing the test on any error.
func call(t testing.TB, env *dev.Env, method string, body, out any) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.BaseURL()+"/api/compute/"+method, strings.NewReader(string(b)))
	req.Header.Set("Authorization", "Bearer "+env.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", method, resp.StatusCode, raw)
	}
	if err := json.Unmarshal(raw, out); err != nil {
		t.Fatalf("%s: %v: %s", method, err, raw)
	}
}

// TestNodeJoinsEndToEnd runs the real agent against the real dev control
// plane: join → certificate → session → inventory → devices → adopted,
// visible in nodes.get.
func TestNodeJoinsEndToEnd(t *testing.T) {
	t.Parallel()
	port, noMachines := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimMachines: &noMachines},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond), LivenessInterval: config.Duration(200 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop(context.Background())

	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": "h200", "class": "gpu", "idempotencyKey": "e2e-pool"}, &pool)
	var tok struct{ Token string }
	call(t, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": 1, "idempotencyKey": "e2e-token"}, &tok)
	if !strings.HasPrefix(tok.Token, "bcjt_") {
		t.Fatalf("token %q", tok.Token)
	}

	// What an operator copies to the server: joinservice's key and the CA.
	pub, keyID, roots := joinMaterial(t, env)
	_, gwPort, _ := net.SplitHostPort(env.App.GatewayAddr())
	gateway := net.JoinHostPort("127.0.0.1", gwPort)

	st, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "gpu-host-1", MachineID: "e2e-machine"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = inv.Close() }()
	id, err := join.Join(t.Context(), join.Config{
		Gateway: gateway, RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, State: st, Claims: inv,
	})
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := id.Leaf()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(leaf.URIs[0].String(), "/node/"+id.NodeID) || time.Until(leaf.NotAfter) < 23*time.Hour {
		t.Fatalf("certificate %v until %s", leaf.URIs, leaf.NotAfter)
	}

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- session.Run(ctx, session.Config{Gateway: gateway, State: st, Inventory: inv, BootID: "e2e-boot", AgentVersion: "e2e", MinBackoff: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	type node struct {
		State        string
		SessionEpoch string
		GatewayID    string
		LastSeenAt   string
		Devices      []struct {
			ID, Model string
			Healthy   bool
		}
		Conditions []struct {
			Type   string
			Status bool
		}
	}
	var got struct{ Node node }
	poll.UntilNil(t, 30*time.Second, "the node to be adopted with its GPUs", func() error {
		call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": id.NodeID}, &got)
		if got.Node.State == "adopted" && len(got.Node.Devices) == 8 {
			return nil
		}
		return fmt.Errorf("%+v", got.Node)
	})
	n := got.Node
	if n.SessionEpoch != "1" || n.GatewayID != cfg.Gateway.ID || n.LastSeenAt == "" {
		t.Fatalf("session not visible: %+v", n)
	}
	for _, d := range n.Devices {
		if !strings.HasPrefix(d.ID, "GPU-") || !strings.HasPrefix(d.Model, "NVIDIA H200") || !d.Healthy {
			t.Fatalf("device %+v", d)
		}
	}
	if len(n.Conditions) != 4 || n.Conditions[0].Type != "Ready" {
		t.Fatalf("conditions %+v; want Ready, InventoryReported, GPUsHealthy, DevicesPresent", n.Conditions)
	}
	for _, c := range n.Conditions {
		if !c.Status {
			t.Fatalf("condition %+v", c)
		}
	}

	// Desired state: adoption wrote generation 1, the node applied it and
	// is schedulable; a change through the API reaches the node and it
	// converges on it.
	type specNode struct {
		Generation, ObservedGeneration string
		Schedulable                    bool
		Sections                       []struct{ Section, State string }
	}
	waitConverged := func(t *testing.T, what string, cond func(specNode) bool) specNode {
		t.Helper()
		var n specNode
		poll.UntilNil(t, 30*time.Second, what, func() error {
			var got struct{ Node specNode }
			call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": id.NodeID}, &got)
			if n = got.Node; n.Generation != "0" && n.Generation == n.ObservedGeneration && cond(n) {
				return nil
			}
			return fmt.Errorf("%+v", n)
		})
		return n
	}
	first := waitConverged(t, "the node applying generation 1", func(n specNode) bool { return n.Schedulable && len(n.Sections) == 9 }) // identity, site, runtime, mig, devices, instances, health, agent, tunnels
	var upd struct{ Pool struct{ Generation string } }
	call(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "site": map[string]any{"logLevel": "debug"}, "updateMask": "site"}, &upd)
	changed := waitConverged(t, "the node converging on the pool's new site settings", func(n specNode) bool { return n.Generation != first.Generation })
	if changed.Generation != "2" {
		t.Fatalf("one change must bump the generation once: %+v", changed)
	}
	site, err := os.ReadFile(filepath.Join(st.Root(), converge.SiteFile))
	if err != nil || !strings.Contains(string(site), "debug") {
		t.Fatalf("site settings on the node: %s (%v)", site, err)
	}

	// Labels: nodes.update changes them and the node's identity follows.
	var labelled struct {
		Node struct{ Labels map[string]string }
	}
	call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": id.NodeID, "labels": map[string]string{"rack": "r1"}, "updateMask": "labels"}, &labelled)
	if labelled.Node.Labels["rack"] != "r1" {
		t.Fatalf("update answered %+v", labelled)
	}
	waitConverged(t, "the node converging on its new labels", func(n specNode) bool { return n.Generation == "3" })
	var spec struct {
		Spec struct {
			Identity struct{ Labels map[string]string }
		}
	}
	call(t, env, "nodes/getSpec", map[string]any{"tenantId": "root", "nodeId": id.NodeID}, &spec)
	if spec.Spec.Identity.Labels["rack"] != "r1" {
		t.Fatalf("the spec's identity lacks the label: %+v", spec)
	}

	// Revocation: nodes.revoke revokes the node's certificates; its open
	// session is closed at the gateway's next liveness tick and the node,
	// reconnecting, is refused.
	held := env.App.GatewaySessions() // this node's and dev's simulated ones
	var revoked struct{ RevokedCertificates string }
	call(t, env, "nodes/revoke", map[string]any{"tenantId": "root", "nodeId": id.NodeID, "reason": "decommissioned"}, &revoked)
	if revoked.RevokedCertificates != "1" {
		t.Fatalf("nodes.revoke answered %+v, want 1 certificate revoked", revoked)
	}
	poll.Until(t, 30*time.Second, "the revoked node's session to be closed", func() bool { return env.App.GatewaySessions() == held-1 })
	time.Sleep(time.Second) // five liveness intervals and several reconnects
	if n := env.App.GatewaySessions(); n != held-1 {
		t.Fatalf("%d sessions held, want %d: the revoked node is back", n, held-1)
	}
}

// joinMaterial is what an operator copies to a server so its daemon can
// join env: joinservice's HPKE public key with its id, and the node CA.
func joinMaterial(t testing.TB, env *dev.Env) (pub []byte, keyID string, roots *x509.CertPool) {
	t.Helper()
	keyPEM, err := os.ReadFile(env.JoinKeyFile)
	if err != nil {
		t.Fatal(err)
	}
	pub, keyID, err = join.ParsePublicKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(env.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots = x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("no CA in " + env.CAFile)
	}
	return pub, keyID, roots
}
