package dev

import (
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	agentinv "github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/pkg/config"

	"github.com/bettercompute/bettercompute/services/metal"
)

// A simulated bare-metal site (what `make run` and services/metal's tests
// drive): one real site agent (agent/site) holding the site's boot lease
// with its PXE HTTP server on loopback (no DHCP or TFTP ports: a simulated
// machine fetches its iPXE script over HTTP), and machines behind fake
// Redfish BMCs (agent/site/fakebmc, over TLS) whose power-on runs what the
// machine boots: with target Pxe, the machine's iPXE script is fetched for
// its boot token and bcd ramdisk's code runs (mock NVML, file disks); with
// target Hdd, the installed system reads the join token image.deploy wrote
// into the disk's cloud-init seed (<disk>.user-data) and joins as a node.

// SimSiteConfig configures [StartSimSite].
type SimSiteConfig struct {
	// Gateway is the gateway's address (host:port) for the site agent and
	// the machines.
	Gateway string
	// RootCAs trusts the gateway; JoinserviceKey and JoinserviceKeyID are
	// what joins seal to (join.ParsePublicKey).
	RootCAs          *x509.CertPool
	JoinserviceKey   []byte
	JoinserviceKeyID string
	// CommandKey is the command-signing key the ramdisks pin.
	CommandKey ed25519.PublicKey
	// Token is a site token (bcst_…); unused when Root holds an enrolled
	// agent already.
	Token string
	// Root keeps the site agent's state, its iPXE scripts and image cache,
	// and each machine's disks and installed system.
	Root string
	// Hostname is the site agent's; default "sim-site".
	Hostname string
	// LeaseTTL is the boot lease's; default 3s.
	LeaseTTL time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
}

// SimSite is a running simulated site.
type SimSite struct {
	// PXE is the site agent's boot server.
	PXE *site.PXEBoot

	cfg    SimSiteConfig
	log    *slog.Logger
	cancel context.CancelFunc
	done   chan struct{}

	mu       sync.Mutex
	machines []*SimMachine
}

// StartSimSite enrolls the site agent (unless cfg.Root holds one) and runs
// it until it serves PXE or ctx ends. Stop it when done.
func StartSimSite(ctx context.Context, cfg SimSiteConfig) (*SimSite, error) {
	cfg.Hostname = cmp.Or(cfg.Hostname, "sim-site")
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = 3 * time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	agentDir := filepath.Join(cfg.Root, "agent")
	st, err := state.Open(agentDir)
	if err != nil {
		return nil, err
	}
	if _, err := site.LoadIdentity(st); errors.Is(err, state.ErrNotJoined) {
		if _, err := site.Join(ctx, join.Config{Gateway: cfg.Gateway, RootCAs: cfg.RootCAs, Token: cfg.Token,
			JoinserviceKey: cfg.JoinserviceKey, JoinserviceKeyID: cfg.JoinserviceKeyID, State: st,
			Claims: site.HostClaims{Hostname: cfg.Hostname}}); err != nil {
			return nil, fmt.Errorf("enroll the site agent: %w", err)
		}
	} else if err != nil {
		return nil, err
	}
	var dirs [2]string
	for i, name := range []string{"ipxe", "cache"} {
		dirs[i] = filepath.Join(cfg.Root, name)
		if err := os.MkdirAll(dirs[i], 0o700); err != nil {
			return nil, err
		}
	}
	table := pxe.NewTable()
	boot, err := site.NewPXEBoot(pxe.Config{IP: netip.MustParseAddr("127.0.0.1"), DHCPAddr: "127.0.0.1:0", PXEAddr: "127.0.0.1:0",
		TFTPAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", IPXEDir: dirs[0], CacheDir: dirs[1], Gateway: cfg.Gateway,
		Machines: table, Logger: log.With("part", "pxe")})
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &SimSite{PXE: boot, cfg: cfg, log: log, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		_ = site.Run(runCtx, site.Config{Gateway: cfg.Gateway, State: st, Boot: boot, Version: "sim", Hostname: cfg.Hostname,
			LeaseTTL: cfg.LeaseTTL, Logger: log.With("part", "agent"), PXE: table})
	}()
	// The lease is the agent's once a previous holder's lapsed: a restart
	// waits up to a TTL for it.
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for boot.Addrs().BaseURL == "" {
		select {
		case <-ctx.Done():
			s.Stop()
			return nil, fmt.Errorf("the simulated site agent serving PXE: %w", ctx.Err())
		case <-t.C:
		}
	}
	return s, nil
}

