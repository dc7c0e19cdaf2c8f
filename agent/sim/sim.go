// Package sim runs a fleet of simulated node daemons in one process: each is
// the real agent code (join, session, renewal) with the mock NVML backend (a
// DGX H200) and its own state directory and boot id, against a real gateway
// over real mutual TLS. dev's --sim-nodes, the load simulator in tools and
// the tests use it.
package sim

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/state"
)

// Config describes the fleet.
type Config struct {
	// Gateway is the gateway's host:port; ServerName the name its
	// certificate carries (empty: the host of Gateway).
	Gateway, ServerName string
	// RootCAs verify the gateway (the node CA's bundle).
	RootCAs *x509.CertPool
	// Token is a join token with at least as many uses as nodes that have
	// not joined yet.
	Token string
	// JoinserviceKey and JoinserviceKeyID are joinservice's HPKE key.
	JoinserviceKey   []byte
	JoinserviceKeyID string
	// Root holds one state directory per node (node-0000, …); a node whose
	// directory already holds an identity does not join again.
	Root string
	// Prefix names the simulated hosts (<prefix>-0000); default "sim".
	Prefix string
	// JoinConcurrency bounds joins in flight; default 16.
	JoinConcurrency int
	// Logger; nil discards.
	Logger *slog.Logger
	// OnSession, when set, is called by every node with true when its
	// session is established and false when it ends (see session.Config).
	OnSession func(up bool)
}

// Fleet is a running fleet.
type Fleet struct {
	cfg    Config
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	nodes  []string
	invs   []*inventory.Collector
}

// Start joins (where needed) and runs n simulated nodes until Stop. It
// returns once every node has joined; sessions open in the background.
func Start(ctx context.Context, cfg Config, n int) (*Fleet, error) {
	cfg.Prefix = cmp.Or(cfg.Prefix, "sim")
	cfg.JoinConcurrency = cmp.Or(cfg.JoinConcurrency, 16)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.Root, 0o755); err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	f := &Fleet{cfg: cfg, cancel: cancel}
	sem := make(chan struct{}, cfg.JoinConcurrency)
	errs := make([]error, n)
	stores := make([]*state.Store, n)
	invs := make([]*inventory.Collector, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			stores[i], invs[i], errs[i] = f.prepare(ctx, i)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, inv := range invs {
			if inv != nil {
				_ = inv.Close()
			}
		}
		cancel()
		return nil, err
	}
	f.invs = invs
	for i := range n {
		id, _ := stores[i].Identity()
		f.nodes = append(f.nodes, id.NodeID)
		f.wg.Go(func() {
			err := session.Run(runCtx, session.Config{
				Gateway: cfg.Gateway, ServerName: cfg.ServerName, State: stores[i], Inventory: invs[i],
				BootID: fmt.Sprintf("%s-boot-%04d-%d", cfg.Prefix, i, time.Now().UnixNano()), AgentVersion: "sim",
				Logger: cfg.Logger, OnSession: cfg.OnSession,
			})
			if err != nil {
				cfg.Logger.Warn("simulated node stopped", "node", id.NodeID, "err", err)
			}
		})
	}
	return f, nil
}

// prepare opens node i's state and inventory and joins it if it has no
// identity yet.
func (f *Fleet) prepare(ctx context.Context, i int) (*state.Store, *inventory.Collector, error) {
	host := fmt.Sprintf("%s-%04d", f.cfg.Prefix, i)
	st, err := state.Open(filepath.Join(f.cfg.Root, fmt.Sprintf("node-%04d", i)))
	if err != nil {
		return nil, nil, err
	}
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: host, MachineID: host + "-machine", SystemSerial: host + "-serial"})
	if err != nil {
		return nil, nil, err
	}
	if _, err := st.Identity(); err == nil {
		return st, inv, nil
	} else if !errors.Is(err, state.ErrNotJoined) {
		_ = inv.Close()
		return nil, nil, err
	}
	_, err = join.Join(ctx, join.Config{
		Gateway: f.cfg.Gateway, ServerName: f.cfg.ServerName, RootCAs: f.cfg.RootCAs, Token: f.cfg.Token,
		JoinserviceKey: f.cfg.JoinserviceKey, JoinserviceKeyID: f.cfg.JoinserviceKeyID, State: st, Claims: inv,
	})
	if err != nil {
		_ = inv.Close()
		return nil, nil, fmt.Errorf("join %s: %w", host, err)
	}
	return st, inv, nil
}

// Nodes returns the node ids of the fleet.
func (f *Fleet) Nodes() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.nodes...)
}

// Stop ends every session and waits for them.
func (f *Fleet) Stop() {
	f.cancel()
	f.wg.Wait()
	for _, inv := range f.invs {
		_ = inv.Close()
	}
}
