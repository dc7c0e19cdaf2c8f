package command

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

// fuzzTrustDomain and fuzzSigningKey sign the corpus's destructive seeds.
const fuzzTrustDomain = "example.org"

var fuzzSigningKey = ed25519.NewKeyFromSeed(bytes.Repeat([]byte{3}, ed25519.SeedSize))

// fuzzCommands are valid commands of each kind, node.reboot signed.
func fuzzCommands(tb testing.TB) []*agentv1.Command {
	bodies := map[string]*agentv1.CommandBody{
		KindDiagNvml:         {Kind: &agentv1.CommandBody_DiagNvml{DiagNvml: &agentv1.DiagNvml{GpuUuids: []string{"GPU-a"}, Level: "quick"}}},
		KindInventoryRefresh: {Kind: &agentv1.CommandBody_InventoryRefresh{InventoryRefresh: &agentv1.InventoryRefresh{Sections: []string{"gpus"}, Rescan: true}}},
		KindLogsCollect:      {Kind: &agentv1.CommandBody_LogsCollect{LogsCollect: &agentv1.LogsCollect{Sources: []string{"agent"}, MaxBytes: 1 << 20, Since: durationpb.New(time.Hour)}}},
		KindNodeReboot:       {Kind: &agentv1.CommandBody_NodeReboot{NodeReboot: &agentv1.NodeReboot{Reason: "maintenance"}}},
	}
	var out []*agentv1.Command
	for _, k := range []string{KindDiagNvml, KindInventoryRefresh, KindLogsCollect, KindNodeReboot} {
		b, err := proto.Marshal(bodies[k])
		if err != nil {
			tb.Fatal(err)
		}
		c := &agentv1.Command{Id: "cmd_" + k, NodeId: "n1", Kind: k, Seq: int64(len(out) + 1), Body: b, MinGeneration: 2,
			NotAfter: timestamppb.New(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)), Timeout: durationpb.New(10 * time.Minute)}
		if Destructive(k) {
			commandsig.Sign(c, fuzzTrustDomain, fuzzSigningKey)
		}
		out = append(out, c)
	}
	return out
}

// FuzzCommand decodes a Command frame from the gateway and judges it as
// Handle does before running anything: no panic; the signature check
// refuses everything but the signed seeds (a command that verifies signs
// the same input as a seed); decode accepts exactly a known kind whose body
// is a CommandBody holding that kind's payload, and the decoded body
// re-encodes to an equal message.
func FuzzCommand(f *testing.F) {
	seeds := fuzzCommands(f)
	pub := fuzzSigningKey.Public().(ed25519.PublicKey)
	signed := map[string]bool{}
	for _, c := range seeds {
		if len(c.GetSignature()) > 0 {
			signed[string(commandsig.Input(c, fuzzTrustDomain))] = true
		}
		b, err := proto.Marshal(c)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		unsigned := proto.Clone(c).(*agentv1.Command)
		unsigned.Signature, unsigned.Kind = nil, KindNodeReboot
		if b, err = proto.Marshal(unsigned); err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0x2a, 0x02, 0x0a, 0xff}) // a body whose payload runs past the end
	e := &Executor{cfg: Config{NodeID: "n1", TrustDomain: fuzzTrustDomain, CommandKey: pub, RebootHook: func(context.Context, string) error { return nil }}}
	f.Fuzz(func(t *testing.T, b []byte) {
		var c agentv1.Command
		if err := proto.Unmarshal(b, &c); err != nil {
			return
		}
		for _, td := range []string{fuzzTrustDomain, "", "other.example"} {
			for _, key := range []ed25519.PublicKey{pub, nil, pub[:16]} {
				err := commandsig.Verify(&c, td, key)
				if err == nil && (td != fuzzTrustDomain || !bytes.Equal(key, pub) || !signed[string(commandsig.Input(&c, td))]) {
					t.Fatalf("a command no one signed verifies (trust domain %q, key %x)", td, key)
				}
			}
		}
		body, reason := e.decode(&c)
		k, known := kinds[c.GetKind()]
		if reason != "" {
			if body != nil {
				t.Fatalf("decode refused (%s) but returned a body", reason)
			}
			var probe agentv1.CommandBody
			if known && proto.Unmarshal(c.GetBody(), &probe) == nil && holds(k, &probe) {
				t.Fatalf("decode refused a %s command with a %s payload: %s", c.GetKind(), c.GetKind(), reason)
			}
			if !known && !strings.Contains(reason, "unknown command kind") {
				t.Fatalf("kind %q: reason %q", c.GetKind(), reason)
			}
			return
		}
		if !known || body == nil || !holds(k, body) {
			t.Fatalf("decode accepted kind %q without its payload", c.GetKind())
		}
		again, err := proto.Marshal(body)
		if err != nil {
			t.Fatalf("a decoded body does not encode: %v", err)
		}
		var body2 agentv1.CommandBody
		if err := proto.Unmarshal(again, &body2); err != nil || !proto.Equal(body, &body2) {
			t.Fatalf("the body does not round-trip: %v", err)
		}
	})
}

// holds reports whether body holds kind k's payload.
func holds(k commandkinds.Kind, body *agentv1.CommandBody) bool {
	of, ok := commandkinds.Of(body)
	return ok && of.Name == k.Name
}
