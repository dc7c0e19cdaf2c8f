package commandsig_test

import (
	"crypto/ed25519"
	"errors"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

const td = "prod.example"

func TestSignVerify(t *testing.T) {
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	other, _, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	base := &agentv1.Command{Id: "cmd_1", NodeId: "node_a", Seq: 7, Kind: "node.reboot", Body: []byte{1, 2, 3},
		NotAfter: timestamppb.New(time.Unix(1700000000, 5)), MinGeneration: 3, Timeout: durationpb.New(15 * time.Minute)}
	signed := proto.Clone(base).(*agentv1.Command)
	commandsig.Sign(signed, td, priv)
	if signed.GetKeyId() != commandsig.KeyID(pub) {
		t.Fatalf("key id %q, want %q", signed.GetKeyId(), commandsig.KeyID(pub))
	}
	if err := commandsig.Verify(signed, td, pub); err != nil {
		t.Fatalf("a signed command: %v", err)
	}
	if err := commandsig.Verify(base, td, pub); !errors.Is(err, commandsig.ErrBadSignature) {
		t.Fatalf("unsigned: %v", err)
	}
	if err := commandsig.Verify(signed, td, other); !errors.Is(err, commandsig.ErrBadSignature) {
		t.Fatalf("another key: %v", err)
	}
	if err := commandsig.Verify(signed, td, nil); !errors.Is(err, commandsig.ErrBadSignature) {
		t.Fatalf("no pinned key: %v", err)
	}
	if err := commandsig.Verify(signed, "", pub); !errors.Is(err, commandsig.ErrBadSignature) {
		t.Fatalf("no trust domain: %v", err)
	}
}

// TestReplayedSignatureWithChangedFieldIsBad replays a valid signature on a
// command with one field changed, or to another installation (trust
// domain) pinning the same key: each is refused.
func TestReplayedSignatureWithChangedFieldIsBad(t *testing.T) {
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	signed := &agentv1.Command{Id: "cmd_1", NodeId: "node_a", Seq: 7, Kind: "node.reboot", Body: []byte{1, 2, 3},
		NotAfter: timestamppb.New(time.Unix(1700000000, 5)), MinGeneration: 3, Timeout: durationpb.New(15 * time.Minute)}
	commandsig.Sign(signed, td, priv)
	for name, mut := range map[string]func(c *agentv1.Command){
		"id":            func(c *agentv1.Command) { c.Id = "cmd_2" },
		"node":          func(c *agentv1.Command) { c.NodeId = "node_b" },
		"seq":           func(c *agentv1.Command) { c.Seq = 8 },
		"kind":          func(c *agentv1.Command) { c.Kind = "gpu.reset" },
		"body":          func(c *agentv1.Command) { c.Body = []byte{1, 2, 4} },
		"notAfter":      func(c *agentv1.Command) { c.NotAfter = timestamppb.New(time.Unix(1700000001, 5)) },
		"minGeneration": func(c *agentv1.Command) { c.MinGeneration = 4 },
		"timeout":       func(c *agentv1.Command) { c.Timeout = durationpb.New(15*time.Minute + time.Nanosecond) },
		"no timeout":    func(c *agentv1.Command) { c.Timeout = nil },
		"keyId":         func(c *agentv1.Command) { c.KeyId = "0000000000000000" },
	} {
		c := proto.Clone(signed).(*agentv1.Command)
		mut(c)
		if err := commandsig.Verify(c, td, pub); !errors.Is(err, commandsig.ErrBadSignature) {
			t.Errorf("changed %s: still verifies", name)
		}
	}
	if err := commandsig.Verify(signed, "other.example", pub); !errors.Is(err, commandsig.ErrBadSignature) {
		t.Errorf("another trust domain: still verifies")
	}
}
