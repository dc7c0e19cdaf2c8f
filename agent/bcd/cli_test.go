package bcd_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/bcd"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/siteconf"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

// joinMock runs `bcd join` with the mock NVML against cp, state under
// dir/root, and returns that root.
func joinMock(t *testing.T, cp *testcontrol.Server, dir string) string {
	t.Helper()
	root := filepath.Join(dir, "root")
	caFile := filepath.Join(dir, "ca.pem")
	keyFile := filepath.Join(dir, "joinservice.pub")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cp.CA.Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, []byte(hex.EncodeToString(cp.PublicKey)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	code := bcd.Run(context.Background(), []string{"join", "--token", cp.Token, "--gateway", cp.Addr, "--root", root,
		"--joinservice-key", keyFile, "--ca", caFile, "--nvml", "mock"}, &out, &errb)
	if code != 0 || !strings.Contains(out.String(), "joined as node_") {
		t.Fatalf("join: exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	}
	return root
}

// TestJoinThenNode runs `bcd join` and `bcd node` against the fake control
// plane over real gRPC and TLS.
func TestJoinThenNode(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	dir := t.TempDir()
	root := joinMock(t, cp, dir)

	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	cmdKey := filepath.Join(dir, "command.pub")
	if err := os.WriteFile(cmdKey, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}

	// The site section's files go under --site-root: a system root with
	// systemd-timesyncd installed.
	siteRoot := filepath.Join(dir, "sys")
	if err := os.MkdirAll(filepath.Join(siteRoot, "etc/systemd"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(siteRoot, siteconf.TimesyncdConf), []byte("[Time]\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var nodeErr bytes.Buffer
	go func() {
		done <- bcd.Run(ctx, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-cli",
			"--command-key", cmdKey, "--deny-kinds", "logs.collect, inventory.refresh", "--site-root", siteRoot}, &bytes.Buffer{}, &nodeErr)
	}()
	var nodeID string
	select {
	case h := <-cp.Hellos:
		nodeID = h.GetNodeId()
		if h.GetBootId() != "boot-cli" || !strings.HasPrefix(h.GetNodeId(), "node_") {
			t.Errorf("hello %v", h.Hello)
		}
	case code := <-done:
		t.Fatalf("node exited %d: %s", code, nodeErr.String())
	case <-time.After(20 * time.Second):
		t.Fatal("no Hello from bcd node")
	}
	select {
	case rep := <-cp.Reports:
		if len(rep.GetGpus()) != 8 {
			t.Errorf("%d GPUs", len(rep.GetGpus()))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no inventory from bcd node")
	}
	// Without --allow-reboot a signed node.reboot is UNSUPPORTED (an
	// unsigned one is BAD_SIGNATURE first: destructive kinds are checked
	// before anything else); denied kinds too.
	for seq, kind := range []string{"node.reboot", "logs.collect", "inventory.refresh"} {
		c := &agentv1.Command{Id: "cmd_x", NodeId: nodeID, Seq: int64(seq + 1), Kind: kind, NotAfter: timestamppb.New(time.Now().Add(time.Minute))}
		if kind == "node.reboot" {
			commandsig.Sign(c, testcontrol.TrustDomain, priv)
		}
		cp.SendCommand(c)
		select {
		case u := <-cp.Updates:
			if u.GetReject() != agentv1.RejectCode_REJECT_CODE_UNSUPPORTED || !strings.Contains(u.GetReason(), map[string]string{"node.reboot": "--allow-reboot"}[kind]) {
				t.Errorf("%s: %v", kind, u)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("no answer to %s", kind)
		}
	}
	// The site section is applied under --site-root and reported per field.
	level := "debug"
	cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: nodeID},
		Site: &agentv1.SiteSettings{NtpServers: &agentv1.StringList{Values: []string{"ntp1.example"}}, LogLevel: &level}}})
	var site *agentv1.SectionStatus
	for site == nil {
		select {
		case o := <-cp.Observed:
			for _, s := range o.GetSections() {
				if s.GetSection() == "site" && s.GetGeneration() == 1 {
					site = s
				}
			}
		case <-time.After(20 * time.Second):
			t.Fatal("no Observed for the site section")
		}
	}
	if site.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.Contains(site.GetReason(), "ntp_servers: applied") ||
		!strings.Contains(site.GetReason(), "log_level: applied (debug, live)") {
		t.Errorf("site section %v", site)
	}
	if b, err := os.ReadFile(filepath.Join(siteRoot, siteconf.TimesyncdDropIn)); err != nil || !strings.Contains(string(b), "NTP=ntp1.example") {
		t.Errorf("timesyncd drop-in (%v): %q", err, b)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Errorf("node exited %d after cancel: %s", code, nodeErr.String())
	}
	logged, err := os.ReadFile(filepath.Join(root, "logs", "agent.log"))
	if err != nil || !strings.Contains(string(logged), "session established") || !strings.Contains(string(logged), "--allow-reboot") {
		t.Errorf("agent log (%v): %q", err, logged)
	}
}

func TestNode_BadCommandKey(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "key")
	if err := os.WriteFile(notPEM, []byte("not a key"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{notPEM, filepath.Join(dir, "missing")} {
		var errb bytes.Buffer
		code := bcd.Run(context.Background(), []string{"node", "--gateway", "127.0.0.1:1", "--root", dir, "--boot-id", "b", "--nvml", "mock", "--command-key", key}, &bytes.Buffer{}, &errb)
		if code != 1 || !strings.Contains(errb.String(), "command key") {
			t.Errorf("%s: exit %d, stderr %q", key, code, errb.String())
		}
	}
}

// TestFlags_FromEnvironment is not parallel: it sets BCD_* variables.
func TestFlags_FromEnvironment(t *testing.T) {
	t.Setenv("BCD_GATEWAY", "127.0.0.1:1")
	t.Setenv("BCD_ROOT", t.TempDir())
	t.Setenv("BCD_NVML", "bogus")
	var errb bytes.Buffer
	if code := bcd.Run(context.Background(), []string{"node", "--boot-id", "b"}, &bytes.Buffer{}, &errb); code != 1 || !strings.Contains(errb.String(), `unknown NVML backend "bogus"`) {
		t.Errorf("exit %d, stderr %q", code, errb.String())
	}
}

func TestNode_RealNVMLWithoutDriverFailsClearly(t *testing.T) {
	t.Parallel()
	var errb bytes.Buffer
	code := bcd.Run(context.Background(), []string{"node", "--gateway", "127.0.0.1:1", "--root", t.TempDir(), "--boot-id", "b", "--nvml", "real"}, &bytes.Buffer{}, &errb)
	if code == 0 {
		t.Skip("NVML is available here")
	}
	if !strings.Contains(errb.String(), "NVML not available") {
		t.Errorf("exit %d, stderr %q", code, errb.String())
	}
}
