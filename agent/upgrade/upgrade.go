// Package upgrade is bcd's side of agent upgrades: it admits a signed
// release manifest (agentrelease) against the release key pinned in the
// install configuration and the highest release counter this node has
// installed, downloads the build it names (bounded, https or loopback
// http), checks its size and SHA-256, and stages it A/B beside the running
// build: <root>/bin/bcd.A and bcd.B, with <root>/bin/current a symlink to
// the one that runs, so the previous build is always kept for a rollback.
//
// What it persists, under <root>/upgrade/state.json: the highest counter
// installed and its manifest's digest (a replay of an older build, or the
// same counter with other content, is refused), and the UpgradeFailed
// latch, which refuses every manifest until the control plane clears it.
//
// Each refusal is a named error callers match with errors.Is:
// agentrelease.ErrBadSignature, agentrelease.ErrExpired,
// agentrelease.ErrMalformed, ErrOlderCounter, ErrCounterReused,
// ErrPlatform, ErrTooLarge, ErrDigestMismatch and ErrLatched.
//
// The handover (the 30 s trial of the new build as a child, the exec, the
// rollback) is the daemon's (agent/bcd); Activate and Fail record its
// outcome. See docs/agent-upgrades.md.
package upgrade

import (
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// The refusals of this package (see also agentrelease's).
var (
	// ErrOlderCounter is a manifest whose counter is lower than the highest
	// this node has installed: a replay of an older (maybe vulnerable)
	// build.
	ErrOlderCounter = errors.New("release counter older than the one installed")
	// ErrCounterReused is a manifest with the counter of the installed
	// release but other content.
	ErrCounterReused = errors.New("release counter already installed with other content")
	// ErrPlatform is a build for another GOOS/GOARCH.
	ErrPlatform = errors.New("release is for another platform")
	// ErrTooLarge is a download longer than its manifest's size.
	ErrTooLarge = errors.New("artifact larger than its manifest says")
	// ErrDigestMismatch is a download whose size or SHA-256 is not its
	// manifest's.
	ErrDigestMismatch = errors.New("artifact SHA-256 does not match its manifest")
	// ErrLatched is any manifest while UpgradeFailed is latched.
	ErrLatched = errors.New("an upgrade failed its trial and is latched (UpgradeFailed): nothing is retried until nodes.clearUpgrade")
	// ErrNoKey is an upgrade on a node whose install configuration pins no
	// release key.
	ErrNoKey = errors.New("no release key pinned (bcd node --release-key)")
)

// Slots of the A/B install.
const (
	SlotA = "A"
	SlotB = "B"
)

// Files under the root.
const (
	stateFile = "upgrade/state.json"
	binDir    = "bin"
	current   = "current"
)

// State is what the node persists about its upgrades.
type State struct {
	// Counter is the highest release counter installed; Digest its
	// manifest's digest and Version its version.
	Counter uint64 `json:"counter,omitempty"`
	Digest  string `json:"digest,omitempty"`
	Version string `json:"version,omitempty"`
	// Failed is the latch: set when a build failed its trial and was rolled
	// back; every manifest is refused until it is cleared.
	Failed *Failure `json:"failed,omitempty"`
	// Trial is the build on trial now (BeginTrial), until Activate or Fail:
	// found at start, the daemon stopped during the trial (RecoverTrial).
	Trial *Failure `json:"trial,omitempty"`
}

// Failure is a latched UpgradeFailed.
type Failure struct {
	Version string    `json:"version"`
	Counter uint64    `json:"counter"`
	Reason  string    `json:"reason"`
	At      time.Time `json:"at"`
}

// Config configures an Installer.
type Config struct {
	// Root is bcd's state directory.
	Root string
	// Key is the pinned release public key; nil refuses every manifest
	// (ErrNoKey).
	Key ed25519.PublicKey
	// Client downloads artifacts; default a client with a 10 minute
	// timeout that follows no redirect to a non-https or non-loopback URL.
	Client *http.Client
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Platform is the node's GOOS/GOARCH; default the running binary's.
	Platform string
}

// Installer admits, fetches and stages builds. Its methods are safe for
// concurrent use; one upgrade runs at a time.
type Installer struct {
	cfg Config
	mu  sync.Mutex
}

// New returns an Installer.
func New(cfg Config) *Installer {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Platform == "" {
		cfg.Platform = runtime.GOOS + "/" + runtime.GOARCH
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: 10 * time.Minute, CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if len(via) >= 5 {
				return errors.New("too many redirects")
			}
			return agentrelease.CheckURL(req.URL.String())
		}}
	}
	return &Installer{cfg: cfg}
}

