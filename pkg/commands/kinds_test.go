package commands_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

const hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

// TestCommissioningKinds checks the flags of the metal workflow's kinds:
// destructive (signed), exclusive, never through commands.run.
func TestCommissioningKinds(t *testing.T) {
	t.Parallel()
	r := commands.Builtin()
	for name, want := range map[string]struct {
		selfTerminating bool
		timeout         time.Duration
	}{
		"disk.wipe":    {false, 6 * time.Hour},
		"image.deploy": {false, 2 * time.Hour},
		"node.kexec":   {true, 10 * time.Minute},
	} {
		k, ok := r.Lookup(name)
		if !ok {
			t.Fatalf("%s not registered", name)
		}
		if !k.Destructive || k.API || k.RetrySafe || k.Lane != commands.LaneExclusive || k.SelfTerminating != want.selfTerminating || k.Timeout != want.timeout {
			t.Errorf("%s: %+v", name, k)
		}
	}
}

func TestCommissioningPayloads(t *testing.T) {
	t.Parallel()
	r := commands.Builtin()
	long := "/dev/" + strings.Repeat("a", 252)
	many := make([]string, 65)
	for i := range many {
		many[i] = "/dev/sd" + string(rune('a'+i%26)) + strings.Repeat("x", i/26)
	}
	for _, tc := range []struct {
		name, kind string
		payload    any
		field      string // "" means accepted
	}{
		{"a wipe", "disk.wipe", `{"disks": ["/dev/nvme0n1", "/dev/nvme1n1"], "method": "WIPE_METHOD_ZERO", "reason": "commissioning"}`, ""},
		{"wipe without disks", "disk.wipe", `{"method": "WIPE_METHOD_ZERO"}`, "payload.disks"},
		{"wipe of 65 disks", "disk.wipe", &agentv1.DiskWipe{Disks: many, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO}, "payload.disks"},
		{"wipe of a relative path", "disk.wipe", `{"disks": ["dev/sda"], "method": "WIPE_METHOD_ZERO"}`, "payload.disks"},
		{"wipe of an unclean path", "disk.wipe", `{"disks": ["/dev/../etc/passwd"], "method": "WIPE_METHOD_ZERO"}`, "payload.disks"},
		{"wipe of a 257-character path", "disk.wipe", &agentv1.DiskWipe{Disks: []string{long}, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO}, "payload.disks"},
		{"wipe of a disk twice", "disk.wipe", `{"disks": ["/dev/sda", "/dev/sda"], "method": "WIPE_METHOD_ZERO"}`, "payload.disks"},
		{"wipe without a method", "disk.wipe", `{"disks": ["/dev/sda"]}`, "payload.method"},
		{"wipe with an unknown method", "disk.wipe", &agentv1.DiskWipe{Disks: []string{"/dev/sda"}, Method: 9}, "payload.method"},
		{"wipe reason too long", "disk.wipe", &agentv1.DiskWipe{Disks: []string{"/dev/sda"}, Method: agentv1.WipeMethod_WIPE_METHOD_DISCARD, Reason: strings.Repeat("x", 1025)}, "payload.reason"},
		{"a deploy", "image.deploy", `{"url": "https://images.example/ubuntu.raw", "sha256": "` + hash + `", "disk": "/dev/nvme0n1", "sizeBytes": "1048576", "format": "IMAGE_FORMAT_RAW"}`, ""},
		{"deploy without url", "image.deploy", `{"sha256": "` + hash + `", "disk": "/dev/sda"}`, "payload.url"},
		{"deploy from ftp", "image.deploy", `{"url": "ftp://x/y", "sha256": "` + hash + `", "disk": "/dev/sda"}`, "payload.url"},
		{"deploy from a long url", "image.deploy", &agentv1.ImageDeploy{Url: "https://x/" + strings.Repeat("a", 2048), Sha256: hash, Disk: "/dev/sda"}, "payload.url"},
		{"deploy without sha256", "image.deploy", `{"url": "https://x/y", "disk": "/dev/sda"}`, "payload.sha256"},
		{"deploy with upper-case sha256", "image.deploy", `{"url": "https://x/y", "sha256": "` + strings.ToUpper(hash) + `", "disk": "/dev/sda"}`, "payload.sha256"},
		{"deploy without disk", "image.deploy", `{"url": "https://x/y", "sha256": "` + hash + `"}`, "payload.disk"},
		{"deploy of 2 PiB", "image.deploy", &agentv1.ImageDeploy{Url: "https://x/y", Sha256: hash, Disk: "/dev/sda", SizeBytes: 2 << 50}, "payload.sizeBytes"},
		{"deploy of a qcow2", "image.deploy", &agentv1.ImageDeploy{Url: "https://x/y", Sha256: hash, Disk: "/dev/sda", Format: 7}, "payload.format"},
		{"a kexec", "node.kexec", `{"kernelUrl": "http://boot/vmlinuz", "kernelSha256": "` + hash + `", "initrdUrl": "http://boot/initrd", "initrdSha256": "` + hash + `", "cmdline": "console=ttyS0"}`, ""},
		{"kexec without kernel", "node.kexec", `{"kernelSha256": "` + hash + `"}`, "payload.kernelUrl"},
		{"kexec without kernel hash", "node.kexec", `{"kernelUrl": "http://boot/vmlinuz"}`, "payload.kernelSha256"},
		{"kexec initrd without hash", "node.kexec", `{"kernelUrl": "http://boot/vmlinuz", "kernelSha256": "` + hash + `", "initrdUrl": "http://boot/initrd"}`, "payload.initrdSha256"},
		{"kexec initrd hash without url", "node.kexec", `{"kernelUrl": "http://boot/vmlinuz", "kernelSha256": "` + hash + `", "initrdSha256": "` + hash + `"}`, "payload.initrdSha256"},
		{"kexec cmdline too long", "node.kexec", &agentv1.NodeKexec{KernelUrl: "http://boot/vmlinuz", KernelSha256: hash, Cmdline: strings.Repeat("x", 4097)}, "payload.cmdline"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, _ := r.Lookup(tc.kind)
			b, err := k.Encode(tc.payload)
			if tc.field == "" {
				body := &agentv1.CommandBody{}
				if err != nil || proto.Unmarshal(b, body) != nil || body.ProtoReflect().WhichOneof(body.ProtoReflect().Descriptor().Oneofs().Get(0)) == nil {
					t.Fatalf("refused a good payload: %v", err)
				}
				return
			}
			fe, ok := fault.As(err)
			if !ok || fe.Code != fault.InvalidInput || fe.Field != tc.field {
				t.Fatalf("got %v, want INVALID_INPUT on %q", err, tc.field)
			}
		})
	}
}

