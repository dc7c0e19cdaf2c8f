package dev

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
)

// simRuntime is the runtime section of dev's pool "sim": containerd reading
// CDI specs from /var/run/cdi.
var simRuntime = map[string]any{"engines": []any{"containerd"}, "cdiSpecDirs": []any{"/var/run/cdi"}}

// simTunnels is the tunnels allowlist of dev's pool "sim": loopback ports
// 1024-65535, so a first tunnel works at once (a simulated node runs on
// this machine: its loopback is this machine's).
var simTunnels = map[string]any{"allow": []any{map[string]any{"cidr": "127.0.0.1/32", "portMin": 1024, "portMax": 65535}}}

// startFleet joins n simulated nodes to the pool "sim" of the root tenant,
// through the API as an operator would: create the pool (idempotent), mint a
// token for the nodes that have not joined yet, and run them. With
// telemetry each runs bcd's telemetry, for Env.Fleet.MetricsHandler.
func startFleet(ctx context.Context, env *Env, root string, n int, telemetry, mig bool, logger *slog.Logger) (*sim.Fleet, error) {
	var pool struct{ Pool struct{ ID string } }
	if err := env.call(ctx, "pools/create", map[string]any{
		"tenantId": "root", "name": "sim", "class": "gpu", "idempotencyKey": "dev-sim-pool",
		"description": "simulated nodes started by better-compute dev",
	}, &pool); err != nil {
		return nil, err
	}
	// The pool wires a container runtime to CDI, so its nodes' spec has a
	// runtime section (a simulated node keeps the CDI directory under its
	// own state root). Set on every start: dev's pool is dev's.
	if err := env.call(ctx, "pools/update", map[string]any{
		"tenantId": "root", "poolId": pool.Pool.ID, "updateMask": "runtime,tunnels", "runtime": simRuntime, "tunnels": simTunnels,
	}, &struct{}{}); err != nil {
		return nil, err
	}
	// Simulated machines whose state directory was lost join again and take
	// back their nodes: the token names the pool's nodes it may reclaim.
	known, err := poolNodes(ctx, env, pool.Pool.ID)
	if err != nil {
		return nil, err
	}
	body := map[string]any{
		"tenantId": "root", "poolId": pool.Pool.ID, "name": "dev-sim", "uses": n,
		"idempotencyKey": fmt.Sprintf("dev-sim-%d", time.Now().UnixNano()),
	}
	if len(known) > 0 {
		body["reclaim"], body["reclaimNodeIds"] = true, known[:min(len(known), 10000)]
	}
	var tok struct{ Token string }
	if err := env.call(ctx, "joinTokens/create", body, &tok); err != nil {
		return nil, err
	}
	pub, keyID, roots, err := joinMaterial(env)
	if err != nil {
		return nil, err
	}
	f, err := sim.Start(ctx, sim.Config{
		Gateway: loopbackGateway(env), RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: root,
		// The daemons pin the control plane's command-signing key, so a
		// signed node.reboot runs (the simulator's reboot restarts the
		// daemon with a new boot id) and an unsigned one is BAD_SIGNATURE.
		CommandKey: env.CommandKey,
		// They pin dev's release key: a rollout with mask agent upgrades
		// them to the simulated second build (upgrade.go), in a
		// simulated handover.
		ReleaseKey: releasePub(env),
		Logger:     logger.With("component", "sim"),
		// The simulated machines can host VPS instances (a process each).
		VPS:       true,
		Telemetry: telemetry,
	}, n)
	if err != nil {
		return f, err
	}
	env.SimPoolID = pool.Pool.ID
	if !mig {
		return f, nil
	}
	env.simMig = true
	// One simulated node carries a MIG layout: its GPU 0 split in four
	// (nodes.update mask mig, the same on every start), which its mock
	// NVML applies. An index layout is checked against the node's
	// inventory, which a node that just joined reports within moments.
	node := f.Nodes()[0]
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := env.call(ctx, "nodes/update", map[string]any{
			"tenantId": "root", "nodeId": node, "updateMask": "mig", "mig": simMig,
		}, &struct{}{})
		if err == nil {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			logger.Warn("the simulated node carries no MIG layout", "node", node, "err", err)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return f, nil
}

// simMig is the MIG layout of dev's first simulated node: GPU 0 as
// 3g.71gb + 2g.35gb + 2 × 1g.18gb.
var simMig = map[string]any{"layouts": []any{map[string]any{
	"name": "dev-mixed", "gpuSelector": map[string]any{"indices": []any{0}},
	"profiles": []any{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"},
}}}

// joinMaterial reads what a daemon joining env needs: joinservice's public
// key and the node CA's bundle.
func joinMaterial(env *Env) (pub []byte, keyID string, roots *x509.CertPool, err error) {
	keyPEM, err := os.ReadFile(env.JoinKeyFile)
	if err != nil {
		return nil, "", nil, err
	}
	if pub, keyID, err = join.ParsePublicKey(keyPEM); err != nil {
		return nil, "", nil, err
	}
	caPEM, err := os.ReadFile(env.CAFile)
	if err != nil {
		return nil, "", nil, err
	}
	roots = x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	return pub, keyID, roots, nil
}

// loopbackGateway is the gateway's address on 127.0.0.1 (it may listen on
// every address).
func loopbackGateway(env *Env) string {
	_, port, _ := net.SplitHostPort(env.App.GatewayAddr())
	return net.JoinHostPort("127.0.0.1", port)
}

// poolNodes lists the ids of pool's nodes.
func poolNodes(ctx context.Context, env *Env, pool string) ([]string, error) {
	var ids []string
	token := ""
	for {
		var page struct {
			Nodes         []struct{ ID string }
			NextPageToken string
		}
		if err := env.call(ctx, "nodes/list", map[string]any{"tenantId": "root", "poolId": pool, "pageSize": 1000, "pageToken": token}, &page); err != nil {
			return nil, err
		}
		for _, n := range page.Nodes {
			ids = append(ids, n.ID)
		}
		if token = page.NextPageToken; token == "" {
			return ids, nil
		}
	}
}

// call posts body to an API method with the root credential.
func (e *Env) call(ctx context.Context, method string, body, out any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.BaseURL()+"/api/compute/"+method, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+e.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", method, raw)
	}
	return json.Unmarshal(raw, out)
}

// releasePub is the public half of dev's release key, or nil.
func releasePub(env *Env) ed25519.PublicKey {
	if env.releaseKey == nil {
		return nil
	}
	return env.releaseKey.Public().(ed25519.PublicKey)
}