// State returns the persisted state (zero when none).
func (in *Installer) State() (State, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.load()
}

func (in *Installer) load() (State, error) {
	var s State
	b, err := os.ReadFile(filepath.Join(in.cfg.Root, stateFile))
	if errors.Is(err, fs.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("upgrade state: %w", err)
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("upgrade state: %w", err)
	}
	return s, nil
}

func (in *Installer) save(s State) error {
	if err := os.MkdirAll(filepath.Join(in.cfg.Root, filepath.Dir(stateFile)), 0o700); err != nil {
		return fmt.Errorf("upgrade state: %w", err)
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return state.WriteAtomic(filepath.Join(in.cfg.Root, stateFile), b, 0o600)
}

// Admit decides whether m may be installed: the latch, the pinned key, the
// signature, the expiry, the platform and the counter against the highest
// installed. It reports installed when m is the release already installed
// (same counter, same content): nothing to do.
func (in *Installer) Admit(m *agentrelease.Manifest) (installed bool, err error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.admit(m)
}

func (in *Installer) admit(m *agentrelease.Manifest) (bool, error) {
	s, err := in.load()
	if err != nil {
		return false, err
	}
	if s.Failed != nil {
		return false, fmt.Errorf("%w (%s, counter %d: %s)", ErrLatched, s.Failed.Version, s.Failed.Counter, s.Failed.Reason)
	}
	if len(in.cfg.Key) == 0 {
		return false, ErrNoKey
	}
	if err := agentrelease.Verify(m, in.cfg.Key, in.cfg.Now()); err != nil {
		return false, err
	}
	if m.Platform != in.cfg.Platform {
		return false, fmt.Errorf("%w: %s, this node is %s", ErrPlatform, m.Platform, in.cfg.Platform)
	}
	switch d := agentrelease.Digest(m); {
	case m.Counter < s.Counter:
		return false, fmt.Errorf("%w: counter %d (%s), installed %d (%s)", ErrOlderCounter, m.Counter, m.Version, s.Counter, s.Version)
	case m.Counter == s.Counter && d != s.Digest:
		return false, fmt.Errorf("%w: counter %d (%s), installed as %s", ErrCounterReused, m.Counter, m.Version, s.Version)
	case m.Counter == s.Counter:
		return true, nil
	}
	return false, nil
}

// Staged is a build fetched, checked and written into the slot that does
// not run.
type Staged struct {
	Manifest *agentrelease.Manifest
	// Slot is the slot written (A or B); Path its file.
	Slot, Path string
	// Previous is the slot that ran before (empty on a first install).
	Previous string
}

// Stage admits m, downloads its build into the slot that does not run
// (bounded by m.Size), checks its SHA-256 and makes it executable. Nothing
// switches yet: Activate does.
func (in *Installer) Stage(ctx context.Context, m *agentrelease.Manifest) (Staged, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	installed, err := in.admit(m)
	if err != nil {
		return Staged{}, err
	}
	if installed {
		return Staged{}, fmt.Errorf("release %s (counter %d) is already installed", m.Version, m.Counter)
	}
	bin := filepath.Join(in.cfg.Root, binDir)
	if err := os.MkdirAll(bin, 0o700); err != nil {
		return Staged{}, fmt.Errorf("upgrade: %w", err)
	}
	prev := in.currentSlot()
	slot := SlotA
	if prev == SlotA {
		slot = SlotB
	}
	path := filepath.Join(bin, "bcd."+slot)
	if err := in.fetch(ctx, m, path); err != nil {
		return Staged{}, err
	}
	return Staged{Manifest: m, Slot: slot, Path: path, Previous: prev}, nil
}

// currentSlot is the slot <root>/bin/current names, or "".
func (in *Installer) currentSlot() string {
	t, err := os.Readlink(filepath.Join(in.cfg.Root, binDir, current))
	if err != nil {
		return ""
	}
	switch filepath.Base(t) {
	case "bcd." + SlotA:
		return SlotA
	case "bcd." + SlotB:
		return SlotB
	}
	return ""
}

// CurrentPath is the path of the build <root>/bin/current names ("" when
// none is installed).
func (in *Installer) CurrentPath() string {
	if s := in.currentSlot(); s != "" {
		return filepath.Join(in.cfg.Root, binDir, "bcd."+s)
	}
	return ""
}

func (in *Installer) fetch(ctx context.Context, m *agentrelease.Manifest, path string) (err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, m.URL, nil)
	if err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	resp, err := in.cfg.Client.Do(req)
	if err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("artifact: GET %s: %s", m.URL, resp.Status)
	}
	if resp.ContentLength > m.Size {
		return fmt.Errorf("%w: %d bytes, manifest says %d", ErrTooLarge, resp.ContentLength, m.Size)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), io.LimitReader(resp.Body, m.Size+1))
	if err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	if n > m.Size {
		return fmt.Errorf("%w: more than %d bytes", ErrTooLarge, m.Size)
	}
	if got := hex.EncodeToString(h.Sum(nil)); n != m.Size || got != m.SHA256 {
		return fmt.Errorf("%w: %d bytes with SHA-256 %s, manifest says %d bytes with %s", ErrDigestMismatch, n, got, m.Size, m.SHA256)
	}
	if err := tmp.Chmod(0o755); err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("artifact: %w", err)
	}
	return os.Rename(tmp.Name(), path)
}

