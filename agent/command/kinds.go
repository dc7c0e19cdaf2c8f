package command

import (
	"crypto/ed25519"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// The kinds the daemon runs (declared in proto/commandkinds).
const (
	KindDiagNvml         = commandkinds.DiagNVML
	KindInventoryRefresh = commandkinds.InventoryRefresh
	KindLogsCollect      = commandkinds.LogsCollect
	KindNodeReboot       = commandkinds.NodeReboot
	KindGPUReset         = commandkinds.GPUReset
	// The commissioning kinds, run by bcd ramdisk (Config.Ramdisk).
	KindDiskWipe    = commandkinds.DiskWipe
	KindImageDeploy = commandkinds.ImageDeploy
	KindNodeKexec   = commandkinds.NodeKexec
	// KindInstanceReboot restarts a VPS instance (Config.Instances).
	KindInstanceReboot = commandkinds.InstanceReboot
	// KindAgentUpgrade upgrades bcd now (Config.Upgrade).
	KindAgentUpgrade = commandkinds.AgentUpgrade
)

// Credits is each lane's number of concurrent commands, as declared on the
// Lane enum (proto/commandkinds).
var Credits = commandkinds.Credits()

// kinds are the kinds the daemon runs, with what their payload messages
// declare of them (proto/commandkinds): the lane, whether the kind is
// self-terminating (the daemon never answers SUCCEEDED; the control plane
// does when the node comes back with a new boot id) or ramdisk-only (only a
// daemon with a Config.Ramdisk, bcd ramdisk, runs it).
var kinds = declared(KindDiagNvml, KindInventoryRefresh, KindLogsCollect, KindNodeReboot, KindGPUReset,
	KindDiskWipe, KindImageDeploy, KindNodeKexec, KindInstanceReboot, KindAgentUpgrade)

// declared looks names up in the declared kinds; it panics on one the wire
// contract does not declare.
func declared(names ...string) map[string]commandkinds.Kind {
	m := map[string]commandkinds.Kind{}
	for _, n := range names {
		k, ok := commandkinds.Lookup(n)
		if !ok {
			panic("command: kind " + n + " is declared on no payload message of CommandBody")
		}
		m[n] = k
	}
	return m
}

// Kinds returns the kinds the daemon runs and what it knows of each, by
// name.
func Kinds() []commandkinds.Kind {
	return slices.SortedFunc(maps.Values(kinds), func(a, b commandkinds.Kind) int { return strings.Compare(a.Name, b.Name) })
}

// Destructive reports whether kind must carry a valid signature from the
// pinned command-signing key, including a declared kind this daemon does
// not run.
func Destructive(kind string) bool {
	k, _ := commandkinds.Lookup(kind)
	return k.Destructive
}

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
