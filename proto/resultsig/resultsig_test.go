package resultsig_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/resultsig"
)

var subject = resultsig.Subject{TrustDomain: "prod.example", NodeID: "node_a", CommandID: "cmd_1", Kind: "disk.wipe", Seq: 7}

func wipeReport() *agentv1.CommandUpdate {
	return &agentv1.CommandUpdate{Id: "cmd_1", Seq: 7, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED,
		Result: &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiskWipe{DiskWipe: &agentv1.DiskWipeResult{Disks: []*agentv1.DiskWiped{
			{Path: "/dev/nvme0n1", Method: agentv1.WipeMethod_WIPE_METHOD_ZERO, Bytes: 1 << 30, Verified: true},
			{Path: "/dev/nvme1n1", Method: agentv1.WipeMethod_WIPE_METHOD_ZERO, Bytes: 1 << 30, Verified: true},
		}}}}}
}

func keys(t *testing.T) (ed25519.PublicKey, ed25519.PrivateKey) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	return pub, priv
}

func TestSignVerifyRoundTrip(t *testing.T) {
	t.Parallel()
	pub, priv := keys(t)
	u := wipeReport()
	if err := resultsig.Sign(u, subject, priv); err != nil {
		t.Fatal(err)
	}
	sig := u.GetNodeSignature()
	if sig.GetKeyId() != resultsig.KeyID(pub) || len(sig.GetKeyId()) != resultsig.KeyIDLen || sig.GetAlgorithm() != "ed25519" || len(sig.GetSignature()) != ed25519.SignatureSize {
		t.Fatalf("signature envelope %v", sig)
	}
	if err := resultsig.Verify(u, subject, pub); err != nil {
		t.Fatalf("a signed report: %v", err)
	}
	// Over the wire and back (what the gateway relays): still verifies.
	b, err := proto.Marshal(u)
	if err != nil {
		t.Fatal(err)
	}
	got := &agentv1.CommandUpdate{}
	if err := proto.Unmarshal(b, got); err != nil {
		t.Fatal(err)
	}
	if err := resultsig.Verify(got, subject, pub); err != nil {
		t.Fatalf("after a round trip on the wire: %v", err)
	}
	// A failure without a result signs and verifies too.
	f := &agentv1.CommandUpdate{Id: "cmd_1", Seq: 7, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, Reason: "disk /dev/sda: read back a non-zero byte"}
	if err := resultsig.Sign(f, subject, priv); err != nil {
		t.Fatal(err)
	}
	if err := resultsig.Verify(f, subject, pub); err != nil {
		t.Fatalf("a signed failure: %v", err)
	}
}

// TestChangedReportIsBad changes one signed field of the report at a time:
// each breaks the signature.
func TestChangedReportIsBad(t *testing.T) {
	t.Parallel()
	pub, priv := keys(t)
	signed := wipeReport()
	if err := resultsig.Sign(signed, subject, priv); err != nil {
		t.Fatal(err)
	}
	for name, mut := range map[string]func(u *agentv1.CommandUpdate){
		"outcome":  func(u *agentv1.CommandUpdate) { u.Outcome = agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED },
		"reason":   func(u *agentv1.CommandUpdate) { u.Reason = "x" },
		"bytes":    func(u *agentv1.CommandUpdate) { u.GetResult().GetDiskWipe().GetDisks()[0].Bytes-- },
		"verified": func(u *agentv1.CommandUpdate) { u.GetResult().GetDiskWipe().GetDisks()[1].Verified = false },
		"method": func(u *agentv1.CommandUpdate) {
			u.GetResult().GetDiskWipe().GetDisks()[0].Method = agentv1.WipeMethod_WIPE_METHOD_DISCARD
		},
		"path": func(u *agentv1.CommandUpdate) { u.GetResult().GetDiskWipe().GetDisks()[0].Path = "/dev/sdz" },
		"disk gone": func(u *agentv1.CommandUpdate) {
			u.GetResult().GetDiskWipe().Disks = u.GetResult().GetDiskWipe().GetDisks()[:1]
		},
		"no result": func(u *agentv1.CommandUpdate) { u.Result = nil },
		"signature": func(u *agentv1.CommandUpdate) { u.GetNodeSignature().Signature[5] ^= 1 },
		"keyId":     func(u *agentv1.CommandUpdate) { u.GetNodeSignature().KeyId = "0000000000000000" },
		"algorithm": func(u *agentv1.CommandUpdate) { u.GetNodeSignature().Algorithm = "ed448" },
		"unsigned":  func(u *agentv1.CommandUpdate) { u.NodeSignature = nil },
		"truncated": func(u *agentv1.CommandUpdate) {
			u.GetNodeSignature().Signature = u.GetNodeSignature().GetSignature()[:63]
		},
	} {
		u := proto.Clone(signed).(*agentv1.CommandUpdate)
		mut(u)
		if err := resultsig.Verify(u, subject, pub); !errors.Is(err, resultsig.ErrBadSignature) {
			t.Errorf("changed %s: %v, want ErrBadSignature", name, err)
		}
	}
}

