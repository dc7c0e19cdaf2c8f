package bcd_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/bcd"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/upgrade"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

// buildBCD builds bcd with version linked in, into dir.
func buildBCD(t *testing.T, dir, version string) string {
	t.Helper()
	out := filepath.Join(dir, "bcd-"+version)
	cmd := exec.Command("go", "build", "-ldflags", "-X github.com/bettercompute/bettercompute/agent/bcd.Version="+version, "-o", out,
		"github.com/bettercompute/bettercompute/agent/cmd/bcd")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build bcd %s: %v\n%s", version, err, b)
	}
	return out
}

// releaser signs manifests for builds it serves over loopback http.
type releaser struct {
	priv ed25519.PrivateKey
	srv  *httptest.Server
	dir  string
}

// release serves the file at path and returns its signed manifest with
// counter and expiry.
func (r *releaser) release(t *testing.T, version, path string, counter uint64, notAfter time.Time) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	name := "bcd-" + version + "-" + hex.EncodeToString([]byte{byte(counter)})
	if err := os.WriteFile(filepath.Join(r.dir, name), b, 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	m := &agentrelease.Manifest{Version: version, URL: r.srv.URL + "/" + name, SHA256: hex.EncodeToString(sum[:]), Size: int64(len(b)),
		Platform: runtime.GOOS + "/" + runtime.GOARCH, NotAfter: notAfter, Counter: counter}
	if err := agentrelease.Sign(m, r.priv); err != nil {
		t.Fatal(err)
	}
	enc, err := agentrelease.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return enc
}