// Stop powers every machine off, closes their BMCs and stops the site
// agent. It may be called more than once.
func (s *SimSite) Stop() {
	s.mu.Lock()
	ms := s.machines
	s.machines = nil
	s.mu.Unlock()
	for _, m := range ms {
		m.Close()
	}
	s.cancel()
	<-s.done
}

// SimMachineConfig describes one simulated machine.
type SimMachineConfig struct {
	// Name names its directory under the site's root (its disks, its BMC's
	// address file and its installed system's state).
	Name string
	// MAC is its one NIC's address.
	MAC string
	// SystemID and SerialNumber are its BMC's; defaults from Name.
	SystemID, SerialNumber string
	// Username and Password are its BMC's credentials.
	Username, Password string
	// Disks is how many file disks of 1 MiB of random bytes it has;
	// default 2. Disks already there are kept.
	Disks int
	// BMCAddr is where its BMC listens; default the address it had last
	// time under the site's root, else 127.0.0.1:0.
	BMCAddr string
	// ImageClient fetches images for image.deploy; nil is the default
	// client.
	ImageClient *http.Client
	// OnError, when set, hears every boot that went wrong.
	OnError func(error)
}

// SimMachine is a simulated server: a fake BMC over TLS and file disks.
type SimMachine struct {
	// MAC is its NIC's address; Disks its disks' paths.
	MAC   string
	Disks []string
	// BMC is its fake BMC.
	BMC *fakebmc.Server

	s   *SimSite
	cfg SimMachineConfig
	dir string

	mu      sync.Mutex
	cancel  context.CancelFunc
	done    chan struct{}
	boots   []string
	lastErr error
	closed  bool
}

// AddMachine starts a machine's BMC, powered off.
func (s *SimSite) AddMachine(cfg SimMachineConfig) (*SimMachine, error) {
	if cfg.Name == "" || cfg.MAC == "" {
		return nil, errors.New("a simulated machine needs a name and a MAC")
	}
	cfg.SystemID = cmp.Or(cfg.SystemID, "sys-"+cfg.Name)
	cfg.SerialNumber = cmp.Or(cfg.SerialNumber, "SN-"+cfg.Name)
	if cfg.Disks <= 0 {
		cfg.Disks = 2
	}
	m := &SimMachine{MAC: cfg.MAC, s: s, cfg: cfg, dir: filepath.Join(s.cfg.Root, "machines", cfg.Name)}
	if err := os.MkdirAll(m.dir, 0o700); err != nil {
		return nil, err
	}
	for d := range cfg.Disks {
		p := filepath.Join(m.dir, fmt.Sprintf("disk%d", d))
		if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
			junk := make([]byte, 1<<20)
			_, _ = rand.Read(junk)
			if err := os.WriteFile(p, junk, 0o600); err != nil {
				return nil, err
			}
		}
		m.Disks = append(m.Disks, p)
	}
	hw := fakebmc.DefaultMachine()
	hw.SystemID, hw.SerialNumber = cfg.SystemID, cfg.SerialNumber
	hw.NICs = []fakebmc.NIC{{MAC: cfg.MAC, SpeedMbps: 25000}}
	hw.PoweredOn = false
	b, err := fakebmc.New(fakebmc.Config{Machine: hw, Username: cfg.Username, Password: cfg.Password,
		OnPowerOn: func(target string) { go m.boot(target) }, OnPowerOff: func() { go m.off() }})
	if err != nil {
		return nil, err
	}
	addrFile := filepath.Join(m.dir, "bmc-addr")
	addr := cfg.BMCAddr
	if addr == "" {
		if kept, err := os.ReadFile(addrFile); err == nil {
			addr = strings.TrimSpace(string(kept))
		}
	}
	if m.BMC, err = fakebmc.StartTLS(b, cmp.Or(addr, "127.0.0.1:0")); err != nil && addr != "" && cfg.BMCAddr == "" {
		m.BMC, err = fakebmc.StartTLS(b, "127.0.0.1:0") // the kept port is taken
	}
	if err != nil {
		return nil, err
	}
	_ = os.WriteFile(addrFile, []byte(strings.TrimPrefix(m.BMC.URL, "https://")+"\n"), 0o600)
	s.mu.Lock()
	s.machines = append(s.machines, m)
	s.mu.Unlock()
	return m, nil
}