// TestReplayedToAnotherSubjectIsBad replays a valid report to another
// command, node, kind, seq or installation: each is refused, naming why.
func TestReplayedToAnotherSubjectIsBad(t *testing.T) {
	t.Parallel()
	pub, priv := keys(t)
	signed := wipeReport()
	if err := resultsig.Sign(signed, subject, priv); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		mut  func(s *resultsig.Subject, u *agentv1.CommandUpdate)
		want string
	}{
		"other command":         {func(s *resultsig.Subject, _ *agentv1.CommandUpdate) { s.CommandID = "cmd_2" }, "not \"cmd_2\""},
		"other command, id too": {func(s *resultsig.Subject, u *agentv1.CommandUpdate) { s.CommandID, u.Id = "cmd_2", "cmd_2" }, "does not verify"},
		"other seq, seq too":    {func(s *resultsig.Subject, u *agentv1.CommandUpdate) { s.Seq, u.Seq = 8, 8 }, "does not verify"},
		"other node":            {func(s *resultsig.Subject, _ *agentv1.CommandUpdate) { s.NodeID = "node_b" }, "does not verify"},
		"other kind":            {func(s *resultsig.Subject, _ *agentv1.CommandUpdate) { s.Kind = "image.deploy" }, "does not verify"},
		"other installation":    {func(s *resultsig.Subject, _ *agentv1.CommandUpdate) { s.TrustDomain = "staging.example" }, "does not verify"},
		"no trust domain":       {func(s *resultsig.Subject, _ *agentv1.CommandUpdate) { s.TrustDomain = "" }, "no trust domain"},
	} {
		s := subject
		u := proto.Clone(signed).(*agentv1.CommandUpdate)
		tc.mut(&s, u)
		err := resultsig.Verify(u, s, pub)
		if !errors.Is(err, resultsig.ErrBadSignature) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrBadSignature saying %q", name, err, tc.want)
		}
	}
}

func TestWrongKeyIsBad(t *testing.T) {
	t.Parallel()
	_, priv := keys(t)
	other, otherPriv := keys(t)
	u := wipeReport()
	if err := resultsig.Sign(u, subject, priv); err != nil {
		t.Fatal(err)
	}
	if err := resultsig.Verify(u, subject, other); !errors.Is(err, resultsig.ErrBadSignature) || !strings.Contains(err.Error(), "signed by key") {
		t.Fatalf("verified with another key: %v", err)
	}
	if err := resultsig.Verify(u, subject, nil); !errors.Is(err, resultsig.ErrBadSignature) {
		t.Fatalf("verified with no key: %v", err)
	}
	// A gateway with a key of its own re-signs the report, naming its own
	// key: the certified key still refuses it.
	forged := proto.Clone(u).(*agentv1.CommandUpdate)
	if err := resultsig.Sign(forged, subject, otherPriv); err != nil {
		t.Fatal(err)
	}
	if err := resultsig.Verify(forged, subject, priv.Public().(ed25519.PublicKey)); !errors.Is(err, resultsig.ErrBadSignature) {
		t.Fatalf("re-signed by another key: %v", err)
	}
	// It keeps the real key id but signs with its own key.
	forged.GetNodeSignature().KeyId = resultsig.KeyID(priv.Public().(ed25519.PublicKey))
	if err := resultsig.Verify(forged, subject, priv.Public().(ed25519.PublicKey)); !errors.Is(err, resultsig.ErrBadSignature) {
		t.Fatalf("signed by another key under the real key id: %v", err)
	}
}

func TestSignRefusesBadInput(t *testing.T) {
	t.Parallel()
	_, priv := keys(t)
	if err := resultsig.Sign(wipeReport(), resultsig.Subject{NodeID: "node_a", CommandID: "cmd_1", Kind: "disk.wipe", Seq: 7}, priv); err == nil {
		t.Error("signed without a trust domain")
	}
	s := subject
	s.CommandID = "cmd_9"
	if err := resultsig.Sign(wipeReport(), s, priv); err == nil {
		t.Error("signed a report for another command")
	}
	if err := resultsig.Sign(wipeReport(), subject, nil); err == nil {
		t.Error("signed with no key")
	}
}

func TestPublicKeyFromCertificate(t *testing.T) {
	t.Parallel()
	pub, priv := keys(t)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ramdisk"},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(2 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, priv)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	got, err := resultsig.PublicKey(cert)
	if err != nil || !got.Equal(pub) {
		t.Fatalf("PublicKey = %x, %v; want %x", got, err, pub)
	}
	u := wipeReport()
	if err := resultsig.Sign(u, subject, priv); err != nil {
		t.Fatal(err)
	}
	if err := resultsig.Verify(u, subject, got); err != nil {
		t.Fatalf("verify with the certified key: %v", err)
	}
	if _, err := resultsig.PublicKey(nil); err == nil {
		t.Error("a nil certificate gave a key")
	}
}
