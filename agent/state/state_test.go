package state_test

import (
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/state"
)

func setup(t *testing.T) (*state.Store, string) {
	t.Helper()
	root := filepath.Join(t.TempDir(), "bcd")
	s, err := state.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	return s, root
}

func TestKey_CreatedOnceWithMode0600(t *testing.T) {
	t.Parallel()
	s, root := setup(t)
	k1, err := s.Key()
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(root, "node.key"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("key mode %v", fi.Mode().Perm())
	}
	s2, err := state.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	k2, err := s2.Key()
	if err != nil {
		t.Fatal(err)
	}
	if !k1.Equal(k2) {
		t.Error("the key changed on reopen")
	}
	if k1.Curve.Params().Name != "P-256" {
		t.Errorf("curve %s", k1.Curve.Params().Name)
	}
}

func TestCSR_ForNodeKey(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	der, err := s.CSR()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		t.Fatal(err)
	}
	if err := csr.CheckSignature(); err != nil {
		t.Fatal(err)
	}
	k, _ := s.Key()
	if !k.PublicKey.Equal(csr.PublicKey) {
		t.Error("the CSR is not for the node key")
	}
}

func TestIdentity_RoundTrip(t *testing.T) {
	t.Parallel()
	s, root := setup(t)
	if _, err := s.Identity(); !errors.Is(err, state.ErrNotJoined) {
		t.Fatalf("err %v, want ErrNotJoined", err)
	}
	in := state.Identity{NodeID: "node_1", Chain: [][]byte{[]byte("leaf"), []byte("inter")}, Bundle: [][]byte{[]byte("ca")}}
	if err := s.SaveIdentity(in); err != nil {
		t.Fatal(err)
	}
	out, err := s.Identity()
	if err != nil {
		t.Fatal(err)
	}
	if out.NodeID != "node_1" || len(out.Chain) != 2 || string(out.Chain[0]) != "leaf" || string(out.Bundle[0]) != "ca" {
		t.Errorf("identity %+v", out)
	}
	entries, _ := os.ReadDir(root)
	for _, e := range entries {
		if strings.Contains(e.Name(), ".tmp") {
			t.Errorf("temporary file left: %s", e.Name())
		}
	}
	if err := s.SaveIdentity(state.Identity{NodeID: "x"}); err == nil {
		t.Error("saved an identity without certificates")
	}
}

func TestJournalID_KeptUntilJournalLost(t *testing.T) {
	t.Parallel()
	s, root := setup(t)
	j1, err := s.JournalID()
	if err != nil {
		t.Fatal(err)
	}
	j2, err := s.JournalID()
	if err != nil {
		t.Fatal(err)
	}
	if j1 == "" || j1 != j2 {
		t.Fatalf("journal ids %q, %q", j1, j2)
	}
	if err := os.RemoveAll(filepath.Join(root, "journal")); err != nil {
		t.Fatal(err)
	}
	j3, err := s.JournalID()
	if err != nil {
		t.Fatal(err)
	}
	if j3 == j1 {
		t.Error("a lost journal kept its id")
	}
}

func TestBootID(t *testing.T) {
	t.Parallel()
	if id, err := state.BootID("sim-boot"); err != nil || id != "sim-boot" {
		t.Errorf("override: %q, %v", id, err)
	}
	id, err := state.BootID("")
	if _, statErr := os.Stat("/proc/sys/kernel/random/boot_id"); statErr != nil {
		t.Skip("no /proc boot id here")
	}
	if err != nil || len(id) != 36 {
		t.Errorf("boot id %q, %v", id, err)
	}
}
