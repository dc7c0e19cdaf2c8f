package dev

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	"github.com/bettercompute/bettercompute/agent/state"
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
	// OnTask, a test hook, is the site agent's (site.Config.OnTask).
	OnTask func(context.Context, *agentv1.SiteTask)
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
			LeaseTTL: cfg.LeaseTTL, Logger: log.With("part", "agent"), PXE: table, OnTask: cfg.OnTask})
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