// TestBuiltin_MatchesDeclared: the registry's kinds are exactly the kinds
// the wire contract declares (proto/commandkinds), each with the declared
// payload field, lane and flags, and the lanes' credits are the declared
// ones — what bcd reads from the same declarations.
func TestBuiltin_MatchesDeclared(t *testing.T) {
	t.Parallel()
	r := commands.Builtin()
	declared := commandkinds.All()
	if got := len(r.Kinds()); got != len(declared) {
		t.Errorf("Builtin has %d kinds, the contract declares %d", got, len(declared))
	}
	for _, d := range declared {
		k, ok := r.Lookup(d.Name)
		if !ok {
			t.Errorf("%s is declared but not registered", d.Name)
			continue
		}
		if got := k.Declared(); got != d {
			t.Errorf("%s: registered %+v, declared %+v", d.Name, got, d)
		}
	}
	credits := commandkinds.Credits()
	if len(credits) != len(commands.Credits) {
		t.Errorf("Credits = %v, declared %v", commands.Credits, credits)
	}
	for _, l := range []commands.Lane{commands.LaneDiag, commands.LaneDefault, commands.LaneExclusive} {
		if n, ok := credits[string(l)]; !ok || commands.Credits[l] != n {
			t.Errorf("lane %s: %d credits, declared %d (%v)", l, commands.Credits[l], n, ok)
		}
	}
}
