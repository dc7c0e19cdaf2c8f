package dev

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"time"

	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/pkg/config"
)

// SimSiteName, SimMetalPool and SimMachinePrefix name what dev's simulated
// site makes: the site, its pool, and its machines (sim-1, sim-2, …).
const (
	SimSiteName      = "sim"
	SimMetalPool     = "metal-sim"
	SimMachinePrefix = "sim-"
)

// simBMCUser and simBMCPassword are the simulated BMCs' credentials.
const (
	simBMCUser     = "admin"
	simBMCPassword = "sim-bmc-password"
)

// devMetal is dev's simulated site: the site and pool made through the
// API, the machines enrolled, and the first one deployed once it is ready
// (once: a marker under its directory says it was).
type devMetal struct {
	Site     *SimSite
	SiteID   string
	PoolID   string
	Machines []*SimMachine
	image    *httptest.Server
	cancel   context.CancelFunc
	done     chan struct{}
}

func (d *devMetal) stop() {
	d.cancel()
	<-d.done
	d.Site.Stop()
	d.image.Close()
}

// startMetal runs dev's simulated site under root with n machines.
func startMetal(ctx context.Context, env *Env, root string, n int, logger *slog.Logger) (_ *devMetal, err error) {
	var pool struct{ Pool struct{ ID string } }
	if err := env.call(ctx, "pools/create", map[string]any{"tenantId": "root", "name": SimMetalPool, "class": "gpu",
		"idempotencyKey": "dev-metal-sim-pool", "description": "simulated bare-metal machines started by better-compute dev"}, &pool); err != nil {
		return nil, err
	}
	siteID, err := simSiteID(ctx, env)
	if err != nil {
		return nil, err
	}
	var tok struct{ Token string }
	st, err := state.Open(filepath.Join(root, "agent"))
	if err != nil {
		return nil, err
	}
	if !enrolled(st) {
		// Not enrolled, or its certificate lapsed while dev was down: enroll
		// a new agent.
		if err := os.RemoveAll(filepath.Join(root, "agent")); err != nil {
			return nil, err
		}
		if err := env.call(ctx, "sites/createToken", map[string]any{"tenantId": "root", "siteId": siteID}, &tok); err != nil {
			return nil, err
		}
	}
	pub, keyID, roots, err := joinMaterial(env)
	if err != nil {
		return nil, err
	}
	gw := loopbackGateway(env)
	startCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	s, err := StartSimSite(startCtx, SimSiteConfig{Gateway: gw, RootCAs: roots, JoinserviceKey: pub, JoinserviceKeyID: keyID,
		CommandKey: env.CommandKey, Token: tok.Token, Root: root, Hostname: "sim-site", Logger: logger})
	if err != nil {
		return nil, err
	}
	image := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(simImage) }))
	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	d := &devMetal{Site: s, SiteID: siteID, PoolID: pool.Pool.ID, image: image, cancel: stopRun, done: make(chan struct{})}
	defer func() {
		if err != nil {
			close(d.done)
			d.stop()
		}
	}()
	known, err := simMachines(ctx, env, siteID)
	if err != nil {
		return nil, err
	}
	var deployFirst bool
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("%s%d", SimMachinePrefix, i)
		m, err := s.AddMachine(SimMachineConfig{Name: name, MAC: fmt.Sprintf("02:bc:00:00:00:%02x", i), Username: simBMCUser,
			Password: simBMCPassword, ImageClient: image.Client()})
		if err != nil {
			return nil, err
		}
		d.Machines = append(d.Machines, m)
		k, ok := known[name]
		switch {
		case !ok:
			if err := env.call(ctx, "metal/enroll", map[string]any{"tenantId": "root", "siteId": siteID, "poolId": pool.Pool.ID, "name": name,
				"bmc": map[string]any{"address": m.BMC.URL, "username": simBMCUser, "password": simBMCPassword}}, &struct{}{}); err != nil {
				return nil, err
			}
		case k.BMCAddress != m.BMC.URL:
			logger.Warn("simulated machine's BMC moved: delete it to enroll it again", "machine", k.ID, "was", k.BMCAddress, "now", m.BMC.URL)
		case k.State == "joined":
			m.BootInstalled() // the installed system, as it was when dev stopped
		}
		if i == 1 {
			_, err := os.Stat(filepath.Join(root, "machines", name, "deployed"))
			deployFirst = errors.Is(err, os.ErrNotExist)
		}
	}
	go func() {
		defer close(d.done)
		if deployFirst && n > 0 {
			d.deployWhenReady(runCtx, env, filepath.Join(root, "machines", SimMachinePrefix+"1"), logger)
		}
	}()
	return d, nil
}

