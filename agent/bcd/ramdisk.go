package bcd

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/kernelargs"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/state"
)

// `bcd ramdisk` is the agent of a machine booted from the network into its
// commissioning ramdisk: it generates an Ed25519 key in memory (never
// written anywhere), joins with role ramdisk and the machine's one-time
// boot token (a join token of role ramdisk naming the machine's node), so
// joinservice issues a restricted certificate (role ramdisk, at most 2
// hours, never renewed) for that node, and then holds the node session as
// `bcd node` does, running only the commissioning flow's commands —
// diag.nvml with a burn-in check of the disks, disk.wipe, image.deploy,
// node.kexec — and signing every finished command's report with its key.
//
// The token and the gateway come from the flags, else from the kernel
// command line the site's boot server wrote (bc.boot_token=, bc.gateway=; see agent/kernelargs).
// State (the certificate, the journal) lives in a tmpfs directory.

// DefaultRamdiskRoot is where `bcd ramdisk` keeps its state: a tmpfs.
const DefaultRamdiskRoot = "/run/bcd-ramdisk"

// maxCmdline bounds the kernel command line read (the kernel's own limit is
// a few KiB).
const maxCmdline = 64 << 10

func runRamdisk(ctx context.Context, args []string, stderr io.Writer) error {
	f := newFlags("ramdisk", stderr)
	token := f.str("token", "", "boot token bcjt_<id>.<secret> (default: "+kernelargs.BootToken+"= on the kernel command line)")
	gateway := f.str("gateway", "", "gateway host:port (default: "+kernelargs.Gateway+"= on the kernel command line)")
	root := f.str("root", DefaultRamdiskRoot, "state directory (a tmpfs: nothing in it outlives the boot)")
	disks := f.str("disks", "", "comma-separated disks of this machine, the only ones disk.wipe and image.deploy touch (default: every disk in /sys/block)")
	workDir := f.str("work-dir", "", "where node.kexec downloads its kernel and initrd (default <root>/work)")
	keyFile := f.str("joinservice-key", "", "joinservice's HPKE public key: PEM PUBLIC KEY (X25519) or 32 bytes hex/base64 (default <root>/joinservice.pub)")
	keyID := f.str("joinservice-key-id", "", "id of that key (default: the PEM's Key-Id header, else derived from the key)")
	caFile := f.str("ca", "", "PEM CA certificates that sign the gateway's certificate (default: the system's roots)")
	serverName := f.str("server-name", "", "name on the gateway's certificate (default: the host of --gateway)")
	nvml := f.str("nvml", inventory.BackendReal, "NVML backend: real or mock")
	hostname := f.str("hostname", "", "host name to join with (default: this host's)")
	bootID := f.str("boot-id", "", "boot id (default: /proc/sys/kernel/random/boot_id)")
	commandKey := f.str("command-key", "", "the control plane's command-signing public key (PEM PUBLIC KEY, Ed25519); without it destructive commands are refused")
	cmdline := f.str("cmdline", "/proc/cmdline", "the kernel command line to read the boot token and gateway from")
	allowKexec := f.boolean("allow-kexec", false, "let node.kexec boot the fetched kernel (kexec-tools)")
	if err := f.parse(args); err != nil {
		return err
	}
	if *token == "" || *gateway == "" {
		kargs, err := readCmdline(*cmdline)
		if err != nil {
			return err
		}
		*token = cmp.Or(*token, kargs[kernelargs.BootToken])
		*gateway = cmp.Or(*gateway, kargs[kernelargs.Gateway])
	}
	if *token == "" || *gateway == "" {
		return usageError{fmt.Errorf("--token and --gateway are required (or %s= and %s= on the kernel command line)", kernelargs.BootToken, kernelargs.Gateway)}
	}
	diskList := splitList(*disks)
	if len(diskList) == 0 {
		var err error
		if diskList, err = blockDisks("/sys/block"); err != nil {
			return err
		}
	}
	var pub ed25519.PublicKey
	if *commandKey != "" {
		b, err := os.ReadFile(*commandKey)
		if err != nil {
			return fmt.Errorf("command key: %w", err)
		}
		if pub, err = command.ParsePublicKey(b); err != nil {
			return err
		}
	}
	store, err := state.Open(*root)
	if err != nil {
		return err
	}
	if *keyFile == "" {
		*keyFile = filepath.Join(*root, "joinservice.pub")
	}
	b, err := os.ReadFile(*keyFile)
	if err != nil {
		return fmt.Errorf("joinservice key: %w", err)
	}
	jsKey, pemID, err := join.ParsePublicKey(b)
	if err != nil {
		return err
	}
	var roots *x509.CertPool
	if *caFile != "" {
		pemCA, err := os.ReadFile(*caFile)
		if err != nil {
			return fmt.Errorf("ca: %w", err)
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pemCA) {
			return fmt.Errorf("ca: no certificates in %s", *caFile)
		}
	}
	boot, err := state.BootID(*bootID)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(stderr, nil))
	inv, err := inventory.Open(inventory.Config{Backend: *nvml, Hostname: *hostname, Logger: logger})
	if err != nil {
		return err
	}
	defer func() { _ = inv.Close() }()

	// The ramdisk's key: in memory only, a new one every boot. Its
	// certificate binds it, and it signs every result.
	key, err := ramdisk.NewKey()
	if err != nil {
		return err
	}
	id, err := join.Join(ctx, join.Config{
		Gateway: *gateway, ServerName: *serverName, RootCAs: roots, Token: *token,
		JoinserviceKey: jsKey, JoinserviceKeyID: cmp.Or(*keyID, pemID), State: store, Claims: inv,
		Role: join.RoleRamdisk, Key: key,
	})
	if err != nil {
		return err
	}
	rcfg := ramdisk.Config{Disks: diskList, Eraser: ramdisk.ToolEraser{}, WorkDir: cmp.Or(*workDir, filepath.Join(store.Root(), "work")), Logger: logger}
	if *allowKexec {
		rcfg.Kexec = ramdisk.ToolKexec{}
	}
	if err := os.MkdirAll(rcfg.WorkDir, 0o700); err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	rd, err := ramdisk.New(rcfg)
	if err != nil {
		return err
	}
	leaf, err := id.Leaf()
	if err != nil {
		return err
	}
	logger.Info("ramdisk joined", "node", id.NodeID, "certificate_expires", leaf.NotAfter, "disks", diskList)
	return session.Run(ctx, session.Config{
		Gateway: *gateway, ServerName: *serverName, State: store, Inventory: inv,
		BootID: boot, AgentVersion: version(), Logger: logger.With("mode", "ramdisk"),
		CommandKey: pub, Key: key, Ramdisk: rd, ResultKey: key, NoRenew: true,
	})
}