// TestUpgradeWithRealBuilds runs a real bcd v0.1.0 against the fake control
// plane and moves it through the agent section: to v0.2.0 (staged A/B, on
// trial, exec'd: the same process reconnects reporting v0.2.0); to a build
// that exits at start (rolled back, the old build reconnects, UpgradeFailed
// latched and reported); after `bcd upgrade clear`, an older signed manifest
// and an expired one are refused; then a signed agent.upgrade command
// upgrades it to v0.3.1 now: the command succeeds, and the daemon
// reconnects as v0.3.1 from slot B (A holds v0.2.0, the previous build).
func TestUpgradeWithRealBuilds(t *testing.T) {
	if testing.Short() {
		t.Skip("builds bcd twice")
	}
	t.Parallel()
	dir := t.TempDir()
	v1, v2, v3 := buildBCD(t, dir, "v0.1.0"), buildBCD(t, dir, "v0.2.0"), buildBCD(t, dir, "v0.3.1")
	broken := filepath.Join(dir, "broken.sh")
	if err := os.WriteFile(broken, []byte("#!/bin/sh\necho 'broken build: exiting at start' >&2\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}

	cp := testcontrol.New(t)
	root := joinMock(t, cp, dir)
	pub, priv, _ := ed25519.GenerateKey(nil)
	cmdPub, cmdPriv, _ := ed25519.GenerateKey(nil)
	cmdDER, _ := x509.MarshalPKIXPublicKey(cmdPub)
	cmdKey := filepath.Join(dir, "command.pub")
	if err := os.WriteFile(cmdKey, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: cmdDER}), 0o644); err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKIXPublicKey(pub)
	keyFile := filepath.Join(dir, "release.pub")
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	artifacts := filepath.Join(dir, "artifacts")
	if err := os.Mkdir(artifacts, 0o755); err != nil {
		t.Fatal(err)
	}
	rel := &releaser{priv: priv, dir: artifacts, srv: httptest.NewServer(http.FileServer(http.Dir(artifacts)))}
	t.Cleanup(rel.srv.Close)

	var logs bytes.Buffer
	node := exec.Command(v1, "node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-up",
		"--site-root", filepath.Join(dir, "sys"), "--release-key", keyFile, "--command-key", cmdKey)
	node.Stdout, node.Stderr = &logs, &logs
	if err := node.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- node.Wait() }()
	t.Cleanup(func() {
		_ = node.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited: //nolint:errcheck // stopped on purpose: its exit status says nothing
		case <-time.After(20 * time.Second):
			_ = node.Process.Kill()
			<-exited //nolint:errcheck // killed on purpose: its exit status says nothing
		}
		if t.Failed() {
			t.Logf("bcd's log:\n%s", logs.String())
		}
	})
	// Inventory reports are drained: the fake gateway blocks on a full
	// channel.
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() {
		for {
			select {
			case <-cp.Reports:
			case <-ctx.Done():
				return
			}
		}
	}()
	hello := func(want string) {
		t.Helper()
		select {
		case h := <-cp.Hellos:
			if h.GetAgentVersion() != want {
				t.Fatalf("Hello from bcd %s, want %s", h.GetAgentVersion(), want)
			}
		case err := <-exited:
			t.Fatalf("bcd exited: %v", err)
		case <-time.After(60 * time.Second):
			t.Fatalf("no Hello from bcd %s", want)
		}
	}
	// agent waits for an Observed of generation gen and returns its agent
	// section.
	agent := func(gen int64) *agentv1.SectionStatus {
		t.Helper()
		for {
			select {
			case o := <-cp.Observed:
				for _, s := range o.GetSections() {
					if s.GetSection() == "agent" && s.GetGeneration() == gen && s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED {
						return s
					}
				}
			case err := <-exited:
				t.Fatalf("bcd exited: %v", err)
			case <-time.After(60 * time.Second):
				t.Fatalf("no Observed agent section of generation %d", gen)
			}
		}
	}
	hello("v0.1.0")
	var nodeID string
	desire := func(gen int64, manifest []byte) {
		cp.SetDesired(&agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: nodeID},
			Agent: &agentv1.AgentSettings{DesiredVersion: "x", ReleaseManifest: manifest}}})
	}
	id, err := os.ReadFile(filepath.Join(root, "node_id"))
	if err == nil {
		nodeID = strings.TrimSpace(string(id))
	}
	inst := upgrade.New(upgrade.Config{Root: root})
	future := time.Now().Add(time.Hour)

	// 1. v0.2.0: the build on trial reports, then the daemon execs it and
	// reconnects as v0.2.0, the same process; the same manifest again
	// converges (running v0.2.0).
	m2 := rel.release(t, "v0.2.0", v2, 2, future)
	desire(1, m2)
	hello("v0.2.0") // on trial
	hello("v0.2.0") // exec'd
	desire(2, m2)
	if s := agent(2); s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || s.GetReason() != "running bcd v0.2.0" {
		t.Fatalf("agent section after the upgrade: %v", s)
	}
	if st, err := inst.State(); err != nil || st.Counter != 2 || st.Version != "v0.2.0" || st.Failed != nil {
		t.Fatalf("upgrade state %+v %v", st, err)
	}
	if b, _ := os.ReadFile(inst.CurrentPath()); !bytes.Equal(b, mustRead(t, v2)) {
		t.Fatal("current is not the v0.2.0 build")
	}
	var exe string
	if exe, err = os.Readlink("/proc/" + itoa(node.Process.Pid) + "/exe"); err != nil || exe != filepath.Join(root, "bin", "bcd.A") {
		t.Fatalf("the daemon's process runs %q (%v), want the exec'd slot A", exe, err)
	}

	// 2. A build that exits at start: rolled back (the v0.2.0 process
	// opens its session again), UpgradeFailed latched and reported
	// terminal; the previous slot still current.
	desire(3, rel.release(t, "v0.3.0", broken, 3, future))
	hello("v0.2.0")
	s := agent(3)
	if s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.HasPrefix(s.GetReason(), "UpgradeFailed: ") ||
		!strings.Contains(s.GetReason(), "v0.3.0") || !strings.Contains(s.GetReason(), "exit status 3") {
		t.Fatalf("agent section after a broken build: %v", s)
	}
	if st, _ := inst.State(); st.Failed == nil || st.Failed.Counter != 3 || st.Counter != 2 {
		t.Fatalf("upgrade state %+v", st)
	}
	if b, _ := os.ReadFile(inst.CurrentPath()); !bytes.Equal(b, mustRead(t, v2)) {
		t.Fatal("current is not v0.2.0 after the rollback")
	}

	// 3. While latched, a signed agent.upgrade is refused with the latch;
	// one that only clears it (what nodes.clearUpgrade queues) clears it.
	// Then an older signed manifest (a replay of v0.1.0) and an expired one
	// are refused, each with its reason; v0.2.0 keeps running.
	upgradeCmd := func(seq int64, p *agentv1.AgentUpgrade) *agentv1.CommandUpdate {
		t.Helper()
		body, err := proto.Marshal(&agentv1.CommandBody{Kind: &agentv1.CommandBody_AgentUpgrade{AgentUpgrade: p}})
		if err != nil {
			t.Fatal(err)
		}
		c := &agentv1.Command{Id: "cmd_" + itoa(int(seq)), NodeId: nodeID, Seq: seq, Kind: "agent.upgrade", Body: body, NotAfter: timestamppb.New(time.Now().Add(time.Minute))}
		commandsig.Sign(c, testcontrol.TrustDomain, cmdPriv)
		cp.SendCommand(c)
		for {
			select {
			case u := <-cp.Updates:
				if u.GetSeq() == seq && u.GetOutcome() != agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED {
					return u
				}
			case <-time.After(60 * time.Second):
				t.Fatalf("no outcome of agent.upgrade seq %d", seq)
			}
		}
	}
	if u := upgradeCmd(1, &agentv1.AgentUpgrade{ReleaseManifest: rel.release(t, "v0.3.2", v3, 4, future)}); u.GetOutcome() != agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED ||
		!strings.Contains(u.GetReason(), upgrade.ErrLatched.Error()) {
		t.Fatalf("agent.upgrade while latched: %v", u)
	}
	if u := upgradeCmd(2, &agentv1.AgentUpgrade{ClearUpgradeFailed: true, Reason: "fixed"}); u.GetOutcome() != agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED {
		t.Fatalf("agent.upgrade clear: %v", u)
	}
	if st, _ := inst.State(); st.Failed != nil {
		t.Fatalf("still latched: %+v", st.Failed)
	}
	var out, errb bytes.Buffer
	if code := bcd.Run(context.Background(), []string{"upgrade", "clear", "--root", root}, &out, &errb); code != 0 || !strings.Contains(out.String(), "was not latched") {
		t.Fatalf("bcd upgrade clear: %d %q %q", code, out.String(), errb.String())
	}
	desire(4, rel.release(t, "v0.1.0", v1, 1, future))
	if s := agent(4); s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(s.GetReason(), upgrade.ErrOlderCounter.Error()) {
		t.Fatalf("an older manifest: %v", s)
	}
	desire(5, rel.release(t, "v0.4.0", v1, 4, time.Now().Add(-time.Minute)))
	if s := agent(5); s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(s.GetReason(), agentrelease.ErrExpired.Error()) {
		t.Fatalf("an expired manifest: %v", s)
	}
	select {
	case h := <-cp.Hellos:
		t.Fatalf("a refused manifest reconnected the daemon: %v", h.Hello)
	default:
	}

	// 4. agent.upgrade, signed with the command key, carrying a manifest
	// signed with the release key.
	if u := upgradeCmd(3, &agentv1.AgentUpgrade{ReleaseManifest: rel.release(t, "v0.3.1", v3, 5, future), Reason: "test"}); u.GetOutcome() != agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED {
		t.Fatalf("agent.upgrade: %v", u)
	}
	hello("v0.3.1") // on trial
	hello("v0.3.1") // exec'd
	if st, _ := inst.State(); st.Counter != 5 || st.Version != "v0.3.1" {
		t.Fatalf("upgrade state %+v", st)
	}
	if exe, err = os.Readlink("/proc/" + itoa(node.Process.Pid) + "/exe"); err != nil || exe != filepath.Join(root, "bin", "bcd.B") {
		t.Fatalf("the daemon's process runs %q (%v), want the exec'd slot B (A held v0.2.0)", exe, err)
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func itoa(n int) string { return strconv.Itoa(n) }

// TestUpgradeTrialTimeoutRollsBack: a build that starts but never opens its
// session (it sleeps) is stopped when the trial's timeout passes; the
// daemon keeps its build, opens its session again and reports the agent
// section FAILED_TERMINAL with UpgradeFailed, latched. (The daemon runs in
// process: a failed trial never execs.)
func TestUpgradeTrialTimeoutRollsBack(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	hang := filepath.Join(dir, "hang.sh")
	if err := os.WriteFile(hang, []byte("#!/bin/sh\nexec sleep 600\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cp := testcontrol.New(t)
	root := joinMock(t, cp, dir)
	pub, priv, _ := ed25519.GenerateKey(nil)
	der, _ := x509.MarshalPKIXPublicKey(pub)
	keyFile := filepath.Join(dir, "release.pub")
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	artifacts := filepath.Join(dir, "artifacts")
	if err := os.Mkdir(artifacts, 0o755); err != nil {
		t.Fatal(err)
	}
	rel := &releaser{priv: priv, dir: artifacts, srv: httptest.NewServer(http.FileServer(http.Dir(artifacts)))}
	t.Cleanup(rel.srv.Close)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var nodeErr bytes.Buffer
	go func() {
		done <- bcd.Run(ctx, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-hang",
			"--site-root", filepath.Join(dir, "sys"), "--release-key", keyFile, "--upgrade-trial-timeout", "2s"}, &bytes.Buffer{}, &nodeErr)
	}()
	defer func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("node exited %d: %s", code, nodeErr.String())
		}
	}()
	go func() {
		for {
			select {
			case <-cp.Reports:
			case <-ctx.Done():
				return
			}
		}
	}()
	var nodeID string
	select {
	case h := <-cp.Hellos:
		nodeID = h.GetNodeId()
	case <-time.After(20 * time.Second):
		t.Fatal("no Hello")
	}
	cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: nodeID},
		Agent: &agentv1.AgentSettings{ReleaseManifest: rel.release(t, "v9.0.0", hang, 1, time.Now().Add(time.Hour))}}})
	for {
		select {
		case o := <-cp.Observed:
			for _, s := range o.GetSections() {
				if s.GetSection() != "agent" || s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL {
					continue
				}
				if !strings.HasPrefix(s.GetReason(), "UpgradeFailed: ") || !strings.Contains(s.GetReason(), "did not open its session and report within 2s") {
					t.Fatalf("agent section %v", s)
				}
				if st, _ := upgrade.New(upgrade.Config{Root: root}).State(); st.Failed == nil || st.Failed.Version != "v9.0.0" {
					t.Fatalf("upgrade state %+v", st)
				}
				return
			}
		case <-time.After(60 * time.Second):
			t.Fatalf("no UpgradeFailed; log:\n%s", nodeErr.String())
		}
	}
}