// simImage is what the simulated deploy writes: a small raw image.
var simImage = bytes.Repeat([]byte("bettercompute simulated image\n"), 2048)

// deployWhenReady deploys the first machine once it is ready.
func (d *devMetal) deployWhenReady(ctx context.Context, env *Env, dir string, logger *slog.Logger) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ms, err := simMachines(ctx, env, d.SiteID)
		m, ok := ms[SimMachinePrefix+"1"]
		if err != nil || !ok || m.State != "ready" {
			continue
		}
		sum := sha256.Sum256(simImage)
		err = env.call(ctx, "metal/deploy", map[string]any{"tenantId": "root", "machineId": m.ID, "cloudInit": "#cloud-config\nhostname: " + SimMachinePrefix + "1\n",
			"image": map[string]any{"url": d.image.URL + "/sim.raw", "sha256": hex.EncodeToString(sum[:]), "sizeBytes": len(simImage)}}, &struct{}{})
		if err != nil {
			logger.Warn("deploy the simulated machine", "machine", m.ID, "err", err)
			return
		}
		_ = os.WriteFile(filepath.Join(dir, "deployed"), []byte(m.ID+"\n"), 0o600)
		return
	}
}

type simMachine struct{ ID, Name, State, BMCAddress string }

// simMachines returns the site's machines by name.
func simMachines(ctx context.Context, env *Env, siteID string) (map[string]simMachine, error) {
	var page struct {
		Machines []struct{ ID, Name, State, BMCAddress string }
	}
	if err := env.call(ctx, "metal/list", map[string]any{"tenantId": "root", "siteId": siteID, "pageSize": 1000}, &page); err != nil {
		return nil, err
	}
	out := map[string]simMachine{}
	for _, m := range page.Machines {
		out[m.Name] = simMachine{ID: m.ID, Name: m.Name, State: m.State, BMCAddress: m.BMCAddress}
	}
	return out, nil
}

// simSiteID finds the site "sim" of the root tenant, or creates it.
func simSiteID(ctx context.Context, env *Env) (string, error) {
	token := ""
	for {
		var page struct {
			Sites         []struct{ ID, Name string }
			NextPageToken string
		}
		if err := env.call(ctx, "sites/list", map[string]any{"tenantId": "root", "pageSize": 1000, "pageToken": token}, &page); err != nil {
			return "", err
		}
		for _, s := range page.Sites {
			if s.Name == SimSiteName {
				return s.ID, nil
			}
		}
		if token = page.NextPageToken; token == "" {
			break
		}
	}
	var out struct{ Site struct{ ID string } }
	if err := env.call(ctx, "sites/create", map[string]any{"tenantId": "root", "name": SimSiteName,
		"description": "a simulated site started by better-compute dev"}, &out); err != nil {
		return "", err
	}
	return out.Site.ID, nil
}

// enrolled says st holds a site agent's identity valid for a while yet.
func enrolled(st *state.Store) bool {
	id, err := site.LoadIdentity(st)
	if err != nil {
		return false
	}
	leaf, err := id.Stored.Leaf()
	return err == nil && time.Until(leaf.NotAfter) > time.Minute
}

// simKernel and simInitrd stand in for bcd ramdisk's kernel and initrd.
var (
	simKernel = []byte("bettercompute simulated ramdisk kernel\n")
	simInitrd = []byte("bettercompute simulated ramdisk initrd\n")
)

// serveSimRamdisk serves the simulated ramdisk's files on a loopback port
// and points r at them by URL and SHA-256; the returned func stops it.
func serveSimRamdisk(r *config.MetalRamdisk) (func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /vmlinuz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(simKernel) })
	mux.HandleFunc("GET /initrd.img", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(simInitrd) })
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	base := "http://" + ln.Addr().String()
	k, i := sha256.Sum256(simKernel), sha256.Sum256(simInitrd)
	r.KernelURL, r.KernelSHA256 = base+"/vmlinuz", hex.EncodeToString(k[:])
	r.InitrdURL, r.InitrdSHA256 = base+"/initrd.img", hex.EncodeToString(i[:])
	return func() { _ = srv.Close() }, nil
}
