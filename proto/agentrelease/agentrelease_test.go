package agentrelease_test

import (
	"crypto/ed25519"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

var now = time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)

func manifest() *agentrelease.Manifest {
	return &agentrelease.Manifest{Version: "v0.3.1", URL: "https://cp.example/artifacts/bcd-v0.3.1-linux-amd64",
		SHA256: strings.Repeat("ab", 32), Size: 1234, Platform: "linux/amd64", NotAfter: now.Add(time.Hour), Counter: 7}
}

func TestSignVerify(t *testing.T) {
	t.Parallel()
	pub, priv, _ := ed25519.GenerateKey(nil)
	other, otherPriv, _ := ed25519.GenerateKey(nil)
	m := manifest()
	if err := agentrelease.Sign(m, priv); err != nil {
		t.Fatal(err)
	}
	if err := agentrelease.Verify(m, pub, now); err != nil {
		t.Fatalf("a signed manifest: %v", err)
	}
	// Through its encoding, too.
	b, err := agentrelease.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	back, err := agentrelease.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if err := agentrelease.Verify(back, pub, now); err != nil {
		t.Fatalf("a signed manifest, encoded and parsed: %v", err)
	}
	if err := agentrelease.Verify(m, other, now); !errors.Is(err, agentrelease.ErrBadSignature) {
		t.Fatalf("another key: %v", err)
	}
	if err := agentrelease.Verify(m, nil, now); !errors.Is(err, agentrelease.ErrBadSignature) {
		t.Fatalf("no pinned key: %v", err)
	}
	if err := agentrelease.Verify(manifest(), pub, now); !errors.Is(err, agentrelease.ErrBadSignature) {
		t.Fatalf("unsigned: %v", err)
	}
	// Signed by another key that claims the pinned key's id.
	forged := manifest()
	if err := agentrelease.Sign(forged, otherPriv); err != nil {
		t.Fatal(err)
	}
	forged.KeyID = agentrelease.KeyID(pub)
	if err := agentrelease.Verify(forged, pub, now); !errors.Is(err, agentrelease.ErrBadSignature) {
		t.Fatalf("forged key id: %v", err)
	}
}

// TestChangedFieldBreaksSignature changes each signed field of a signed
// manifest: every change is ErrBadSignature.
func TestChangedFieldBreaksSignature(t *testing.T) {
	t.Parallel()
	pub, priv, _ := ed25519.GenerateKey(nil)
	for name, change := range map[string]func(*agentrelease.Manifest){
		"version":  func(m *agentrelease.Manifest) { m.Version = "v0.3.2" },
		"url":      func(m *agentrelease.Manifest) { m.URL += "x" },
		"sha256":   func(m *agentrelease.Manifest) { m.SHA256 = strings.Repeat("cd", 32) },
		"size":     func(m *agentrelease.Manifest) { m.Size++ },
		"platform": func(m *agentrelease.Manifest) { m.Platform = "linux/arm64" },
		"notAfter": func(m *agentrelease.Manifest) { m.NotAfter = m.NotAfter.Add(time.Hour) },
		"counter":  func(m *agentrelease.Manifest) { m.Counter++ },
	} {
		m := manifest()
		if err := agentrelease.Sign(m, priv); err != nil {
			t.Fatal(err)
		}
		d := agentrelease.Digest(m)
		change(m)
		if err := agentrelease.Verify(m, pub, now); !errors.Is(err, agentrelease.ErrBadSignature) {
			t.Errorf("%s changed: %v, want ErrBadSignature", name, err)
		}
		if agentrelease.Digest(m) == d {
			t.Errorf("%s changed: same digest", name)
		}
	}
}

func TestExpired(t *testing.T) {
	t.Parallel()
	pub, priv, _ := ed25519.GenerateKey(nil)
	m := manifest()
	if err := agentrelease.Sign(m, priv); err != nil {
		t.Fatal(err)
	}
	for _, at := range []time.Time{m.NotAfter, m.NotAfter.Add(time.Second)} {
		if err := agentrelease.Verify(m, pub, at); !errors.Is(err, agentrelease.ErrExpired) {
			t.Errorf("at %s: %v, want ErrExpired", at, err)
		}
	}
}

func TestMalformed(t *testing.T) {
	t.Parallel()
	_, priv, _ := ed25519.GenerateKey(nil)
	for field, change := range map[string]func(*agentrelease.Manifest){
		"version":   func(m *agentrelease.Manifest) { m.Version = "latest" },
		"url":       func(m *agentrelease.Manifest) { m.URL = "http://cp.example/bcd" },
		"url ":      func(m *agentrelease.Manifest) { m.URL = "https://user:pw@cp.example/bcd" },
		"sha256":    func(m *agentrelease.Manifest) { m.SHA256 = "abc" },
		"size":      func(m *agentrelease.Manifest) { m.Size = agentrelease.MaxArtifactBytes + 1 },
		"platform":  func(m *agentrelease.Manifest) { m.Platform = "linux" },
		"notAfter":  func(m *agentrelease.Manifest) { m.NotAfter = time.Time{} },
		"counter":   func(m *agentrelease.Manifest) { m.Counter = 0 },
		"sha256 ":   func(m *agentrelease.Manifest) { m.SHA256 = strings.Repeat("AB", 32) },
		"version  ": func(m *agentrelease.Manifest) { m.Version = "v01.2.3" },
	} {
		m := manifest()
		change(m)
		err := agentrelease.Sign(m, priv)
		if !errors.Is(err, agentrelease.ErrMalformed) || !strings.Contains(err.Error(), strings.TrimSpace(field)+":") {
			t.Errorf("%s: %v, want ErrMalformed naming the field", field, err)
		}
	}
	if err := agentrelease.CheckURL("http://127.0.0.1:8080/a"); err != nil {
		t.Errorf("loopback http: %v", err)
	}
	if _, err := agentrelease.Parse(make([]byte, agentrelease.MaxManifestBytes+1)); !errors.Is(err, agentrelease.ErrMalformed) {
		t.Errorf("oversized: %v", err)
	}
}

func TestVersionCompare(t *testing.T) {
	t.Parallel()
	order := []string{"v0.0.1", "v0.1.0-rc.1", "v0.1.0-rc.2", "0.1.0", "v0.1.1", "v0.2.0", "v1.0.0+build.5", "v1.10.0"}
	for i := range order {
		for j := range order {
			a, err := agentrelease.ParseVersion(order[i])
			if err != nil {
				t.Fatal(err)
			}
			b, _ := agentrelease.ParseVersion(order[j])
			want := 0
			if i < j {
				want = -1
			} else if i > j {
				want = 1
			}
			if got := a.Compare(b); got != want {
				t.Errorf("%s vs %s: %d, want %d", order[i], order[j], got, want)
			}
		}
	}
	for _, bad := range []string{"", "dev", "v1.2", "v1.2.3.4", "v1.2.x", "v1.2.3-", "v-1.2.3"} {
		if _, err := agentrelease.ParseVersion(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}
