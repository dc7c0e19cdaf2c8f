package dev

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	agentinv "github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/kernelargs"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/state"

	"github.com/bettercompute/bettercompute/services/metal"
)

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
	// The BMC keeps its certificate across restarts, as a real one does:
	// the control plane pinned it at the first inspect.
	certFile := filepath.Join(m.dir, "bmc-cert.pem")
	if m.BMC, err = fakebmc.StartTLSCert(b, cmp.Or(addr, "127.0.0.1:0"), certFile); err != nil && addr != "" && cfg.BMCAddr == "" {
		m.BMC, err = fakebmc.StartTLSCert(b, "127.0.0.1:0", certFile) // the kept port is taken
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
		if tok, ok := strings.CutPrefix(w, kernelargs.BootToken+"="); ok {
			return tok, nil
		}
	}
	return "", fmt.Errorf("no boot token in the iPXE script %q", b)
}
