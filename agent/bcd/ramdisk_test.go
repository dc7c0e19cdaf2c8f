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
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/bcd"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
	"github.com/bettercompute/bettercompute/proto/resultsig"
)

// TestRamdisk_JoinsFromKernelArgsAndSignsResults runs `bcd ramdisk`
// against the fake control plane over real gRPC and TLS, with the token and
// gateway from a kernel command line: it joins with role ramdisk and an
// Ed25519 key, wipes a disk of its inventory on a signed disk.wipe and
// signs the result with the key its certificate binds.
func TestRamdisk_JoinsFromKernelArgsAndSignsResults(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	dir := t.TempDir()
	root := filepath.Join(dir, "run")
	caFile := filepath.Join(dir, "ca.pem")
	keyFile := filepath.Join(dir, "joinservice.pub")
	cmdline := filepath.Join(dir, "cmdline")
	disk := filepath.Join(dir, "disk0")
	write := func(path string, b []byte) {
		t.Helper()
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cp.CA.Raw}))
	write(keyFile, []byte(hex.EncodeToString(cp.PublicKey)+"\n"))
	write(cmdline, []byte("quiet bc.gateway="+cp.Addr+" bc.boot_token="+cp.Token+"\n"))
	write(disk, bytes.Repeat([]byte{0xab}, 1<<16))
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	cmdKey := filepath.Join(dir, "command.pub")
	write(cmdKey, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var errb bytes.Buffer
	go func() {
		done <- bcd.Run(ctx, []string{"ramdisk", "--cmdline", cmdline, "--root", root, "--joinservice-key", keyFile, "--ca", caFile,
			"--nvml", "mock", "--boot-id", "boot-ramdisk", "--disks", disk, "--command-key", cmdKey, "--hostname", "m1"}, &bytes.Buffer{}, &errb)
	}()
	var h testcontrol.Hello
	select {
	case h = <-cp.Hellos:
	case code := <-done:
		t.Fatalf("ramdisk exited %d: %s", code, errb.String())
	case <-time.After(30 * time.Second):
		t.Fatal("no Hello from bcd ramdisk")
	}
	// The certificate it holds binds an Ed25519 key, never written to disk.
	chain, err := os.ReadFile(filepath.Join(root, "cert.pem"))
	if err != nil {
		entries, _ := os.ReadDir(root)
		t.Fatalf("no stored certificate (%v); root has %v", err, entries)
	}
	blk, _ := pem.Decode(chain)
	leaf, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	certKey, err := resultsig.PublicKey(leaf)
	if err != nil {
		t.Fatalf("ramdisk certificate key: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "node.key")); err == nil {
		t.Error("the ramdisk wrote a key to its root")
	}

	c := &agentv1.Command{Id: "cmd_wipe", NodeId: h.GetNodeId(), Seq: 1, Kind: "disk.wipe", NotAfter: timestamppb.New(time.Now().Add(time.Minute)),
		Body: mustBody(t, &agentv1.CommandBody{Kind: &agentv1.CommandBody_DiskWipe{DiskWipe: &agentv1.DiskWipe{
			Disks: []string{disk}, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO, Reason: "commissioning"}}})}
	commandsig.Sign(c, testcontrol.TrustDomain, priv)
	cp.SendCommand(c)
	var final *agentv1.CommandUpdate
	deadline := time.After(30 * time.Second)
	for final == nil {
		select {
		case u := <-cp.Updates:
			if u.GetOutcome() != agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED {
				final = u
			}
		case <-deadline:
			t.Fatal("no final update for disk.wipe")
		}
	}
	if final.GetOutcome() != agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED {
		t.Fatalf("disk.wipe: %v", final)
	}
	s := resultsig.Subject{TrustDomain: testcontrol.TrustDomain, NodeID: h.GetNodeId(), CommandID: c.GetId(), Kind: c.GetKind(), Seq: c.GetSeq()}
	if err := resultsig.Verify(final, s, certKey); err != nil {
		t.Fatalf("the wipe's result does not verify with the certificate's key: %v", err)
	}
	if b, _ := os.ReadFile(disk); !bytes.Equal(b, make([]byte, len(b))) {
		t.Error("the disk was not zeroed")
	}
	cancel()
	if code := <-done; code != 0 {
		t.Errorf("ramdisk exited %d after cancel: %s", code, errb.String())
	}
}

func mustBody(t *testing.T, b *agentv1.CommandBody) []byte {
	t.Helper()
	out, err := proto.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return out
}
