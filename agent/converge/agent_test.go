package converge_test

import (
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/upgrade"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestAgentSection plans the agent section through its cases: no manifest
// (a desired version alone is not built yet), no pinned key, a manifest
// that is not one, the running version (converged), an accepted one
// (staged into slot A, handed over, FAILED meanwhile), and a download with
// another digest (failed, then terminal for that manifest).
func TestAgentSection(t *testing.T) {
	t.Parallel()
	pub, priv, _ := ed25519.GenerateKey(nil)
	body := []byte("the build")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/bad" {
			_, _ = w.Write([]byte("the bilD"))
			return
		}
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)
	sum := sha256.Sum256(body)
	manifest := func(version, path string, counter uint64) []byte {
		m := &agentrelease.Manifest{Version: version, URL: srv.URL + path, SHA256: hex.EncodeToString(sum[:]), Size: int64(len(body)),
			Platform: runtime.GOOS + "/" + runtime.GOARCH, NotAfter: time.Now().Add(time.Hour), Counter: counter}
		if err := agentrelease.Sign(m, priv); err != nil {
			t.Fatal(err)
		}
		b, _ := agentrelease.Encode(m)
		return b
	}
	converger := func(inst *upgrade.Installer, handover func(upgrade.Staged)) *converge.Converger {
		c, err := converge.New(converge.Config{Root: t.TempDir(), NodeID: "node_1", Agent: converge.Agent{Version: "v0.1.0", Installer: inst, Handover: handover}})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	agent := func(c *converge.Converger, gen int64, a *agentv1.AgentSettings) *agentv1.SectionStatus {
		ss, _ := c.Converge(context.Background(), &agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{Agent: a}})
		return states(ss)["agent"]
	}
	const (
		converged = agentv1.SectionState_SECTION_STATE_CONVERGED
		failed    = agentv1.SectionState_SECTION_STATE_FAILED
		terminal  = agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL
	)
	noKey := converger(nil, nil)
	for _, tc := range []struct {
		a      *agentv1.AgentSettings
		state  agentv1.SectionState
		reason string
	}{
		{&agentv1.AgentSettings{}, converged, ""},
		{&agentv1.AgentSettings{DesiredVersion: "v0.3.1"}, terminal, "not built yet: would upgrade bcd to v0.3.1"},
		{&agentv1.AgentSettings{ReleaseManifest: manifest("v0.2.0", "/ok", 1)}, terminal, "no release key pinned"},
		{&agentv1.AgentSettings{ReleaseManifest: []byte("{")}, terminal, "release manifest: release manifest malformed"},
		{&agentv1.AgentSettings{ReleaseManifest: manifest("v0.1.0", "/ok", 1)}, converged, "running bcd v0.1.0"},
	} {
		if s := agent(noKey, 1, tc.a); s.GetState() != tc.state || !strings.Contains(s.GetReason(), tc.reason) {
			t.Errorf("%v: %v, want %s %q", tc.a, s, tc.state, tc.reason)
		}
	}

	root := t.TempDir()
	inst := upgrade.New(upgrade.Config{Root: root, Key: pub})
	var mu sync.Mutex
	var handed []upgrade.Staged
	c := converger(inst, func(st upgrade.Staged) { mu.Lock(); handed = append(handed, st); mu.Unlock() })
	if s := agent(c, 1, &agentv1.AgentSettings{ReleaseManifest: manifest("v0.2.0", "/ok", 2)}); s.GetState() != failed || !strings.Contains(s.GetReason(), "staged, handing over") {
		t.Fatalf("an accepted manifest: %v", s)
	}
	mu.Lock()
	if len(handed) != 1 || handed[0].Slot != upgrade.SlotA || handed[0].Manifest.Version != "v0.2.0" {
		t.Fatalf("handed over %+v", handed)
	}
	mu.Unlock()
	if b, err := os.ReadFile(handed[0].Path); err != nil || string(b) != string(body) {
		t.Fatalf("staged %q %v", b, err)
	}
	bad := manifest("v0.2.1", "/bad", 3)
	if s := agent(c, 2, &agentv1.AgentSettings{ReleaseManifest: bad}); s.GetState() != failed || !strings.Contains(s.GetReason(), upgrade.ErrDigestMismatch.Error()) {
		t.Fatalf("a download with another digest: %v", s)
	}
	if s := agent(c, 3, &agentv1.AgentSettings{ReleaseManifest: bad}); s.GetState() != terminal || !strings.Contains(s.GetReason(), upgrade.ErrDigestMismatch.Error()) {
		t.Fatalf("the same manifest again: %v", s)
	}
}
