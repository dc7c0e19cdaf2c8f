package dev

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/providers"
)

// The VPS pools dev starts (dev.simInstances).
const (
	// SimVPSPool is the hosted pool (class vps-host) of SimVPSHosts
	// simulated nodes running the simulated VPS runtime.
	SimVPSPool = "vps"
	// SimVPSHosts is how many simulated hosts SimVPSPool has.
	SimVPSHosts = 2
	// SimVPSPrefix names those hosts (vps-0000, …).
	SimVPSPrefix = "vps"
	// SimProviderPool is the provider pool on dev's fake provider.
	SimProviderPool = "cloud"
	// simProviderDelay is how long the fake provider provisions a machine.
	simProviderDelay = 2 * time.Second
)

// devVPS is what dev runs for dev.simInstances.
type devVPS struct {
	fleet            *sim.Fleet
	hostedPool       string
	providerPool     string
	provider         *providers.Fake
	providerURL      string
	providerSrv      *http.Server
	providerServeErr chan error
}

// startVPS creates (idempotently) the hosted pool SimVPSPool and joins
// SimVPSHosts simulated VPS hosts to it under root, and the provider pool
// SimProviderPool pointed at a fake provider served on a loopback port
// with a token made for this start (stored as the pool's provider secret
// by pools.update, as an operator would).
func startVPS(ctx context.Context, env *Env, root string, logger *slog.Logger) (_ *devVPS, err error) {
	d := &devVPS{}
	defer func() {
		if err != nil {
			d.stop()
		}
	}()
	var hosted struct{ Pool struct{ ID string } }
	if err := env.call(ctx, "pools/create", map[string]any{
		"tenantId": "root", "name": SimVPSPool, "class": "vps-host", "idempotencyKey": "dev-vps-pool",
		"description": "simulated VPS hosts started by better-compute dev",
	}, &hosted); err != nil {
		return nil, err
	}
	d.hostedPool = hosted.Pool.ID
	known, err := poolNodes(ctx, env, d.hostedPool)
	if err != nil {
		return nil, err
	}
	body := map[string]any{
		"tenantId": "root", "poolId": d.hostedPool, "name": "dev-vps", "uses": SimVPSHosts,
		"idempotencyKey": fmt.Sprintf("dev-vps-%d", time.Now().UnixNano()),
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
	d.fleet, err = sim.Start(ctx, sim.Config{
		Gateway: loopbackGateway(env), RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: root, Prefix: SimVPSPrefix,
		CommandKey: env.CommandKey, Logger: logger.With("component", "vps-sim"),
		// Instances run as a process each, which outlives the daemon: a
		// restarted dev adopts them.
		VPS: true,
	}, SimVPSHosts)
	if err != nil {
		return nil, fmt.Errorf("simulated VPS hosts: %w", err)
	}

	// The fake provider, on loopback only, with a token of this start.
	secret := make([]byte, 24)
	if _, err := rand.Read(secret); err != nil {
		return nil, err
	}
	token := "devprov_" + hex.EncodeToString(secret)
	d.provider = providers.NewFake(providers.FakeConfig{Token: token, ProvisionDelay: simProviderDelay})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fake provider: %w", err)
	}
	d.providerURL = "http://" + ln.Addr().String()
	d.providerSrv = &http.Server{Handler: d.provider, ReadHeaderTimeout: 10 * time.Second}
	d.providerServeErr = make(chan error, 1)
	go func() { d.providerServeErr <- d.providerSrv.Serve(ln) }()
	var prov struct{ Pool struct{ ID string } }
	if err := env.call(ctx, "pools/create", map[string]any{
		"tenantId": "root", "name": SimProviderPool, "class": "provider", "idempotencyKey": "dev-cloud-pool",
		"description": "machines at the fake provider better-compute dev serves",
	}, &prov); err != nil {
		return nil, err
	}
	d.providerPool = prov.Pool.ID
	if err := env.call(ctx, "pools/update", map[string]any{
		"tenantId": "root", "poolId": d.providerPool, "updateMask": "provider",
		"provider": map[string]any{"endpoint": d.providerURL, "token": token},
	}, &map[string]any{}); err != nil {
		return nil, err
	}
	return d, nil
}

// stop stops the simulated hosts (their instances' processes keep running,
// for the next start to adopt) and the fake provider (its machines are in
// memory: a later start's provider has none of them).
func (d *devVPS) stop() {
	if d.fleet != nil {
		d.fleet.Stop()
		d.fleet = nil
	}
	if d.providerSrv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = d.providerSrv.Shutdown(ctx)
		if err := <-d.providerServeErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Warn("the fake provider stopped", "err", err)
		}
		d.providerSrv = nil
	}
}
