package command

import (
	"crypto/ed25519"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// The kinds the daemon knows.
const (
	KindDiagNvml         = "diag.nvml"
	KindInventoryRefresh = "inventory.refresh"
	KindLogsCollect      = "logs.collect"
	KindNodeReboot       = "node.reboot"
	KindGPUReset         = "gpu.reset"
	// The commissioning kinds, run by bcd ramdisk (Config.Ramdisk).
	KindDiskWipe    = "disk.wipe"
	KindImageDeploy = "image.deploy"
	KindNodeKexec   = "node.kexec"
	// KindInstanceReboot restarts a VPS instance (Config.Instances).
	KindInstanceReboot = "instance.reboot"
)

// Lanes and their credits: how many commands of the lane may run at once.
const (
	LaneDiag      = "diag"
	LaneDefault   = "default"
	LaneExclusive = "exclusive"
)

// Credits is each lane's number of concurrent commands.
var Credits = map[string]int{LaneDiag: 1, LaneDefault: 4, LaneExclusive: 1}

// kind is what the daemon knows of one command kind.
type kind struct {
	lane string
	// selfTerminating: the daemon never answers SUCCEEDED; the control
	// plane does when the node comes back with a new boot id.
	selfTerminating bool
	// ramdisk: only a daemon with a Config.Ramdisk (bcd ramdisk) runs it.
	ramdisk bool
	// has reports whether the body holds the kind's payload message.
	has func(*agentv1.CommandBody) bool
}

var kinds = map[string]kind{
	KindDiagNvml:         {lane: LaneDiag, has: func(b *agentv1.CommandBody) bool { return b.GetDiagNvml() != nil }},
	KindInventoryRefresh: {lane: LaneDefault, has: func(b *agentv1.CommandBody) bool { return b.GetInventoryRefresh() != nil }},
	KindLogsCollect:      {lane: LaneDefault, has: func(b *agentv1.CommandBody) bool { return b.GetLogsCollect() != nil }},
	KindNodeReboot:       {lane: LaneExclusive, selfTerminating: true, has: func(b *agentv1.CommandBody) bool { return b.GetNodeReboot() != nil }},
	KindGPUReset:         {lane: LaneExclusive, has: func(b *agentv1.CommandBody) bool { return b.GetGpuReset() != nil }},
	KindDiskWipe:         {lane: LaneExclusive, ramdisk: true, has: func(b *agentv1.CommandBody) bool { return b.GetDiskWipe() != nil }},
	KindImageDeploy:      {lane: LaneExclusive, ramdisk: true, has: func(b *agentv1.CommandBody) bool { return b.GetImageDeploy() != nil }},
	KindNodeKexec:        {lane: LaneExclusive, ramdisk: true, selfTerminating: true, has: func(b *agentv1.CommandBody) bool { return b.GetNodeKexec() != nil }},
	KindInstanceReboot:   {lane: LaneDefault, has: func(b *agentv1.CommandBody) bool { return b.GetInstanceReboot() != nil }},
}

// destructive are the kinds that must carry a valid signature from the
// pinned command-signing key, including those this daemon does not run yet.
var destructive = map[string]bool{
	KindNodeReboot: true, KindGPUReset: true, KindDiskWipe: true, KindImageDeploy: true, KindNodeKexec: true,
}

// Destructive reports whether kind must be signed.
func Destructive(kind string) bool { return destructive[kind] }

// ParsePublicKey reads the control plane's command-signing public key: a
// PEM "PUBLIC KEY" block holding a PKIX Ed25519 key.
func ParsePublicKey(pemBytes []byte) (ed25519.PublicKey, error) {
	blk, _ := pem.Decode(pemBytes)
	if blk == nil || blk.Type != "PUBLIC KEY" {
		return nil, errors.New("command key: want a PEM PUBLIC KEY block")
	}
	k, err := x509.ParsePKIXPublicKey(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("command key: %w", err)
	}
	pub, ok := k.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("command key: a %T, want Ed25519", k)
	}
	return pub, nil
}