// Boots returns the boot targets the machine booted, oldest first.
func (m *SimMachine) Boots() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.boots...)
}

// Err is the last boot's error, if any.
func (m *SimMachine) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lastErr
}

// Running says whether the machine runs an agent (ramdisk or installed).
func (m *SimMachine) Running() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cancel != nil
}

// Close powers the machine off and closes its BMC.
func (m *SimMachine) Close() {
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
	m.off()
	_ = m.BMC.Close()
}

func (m *SimMachine) off() {
	m.mu.Lock()
	cancel, done := m.cancel, m.done
	m.cancel, m.done = nil, nil
	m.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

func (m *SimMachine) fail(err error) {
	m.mu.Lock()
	m.lastErr = err
	m.mu.Unlock()
	m.s.log.Warn("simulated machine", "mac", m.MAC, "err", err)
	if m.cfg.OnError != nil {
		m.cfg.OnError(err)
	}
}

// BootInstalled boots the installed system as a power-on from disk would
// (dev does it for a machine that was joined when it last stopped).
func (m *SimMachine) BootInstalled() { go m.boot(fakebmc.TargetHdd) }

// boot runs what the machine boots: the ramdisk over PXE, its disk's
// installed system otherwise.
func (m *SimMachine) boot(target string) {
	m.off()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		cancel()
		return
	}
	m.cancel, m.done = cancel, done
	m.boots = append(m.boots, target)
	m.mu.Unlock()
	defer close(done)
	cfg := m.s.cfg
	// The ramdisk keeps nothing across boots; the installed system keeps its
	// identity on its disk (a fresh one after every deploy).
	stateDir, workDir := filepath.Join(m.dir, "installed"), filepath.Join(m.dir, "ramdisk", "work")
	if target == fakebmc.TargetPxe {
		_ = os.RemoveAll(filepath.Join(m.dir, "ramdisk"))
		stateDir = filepath.Join(m.dir, "ramdisk", "state")
		if err := os.MkdirAll(workDir, 0o700); err != nil {
			m.fail(err)
			return
		}
	}
	st, err := state.Open(stateDir)
	if err != nil {
		m.fail(err)
		return
	}
	inv, err := agentinv.Open(agentinv.Config{Backend: agentinv.BackendMock, Hostname: "host-" + strings.ReplaceAll(m.MAC, ":", "")})
	if err != nil {
		m.fail(err)
		return
	}
	defer func() { _ = inv.Close() }()
	jc := join.Config{Gateway: cfg.Gateway, RootCAs: cfg.RootCAs, JoinserviceKey: cfg.JoinserviceKey, JoinserviceKeyID: cfg.JoinserviceKeyID,
		State: st, Claims: inv}
	sc := session.Config{Gateway: cfg.Gateway, State: st, Inventory: inv, BootID: fmt.Sprintf("boot-%d", time.Now().UnixNano()),
		AgentVersion: "sim", CommandKey: cfg.CommandKey, MinBackoff: 50 * time.Millisecond, MaxBackoff: time.Second,
		Logger: m.s.log.With("machine", m.cfg.Name)}
	needJoin, joined := true, func() {}
	if target == fakebmc.TargetPxe {
		tok, err := m.pxeBoot(ctx)
		if err != nil {
			m.fail(err)
			return
		}
		key, err := ramdisk.NewKey()
		if err != nil {
			m.fail(err)
			return
		}
		rd, err := ramdisk.New(ramdisk.Config{Disks: m.Disks, HTTPClient: m.cfg.ImageClient, WorkDir: workDir,
			Logger: m.s.log.With("machine", m.cfg.Name, "part", "ramdisk")})
		if err != nil {
			m.fail(err)
			return
		}
		jc.Token, jc.Role, jc.Key = tok, join.RoleRamdisk, key
		sc.Key, sc.Ramdisk, sc.ResultKey, sc.NoRenew = key, rd, key, true
	} else {
		ud, err := os.ReadFile(m.Disks[0] + ramdisk.UserDataSuffix)
		if err != nil {
			m.fail(fmt.Errorf("no cloud-init seed: %w", err))
			return
		}
		tok := metal.JoinTokenOf(ud)
		if tok == "" {
			m.fail(errors.New("no join token in the cloud-init seed"))
			return
		}
		// The installed system keeps its identity until a new deploy writes
		// a new seed: then it joins with the seed's token.
		tokFile := filepath.Join(m.dir, "installed-token")
		if kept, err := os.ReadFile(tokFile); err == nil && string(kept) == tok {
			if _, err := st.Identity(); err == nil {
				needJoin = false
			}
		}
		if needJoin {
			_ = os.RemoveAll(stateDir)
			if st, err = state.Open(stateDir); err != nil {
				m.fail(err)
				return
			}
			jc.State, sc.State = st, st
		}
		jc.Token, joined = tok, func() { _ = os.WriteFile(tokFile, []byte(tok), 0o600) }
	}
	if needJoin {
		if _, err := join.Join(ctx, jc); err != nil {
			if ctx.Err() == nil {
				m.fail(fmt.Errorf("join (%s): %w", target, err))
			}
			return
		}
		joined()
	}
	_ = session.Run(ctx, sc)
}

