package bcd_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/bcd"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
)

// TestJoinThenNode runs `bcd join` and `bcd node` against the fake control
// plane over real gRPC and TLS.
func TestJoinThenNode(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	dir := t.TempDir()
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

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var nodeErr bytes.Buffer
	go func() {
		done <- bcd.Run(ctx, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-cli"}, &bytes.Buffer{}, &nodeErr)
	}()
	select {
	case h := <-cp.Hellos:
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
	cancel()
	if code := <-done; code != 0 {
		t.Errorf("node exited %d after cancel: %s", code, nodeErr.String())
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