// BeginTrial records that st's build is on trial, so a daemon that stops
// before Activate or Fail finds it at start (RecoverTrial).
func (in *Installer) BeginTrial(st Staged) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	s, err := in.load()
	if err != nil {
		return err
	}
	s.Trial = &Failure{Version: st.Manifest.Version, Counter: st.Manifest.Counter, At: in.cfg.Now().UTC()}
	return in.save(s)
}

// RecoverTrial latches UpgradeFailed for a trial the daemon did not see
// through (it stopped, crashed or was killed meanwhile; current still names
// the previous build), so it is not tried again by itself; it reports
// whether there was one.
func (in *Installer) RecoverTrial() (bool, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	s, err := in.load()
	if err != nil || s.Trial == nil {
		return false, err
	}
	s.Failed = &Failure{Version: s.Trial.Version, Counter: s.Trial.Counter, Reason: "interrupted: the daemon stopped during the trial", At: in.cfg.Now().UTC()}
	s.Trial = nil
	return true, in.save(s)
}

// Activate points <root>/bin/current at the staged slot (an atomic
// symlink swap) and records its counter as installed: from now on an older
// counter is refused. Call it once the staged build passed its trial.
func (in *Installer) Activate(st Staged) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if err := in.point(st.Slot); err != nil {
		return err
	}
	s, err := in.load()
	if err != nil {
		return err
	}
	s.Counter, s.Digest, s.Version = st.Manifest.Counter, agentrelease.Digest(st.Manifest), st.Manifest.Version
	s.Trial = nil
	return in.save(s)
}

// point swaps <root>/bin/current to slot atomically (a new symlink renamed
// over the old).
func (in *Installer) point(slot string) error {
	bin := filepath.Join(in.cfg.Root, binDir)
	tmp := filepath.Join(bin, "."+current+".tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink("bcd."+slot, tmp); err != nil {
		return fmt.Errorf("upgrade: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(bin, current)); err != nil {
		return fmt.Errorf("upgrade: %w", err)
	}
	return nil
}

// Fail latches UpgradeFailed for st (its trial failed; the previous slot
// keeps running) with reason.
func (in *Installer) Fail(st Staged, reason string) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if st.Previous != "" {
		if err := in.point(st.Previous); err != nil {
			return err
		}
	} else if err := os.Remove(filepath.Join(in.cfg.Root, binDir, current)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		// A first install that failed: the build outside the slots (the
		// one the service manager started) runs, and current names none.
		return fmt.Errorf("upgrade: %w", err)
	}
	s, err := in.load()
	if err != nil {
		return err
	}
	s.Failed = &Failure{Version: st.Manifest.Version, Counter: st.Manifest.Counter, Reason: reason, At: in.cfg.Now().UTC()}
	s.Trial = nil
	return in.save(s)
}

// Clear clears the UpgradeFailed latch (nodes.clearUpgrade); it reports
// whether one was set.
func (in *Installer) Clear() (bool, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	s, err := in.load()
	if err != nil || s.Failed == nil {
		return false, err
	}
	s.Failed = nil
	return true, in.save(s)
}