// pxeBoot is the firmware's network boot: it fetches the iPXE script,
// each try bounded by 15 s, and tries again a second later while the
// boot server does not answer (it may be between two leases' servers),
// as a PXE ROM retries, until the machine is powered off. A script that
// came back without a token (410: the one-time token was taken) ends it.
func (m *SimMachine) pxeBoot(ctx context.Context) (string, error) {
	for {
		tctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		tok, err := m.bootToken(tctx)
		cancel()
		var status statusError
		if err == nil || errors.As(err, &status) || ctx.Err() != nil {
			return tok, err
		}
		m.fail(fmt.Errorf("network boot (trying again): %w", err))
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// statusError is an answer of the boot server other than 200.
type statusError struct {
	url  string
	code int
	body []byte
}

func (e statusError) Error() string { return fmt.Sprintf("GET %s: %d %s", e.url, e.code, e.body) }

// bootToken fetches the machine's iPXE script from the site agent, as
// iPXE does, and reads the boot token off its kernel line.
func (m *SimMachine) bootToken(ctx context.Context) (string, error) {
	url := m.s.PXE.Addrs().BaseURL + "/boot/" + m.MAC + ".ipxe"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return "", statusError{url: url, code: resp.StatusCode, body: b}
	}
	for _, w := range strings.Fields(string(b)) {
		if tok, ok := strings.CutPrefix(w, pxe.KernelArgBootToken+"="); ok {
			return tok, nil
		}
	}
	return "", fmt.Errorf("no boot token in the iPXE script %q", b)
}

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
