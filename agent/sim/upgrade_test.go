package sim_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// release publishes a simulated build of version with counter, served by
// srv at /<version>, and returns its signed manifest.
func release(t *testing.T, key ed25519.PrivateKey, base, version string, counter uint64) []byte {
	t.Helper()
	build := []byte("simulated bcd " + version)
	sum := sha256.Sum256(build)
	m := &agentrelease.Manifest{Version: version, URL: base + "/" + version, SHA256: hex.EncodeToString(sum[:]), Size: int64(len(build)),
		Platform: runtime.GOOS + "/" + runtime.GOARCH, NotAfter: time.Now().Add(time.Hour), Counter: counter}
	if err := agentrelease.Sign(m, key); err != nil {
		t.Fatal(err)
	}
	b, err := agentrelease.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// agentSection waits for an Observed of generation gen and returns its
// agent section.
func agentSection(t *testing.T, cp *testcontrol.Server, gen int64) *agentv1.SectionStatus {
	t.Helper()
	for {
		o := recv(t, cp.Observed, "Observed")
		if o.GetObservedGeneration() != gen {
			continue
		}
		for _, s := range o.GetSections() {
			if s.GetSection() == "agent" && s.GetState() != agentv1.SectionState_SECTION_STATE_PROGRESSING &&
				s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED {
				return s
			}
		}
	}
}

// TestFleet_SimulatedUpgrade: a simulated node given a signed release
// manifest downloads and checks the build with bcd's installer, and after
// the simulated handover reconnects reporting the new version, its agent
// section converged; a build whose simulated trial fails is rolled back and
// latched: the section reports FAILED_TERMINAL "UpgradeFailed: …" and the
// node keeps its version. A manifest signed by another key is refused.
func TestFleet_SimulatedUpgrade(t *testing.T) {
	t.Parallel()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	_, other, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("simulated bcd " + strings.TrimPrefix(r.URL.Path, "/")))
	}))
	t.Cleanup(srv.Close)
	cp := testcontrol.New(t)
	f, err := sim.Start(context.Background(), sim.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token, JoinserviceKey: cp.PublicKey, JoinserviceKeyID: cp.KeyID,
		Root: t.TempDir(), AgentVersion: "v0.1.0", ReleaseKey: pub,
		FailUpgrade: func(_ int, version string) bool { return version == "v0.3.0" },
	}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	node := f.Nodes()[0]
	if h := recv(t, cp.Hellos, "Hello"); h.GetAgentVersion() != "v0.1.0" {
		t.Fatalf("first Hello reports %q", h.GetAgentVersion())
	}

	cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: node},
		Agent:    &agentv1.AgentSettings{ReleaseManifest: release(t, other, srv.URL, "v0.2.0", 1)},
	}})
	if s := agentSection(t, cp, 1); s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(s.GetReason(), "signature") {
		t.Fatalf("a manifest of another key: %v", s)
	}

	cp.SetDesired(&agentv1.DesiredState{Generation: 2, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: node},
		Agent:    &agentv1.AgentSettings{ReleaseManifest: release(t, priv, srv.URL, "v0.2.0", 1)},
	}})
	for {
		if h := recv(t, cp.Hellos, "Hello"); h.GetAgentVersion() == "v0.2.0" {
			break
		}
	}
	if s := agentSection(t, cp, 2); s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || s.GetReason() != "running bcd v0.2.0" {
		t.Fatalf("after the upgrade: %v", s)
	}
	if v := f.Version(0); v != "v0.2.0" {
		t.Fatalf("Version %q", v)
	}

	cp.SetDesired(&agentv1.DesiredState{Generation: 3, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: node},
		Agent:    &agentv1.AgentSettings{ReleaseManifest: release(t, priv, srv.URL, "v0.3.0", 2)},
	}})
	s := agentSection(t, cp, 3)
	if s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.HasPrefix(s.GetReason(), "UpgradeFailed:") ||
		!strings.Contains(s.GetReason(), "v0.3.0") {
		t.Fatalf("after a failed trial: %v", s)
	}
	if v := f.Version(0); v != "v0.2.0" {
		t.Fatalf("Version after the rollback %q", v)
	}
}