// readCmdline reads the kernel command line at path into its key=value
// arguments (a bare word maps to "").
func readCmdline(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("kernel command line: %w", err)
	}
	defer func() { _ = f.Close() }()
	b, err := io.ReadAll(io.LimitReader(f, maxCmdline+1))
	if err != nil {
		return nil, fmt.Errorf("kernel command line: %w", err)
	}
	if len(b) > maxCmdline {
		return nil, fmt.Errorf("kernel command line %s: longer than %d bytes", path, maxCmdline)
	}
	return kernelargs.Parse(string(b)), nil
}

func splitList(s string) []string {
	var out []string
	for v := range strings.SplitSeq(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// blockDisks lists the whole disks under sys (/sys/block) as /dev paths,
// leaving out loop, RAM, optical, device-mapper and RAID devices.
func blockDisks(sys string) ([]string, error) {
	ents, err := os.ReadDir(sys)
	if err != nil {
		return nil, fmt.Errorf("list disks: %w", err)
	}
	var out []string
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, "loop") || strings.HasPrefix(name, "ram") || strings.HasPrefix(name, "zram") ||
			strings.HasPrefix(name, "sr") || strings.HasPrefix(name, "dm-") || strings.HasPrefix(name, "md") || strings.HasPrefix(name, "nbd") {
			continue
		}
		out = append(out, "/dev/"+name)
	}
	if len(out) == 0 {
		return nil, errors.New("no disks found in " + sys + ": name them with --disks")
	}
	return out, nil
}
