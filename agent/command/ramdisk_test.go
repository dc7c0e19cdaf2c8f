package command_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
	"github.com/bettercompute/bettercompute/proto/resultsig"
)

// ramdiskFixture is an executor as bcd ramdisk runs it: a Ramdisk over two
// file disks, a recording kexec hook and a result-signing key.
type ramdiskFixture struct {
	*fixture
	disks  []string
	key    ed25519.PrivateKey
	kexecs *kexecRecorder
}

func setupRamdisk(t *testing.T) *ramdiskFixture {
	t.Helper()
	dir := t.TempDir()
	rf := &ramdiskFixture{kexecs: &kexecRecorder{execd: make(chan struct{}, 1)}}
	for _, name := range []string{"sda", "sdb"} {
		p := filepath.Join(dir, name)
		b := make([]byte, 1<<20+100)
		_, _ = rand.Read(b)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		rf.disks = append(rf.disks, p)
	}
	rd, err := ramdisk.New(ramdisk.Config{Disks: rf.disks, Kexec: rf.kexecs, WorkDir: dir, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	if rf.key, err = ramdisk.NewKey(); err != nil {
		t.Fatal(err)
	}
	rf.fixture = setup(t, func(c *command.Config) {
		c.Ramdisk = rd
		c.ResultKey = rf.key
	})
	return rf
}

func (rf *ramdiskFixture) pub() ed25519.PublicKey { return rf.key.Public().(ed25519.PublicKey) }

// signed is a command of kind signed with the control plane's key.
func (f *fixture) signed(seq int64, kind string, body *agentv1.CommandBody) *agentv1.Command {
	c := cmd(seq, kind, body)
	commandsig.Sign(c, trustDomain, f.priv)
	return c
}

func subjectOf(c *agentv1.Command) resultsig.Subject {
	return resultsig.Subject{TrustDomain: trustDomain, NodeID: c.GetNodeId(), CommandID: c.GetId(), Kind: c.GetKind(), Seq: c.GetSeq()}
}

func wipe(method agentv1.WipeMethod, disks ...string) *agentv1.CommandBody {
	return &agentv1.CommandBody{Kind: &agentv1.CommandBody_DiskWipe{DiskWipe: &agentv1.DiskWipe{Disks: disks, Method: method, Reason: "test"}}}
}

type kexecRecorder struct {
	mu            sync.Mutex
	loads, execs  int
	kernel, cmdln string
	execd         chan struct{} // receives each Exec
}

func (k *kexecRecorder) Load(_ context.Context, kernel, _, cmdline string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	b, _ := os.ReadFile(kernel)
	k.loads, k.kernel, k.cmdln = k.loads+1, string(b), cmdline
	return nil
}

func (k *kexecRecorder) Exec(context.Context) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.execs++
	k.execd <- struct{}{}
	return nil
}

func TestDiskWipeSignedResult(t *testing.T) {
	t.Parallel()
	rf := setupRamdisk(t)
	c := rf.signed(1, command.KindDiskWipe, wipe(agentv1.WipeMethod_WIPE_METHOD_ZERO, rf.disks...))
	rf.e.Handle(c)
	u := rf.finish(t, 1)
	expect(t, u, 1, succeeded, noReject)
	res := u.GetResult().GetDiskWipe()
	if len(res.GetDisks()) != 2 || !res.GetDisks()[0].GetVerified() || res.GetDisks()[1].GetBytes() != 1<<20+100 {
		t.Fatalf("result %v", res)
	}
	for _, d := range rf.disks {
		b, _ := os.ReadFile(d)
		for _, x := range b {
			if x != 0 {
				t.Fatalf("%s not zeroed", d)
			}
		}
	}
	if err := resultsig.Verify(u, subjectOf(c), rf.pub()); err != nil {
		t.Fatalf("the ramdisk's report does not verify: %v", err)
	}

	t.Run("a forged report fails Verify", func(t *testing.T) {
		changed := proto.Clone(u).(*agentv1.CommandUpdate)
		changed.GetResult().GetDiskWipe().GetDisks()[1].Bytes++
		other, _ := ramdisk.NewKey()
		resigned := proto.Clone(u).(*agentv1.CommandUpdate)
		if err := resultsig.Sign(resigned, subjectOf(c), other); err != nil {
			t.Fatal(err)
		}
		unsigned := proto.Clone(u).(*agentv1.CommandUpdate)
		unsigned.NodeSignature = nil
		flipped := proto.Clone(u).(*agentv1.CommandUpdate)
		flipped.GetNodeSignature().Signature[0] ^= 0x80
		for name, forged := range map[string]*agentv1.CommandUpdate{"changed byte": changed, "other key": resigned, "unsigned": unsigned, "flipped signature": flipped} {
			if err := resultsig.Verify(forged, subjectOf(c), rf.pub()); !errors.Is(err, resultsig.ErrBadSignature) {
				t.Errorf("%s: %v, want ErrBadSignature", name, err)
			}
		}
		// Replayed as another command's report.
		s := subjectOf(c)
		s.CommandID = "cmd_other"
		if err := resultsig.Verify(u, s, rf.pub()); !errors.Is(err, resultsig.ErrBadSignature) {
			t.Errorf("replayed to another command: %v", err)
		}
	})

	t.Run("a re-delivery, also after a restart, answers the same signed report", func(t *testing.T) {
		rf.e.Handle(c)
		again := rf.next(t)
		if err := resultsig.Verify(again, subjectOf(c), rf.pub()); err != nil || !proto.Equal(again, u) {
			t.Fatalf("re-delivered %v: %v", again, err)
		}
		e2 := rf.open(t, rf.cfg)
		e2.Handle(c)
		again = rf.next(t)
		if err := resultsig.Verify(again, subjectOf(c), rf.pub()); err != nil {
			t.Fatalf("after a restart: %v", err)
		}
	})
}

func TestCommissioningKindsOnTheExecutor(t *testing.T) {
	t.Parallel()

	t.Run("unsigned disk.wipe: BAD_SIGNATURE, nothing wiped", func(t *testing.T) {
		t.Parallel()
		rf := setupRamdisk(t)
		before, _ := os.ReadFile(rf.disks[0])
		rf.e.Handle(cmd(1, command.KindDiskWipe, wipe(agentv1.WipeMethod_WIPE_METHOD_ZERO, rf.disks[0])))
		expect(t, rf.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
		if after, _ := os.ReadFile(rf.disks[0]); string(after) != string(before) {
			t.Fatal("an unsigned wipe wiped")
		}
	})

	t.Run("bcd node (no ramdisk): UNSUPPORTED", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		for seq, kind := range []string{command.KindDiskWipe, command.KindImageDeploy, command.KindNodeKexec} {
			body := map[string]*agentv1.CommandBody{
				command.KindDiskWipe:    wipe(agentv1.WipeMethod_WIPE_METHOD_ZERO, "/dev/sda"),
				command.KindImageDeploy: {Kind: &agentv1.CommandBody_ImageDeploy{ImageDeploy: &agentv1.ImageDeploy{}}},
				command.KindNodeKexec:   {Kind: &agentv1.CommandBody_NodeKexec{NodeKexec: &agentv1.NodeKexec{}}},
			}[kind]
			f.e.Handle(f.signed(int64(seq+1), kind, body))
			u := f.next(t)
			expect(t, u, int64(seq+1), rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
			if !strings.Contains(u.GetReason(), "runs only in bcd ramdisk") {
				t.Errorf("%s: reason %q", kind, u.GetReason())
			}
		}
	})

	t.Run("a disk outside the inventory fails, named, signed", func(t *testing.T) {
		t.Parallel()
		rf := setupRamdisk(t)
		c := rf.signed(1, command.KindDiskWipe, wipe(agentv1.WipeMethod_WIPE_METHOD_ZERO, rf.disks[0], "/etc/passwd"))
		rf.e.Handle(c)
		u := rf.finish(t, 1)
		expect(t, u, 1, failed, noReject)
		if !strings.Contains(u.GetReason(), "payload.disks: /etc/passwd is not a disk of this machine's inventory") {
			t.Errorf("reason %q", u.GetReason())
		}
		if err := resultsig.Verify(u, subjectOf(c), rf.pub()); err != nil {
			t.Errorf("the failure is not signed: %v", err)
		}
	})

	t.Run("image.deploy with a bad hash fails with the signed hash of what was written", func(t *testing.T) {
		t.Parallel()
		rf := setupRamdisk(t)
		img := []byte(strings.Repeat("bootable ", 1000))
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(img) }))
		t.Cleanup(srv.Close)
		sum := sha256.Sum256(img)
		good := hex.EncodeToString(sum[:])
		body := func(h string) *agentv1.CommandBody {
			return &agentv1.CommandBody{Kind: &agentv1.CommandBody_ImageDeploy{ImageDeploy: &agentv1.ImageDeploy{Url: srv.URL, Sha256: h, Disk: rf.disks[1]}}}
		}
		bad := rf.signed(1, command.KindImageDeploy, body(strings.Repeat("0", 64)))
		rf.e.Handle(bad)
		u := rf.finish(t, 1)
		expect(t, u, 1, failed, noReject)
		if !strings.Contains(u.GetReason(), "sha256 mismatch") || u.GetResult().GetImageDeploy().GetSha256() != good {
			t.Fatalf("update %v", u)
		}
		if err := resultsig.Verify(u, subjectOf(bad), rf.pub()); err != nil {
			t.Fatal(err)
		}
		ok := rf.signed(2, command.KindImageDeploy, body(good))
		ok.Id = "cmd_deploy_2"
		commandsig.Sign(ok, trustDomain, rf.priv)
		rf.e.Handle(ok)
		u = rf.finish(t, 2)
		expect(t, u, 2, succeeded, noReject)
		if r := u.GetResult().GetImageDeploy(); r.GetSha256() != good || r.GetBytes() != uint64(len(img)) {
			t.Fatalf("result %v", r)
		}
		if err := resultsig.Verify(u, subjectOf(ok), rf.pub()); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("node.kexec loads, execs and succeeds on the next boot", func(t *testing.T) {
		t.Parallel()
		rf := setupRamdisk(t)
		kernel := []byte("vmlinuz")
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(kernel) }))
		t.Cleanup(srv.Close)
		sum := sha256.Sum256(kernel)
		c := rf.signed(1, command.KindNodeKexec, &agentv1.CommandBody{Kind: &agentv1.CommandBody_NodeKexec{NodeKexec: &agentv1.NodeKexec{
			KernelUrl: srv.URL + "/vmlinuz", KernelSha256: hex.EncodeToString(sum[:]), Cmdline: "root=/dev/sda1"}}})
		rf.e.Handle(c)
		expect(t, rf.next(t), 1, accepted, noReject)
		select {
		case <-rf.kexecs.execd:
		case <-time.After(wait):
			t.Fatal("no kexec")
		}
		rf.e.Close()
		k := rf.kexecs
		k.mu.Lock()
		if k.loads != 1 || k.execs != 1 || k.kernel != "vmlinuz" || k.cmdln != "root=/dev/sda1" {
			t.Fatalf("kexec hook: %d loads %d execs %q %q", k.loads, k.execs, k.kernel, k.cmdln)
		}
		k.mu.Unlock()
		rf.none(t)
		cfg := rf.cfg
		cfg.BootID = "boot-2"
		e2 := rf.open(t, cfg)
		e2.Handle(c)
		expect(t, rf.next(t), 1, succeeded, noReject)
	})

	t.Run("node.kexec with a bad kernel hash fails and execs nothing", func(t *testing.T) {
		t.Parallel()
		rf := setupRamdisk(t)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("evil")) }))
		t.Cleanup(srv.Close)
		c := rf.signed(1, command.KindNodeKexec, &agentv1.CommandBody{Kind: &agentv1.CommandBody_NodeKexec{NodeKexec: &agentv1.NodeKexec{
			KernelUrl: srv.URL + "/vmlinuz", KernelSha256: strings.Repeat("1", 64)}}})
		rf.e.Handle(c)
		u := rf.finish(t, 1)
		expect(t, u, 1, failed, noReject)
		if !strings.Contains(u.GetReason(), "kexec: payload.kernelSha256: sha256 mismatch") {
			t.Errorf("reason %q", u.GetReason())
		}
		if rf.kexecs.loads != 0 || rf.kexecs.execs != 0 {
			t.Fatal("a bad kernel was loaded")
		}
	})

	t.Run("diag.nvml in the ramdisk adds the disks' burn-in", func(t *testing.T) {
		t.Parallel()
		rf := setupRamdisk(t)
		c := cmd(1, command.KindDiagNvml, diag())
		rf.e.Handle(c)
		u := rf.finish(t, 1)
		expect(t, u, 1, succeeded, noReject)
		res := u.GetResult().GetDiagNvml()
		if len(res.GetGpus()) != 8 || len(res.GetDisks()) != 2 || !res.GetDisks()[0].GetHealthy() || res.GetDisks()[1].GetSizeBytes() != 1<<20+100 {
			t.Fatalf("result %v", res)
		}
		if err := resultsig.Verify(u, subjectOf(c), rf.pub()); err != nil {
			t.Fatal(err)
		}
	})
}
