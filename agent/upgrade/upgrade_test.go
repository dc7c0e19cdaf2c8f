package upgrade_test

import (
	"bytes"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/upgrade"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

var now = time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)

const platform = "linux/amd64"

// fixture is a release key, an artifact server on loopback serving builds
// by path, and an installer under a temporary root.
type fixture struct {
	pub   ed25519.PublicKey
	priv  ed25519.PrivateKey
	srv   *httptest.Server
	files map[string][]byte
	root  string
	in    *upgrade.Installer
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	pub, priv, _ := ed25519.GenerateKey(nil)
	f := &fixture{pub: pub, priv: priv, files: map[string][]byte{}, root: t.TempDir()}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, ok := f.files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(b)
	}))
	t.Cleanup(f.srv.Close)
	f.in = upgrade.New(upgrade.Config{Root: f.root, Key: pub, Now: func() time.Time { return now }, Platform: platform})
	return f
}

// release serves body at /<version> and returns its manifest signed with
// counter.
func (f *fixture) release(t *testing.T, version string, counter uint64, body []byte) *agentrelease.Manifest {
	t.Helper()
	f.files["/"+version] = body
	sum := sha256.Sum256(body)
	m := &agentrelease.Manifest{Version: version, URL: f.srv.URL + "/" + version, SHA256: hex.EncodeToString(sum[:]),
		Size: int64(len(body)), Platform: platform, NotAfter: now.Add(time.Hour), Counter: counter}
	if err := agentrelease.Sign(m, f.priv); err != nil {
		t.Fatal(err)
	}
	return m
}

func (f *fixture) install(t *testing.T, m *agentrelease.Manifest) upgrade.Staged {
	t.Helper()
	st, err := f.in.Stage(t.Context(), m)
	if err != nil {
		t.Fatalf("stage %s: %v", m.Version, err)
	}
	if err := f.in.Activate(st); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestStageActivateAB installs two releases: each lands in the slot that
// does not run, current follows, and the previous build is kept.
func TestStageActivateAB(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	one := f.install(t, f.release(t, "v0.1.0", 1, []byte("build one")))
	if one.Slot != upgrade.SlotA || one.Previous != "" {
		t.Fatalf("first install: %+v", one)
	}
	two := f.install(t, f.release(t, "v0.2.0", 2, []byte("build two")))
	if two.Slot != upgrade.SlotB || two.Previous != upgrade.SlotA {
		t.Fatalf("second install: %+v", two)
	}
	if got, _ := os.ReadFile(f.in.CurrentPath()); string(got) != "build two" {
		t.Fatalf("current runs %q", got)
	}
	if got, _ := os.ReadFile(one.Path); string(got) != "build one" {
		t.Fatalf("the previous build is not kept: %q", got)
	}
	if fi, err := os.Stat(two.Path); err != nil || fi.Mode().Perm()&0o100 == 0 {
		t.Fatalf("staged build not executable: %v %v", fi, err)
	}
	s, err := f.in.State()
	if err != nil || s.Counter != 2 || s.Version != "v0.2.0" {
		t.Fatalf("state %+v %v", s, err)
	}
	// The same release again is already installed; a third goes to A.
	if installed, err := f.in.Admit(f.release(t, "v0.2.0", 2, []byte("build two"))); err != nil || !installed {
		t.Fatalf("the installed release again: %v %v", installed, err)
	}
	if three := f.install(t, f.release(t, "v0.3.0", 3, []byte("build three"))); three.Slot != upgrade.SlotA {
		t.Fatalf("third install: %+v", three)
	}
}

// TestRefusals: each refusal is its named error, and nothing is written to
// the slot that runs.
func TestRefusals(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.install(t, f.release(t, "v0.2.0", 5, []byte("build five")))

	older := f.release(t, "v0.1.0", 4, []byte("old vulnerable build"))
	reused := f.release(t, "v0.2.1", 5, []byte("another build five"))
	expired := f.release(t, "v0.3.0", 6, []byte("build six"))
	expired.NotAfter = now
	if err := agentrelease.Sign(expired, f.priv); err != nil {
		t.Fatal(err)
	}
	_, otherPriv, _ := ed25519.GenerateKey(nil)
	otherKey := f.release(t, "v0.3.0", 6, []byte("build six"))
	if err := agentrelease.Sign(otherKey, otherPriv); err != nil {
		t.Fatal(err)
	}
	tampered := f.release(t, "v0.3.0", 6, []byte("build six"))
	tampered.Counter = 99
	mismatch := f.release(t, "v0.3.0", 6, []byte("build six"))
	f.files["/v0.3.0"] = []byte("build 6!!")
	tooLarge := f.release(t, "v0.4.0", 7, []byte("build seven"))
	f.files["/v0.4.0"] = bytes.Repeat([]byte("x"), 1<<16)
	arm := f.release(t, "v0.5.0", 8, []byte("build eight"))
	arm.Platform = "linux/arm64"
	if err := agentrelease.Sign(arm, f.priv); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		m    *agentrelease.Manifest
		want error
	}{
		"an older counter":                {older, upgrade.ErrOlderCounter},
		"the same counter, other build":   {reused, upgrade.ErrCounterReused},
		"an expired manifest":             {expired, agentrelease.ErrExpired},
		"another key":                     {otherKey, agentrelease.ErrBadSignature},
		"a field changed after signing":   {tampered, agentrelease.ErrBadSignature},
		"a download with another digest":  {mismatch, upgrade.ErrDigestMismatch},
		"a download longer than its size": {tooLarge, upgrade.ErrTooLarge},
		"another platform":                {arm, upgrade.ErrPlatform},
	} {
		if _, err := f.in.Stage(t.Context(), c.m); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", name, err, c.want)
		}
	}
	if got, _ := os.ReadFile(f.in.CurrentPath()); string(got) != "build five" {
		t.Fatalf("current runs %q", got)
	}
	if s, _ := f.in.State(); s.Counter != 5 {
		t.Fatalf("counter moved: %+v", s)
	}
	// The installed counter survives a restart (a new installer, same root).
	again := upgrade.New(upgrade.Config{Root: f.root, Key: f.pub, Now: func() time.Time { return now }, Platform: platform})
	if _, err := again.Admit(older); !errors.Is(err, upgrade.ErrOlderCounter) {
		t.Fatalf("after a restart, an older counter: %v", err)
	}
	noKey := upgrade.New(upgrade.Config{Root: f.root, Now: func() time.Time { return now }, Platform: platform})
	if _, err := noKey.Admit(f.release(t, "v0.9.0", 9, []byte("nine"))); !errors.Is(err, upgrade.ErrNoKey) {
		t.Fatalf("no pinned key: %v", err)
	}
}

// TestLatch: a failed trial restores the previous slot and latches
// UpgradeFailed; every manifest is refused until Clear, across restarts.
func TestLatch(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.install(t, f.release(t, "v0.1.0", 1, []byte("good")))
	bad := f.release(t, "v0.2.0", 2, []byte("bad"))
	st, err := f.in.Stage(t.Context(), bad)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.in.Fail(st, "exited with status 3 before opening its session"); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(f.in.CurrentPath()); string(got) != "good" {
		t.Fatalf("current runs %q after the rollback", got)
	}
	later := f.release(t, "v0.3.0", 3, []byte("fixed"))
	again := upgrade.New(upgrade.Config{Root: f.root, Key: f.pub, Now: func() time.Time { return now }, Platform: platform})
	for _, in := range []*upgrade.Installer{f.in, again} {
		if _, err := in.Stage(t.Context(), later); !errors.Is(err, upgrade.ErrLatched) || !strings.Contains(err.Error(), "v0.2.0") {
			t.Fatalf("latched: %v", err)
		}
	}
	if s, _ := again.State(); s.Failed == nil || s.Failed.Counter != 2 || s.Counter != 1 {
		t.Fatalf("state %+v", s)
	}
	if cleared, err := again.Clear(); err != nil || !cleared {
		t.Fatalf("clear: %v %v", cleared, err)
	}
	if cleared, _ := again.Clear(); cleared {
		t.Fatal("a second clear cleared something")
	}
	st = f.install(t, later)
	if got, _ := os.ReadFile(filepath.Clean(st.Path)); string(got) != "fixed" {
		t.Fatalf("after clear: %q", got)
	}
}

// TestRecoverTrial: a trial begun and never finished (the daemon stopped)
// is latched at the next start, naming the build; a finished one leaves
// nothing to recover.
func TestRecoverTrial(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.install(t, f.release(t, "v0.1.0", 1, []byte("good")))
	st, err := f.in.Stage(t.Context(), f.release(t, "v0.2.0", 2, []byte("next")))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.in.BeginTrial(st); err != nil {
		t.Fatal(err)
	}
	again := upgrade.New(upgrade.Config{Root: f.root, Key: f.pub, Now: func() time.Time { return now }, Platform: platform})
	if ok, err := again.RecoverTrial(); err != nil || !ok {
		t.Fatalf("recover: %v %v", ok, err)
	}
	if s, _ := again.State(); s.Failed == nil || s.Failed.Version != "v0.2.0" || !strings.Contains(s.Failed.Reason, "interrupted") || s.Trial != nil {
		t.Fatalf("state %+v", s)
	}
	if got, _ := os.ReadFile(again.CurrentPath()); string(got) != "good" {
		t.Fatalf("current runs %q", got)
	}
	if ok, _ := again.RecoverTrial(); ok {
		t.Fatal("recovered twice")
	}
	if _, err := again.Clear(); err != nil {
		t.Fatal(err)
	}
	st, err = again.Stage(t.Context(), f.release(t, "v0.3.0", 3, []byte("third")))
	if err != nil {
		t.Fatal(err)
	}
	if err := again.BeginTrial(st); err != nil {
		t.Fatal(err)
	}
	if err := again.Activate(st); err != nil {
		t.Fatal(err)
	}
	if ok, _ := again.RecoverTrial(); ok {
		t.Fatal("an activated build's trial was recovered")
	}
}
