package bcd

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	"github.com/bettercompute/bettercompute/agent/state"
)

// DefaultSiteRoot is where `bcd site` keeps its state unless --root says
// otherwise: apart from a node's, so one machine can be both.
const DefaultSiteRoot = "/var/lib/bcd-site"

// runSite dispatches `bcd site join` and `bcd site run`.
func runSite(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return usageError{errors.New("bcd site: expected join or run")}
	}
	switch args[0] {
	case "join":
		return runSiteJoin(ctx, args[1:], stdout, stderr)
	case "run":
		return runSiteRun(ctx, args[1:], stderr)
	case "-h", "--help", "help":
		fmt.Fprintln(stdout, "usage: bcd site join --token bcst_… --gateway host:port [flags]\n       bcd site run --gateway host:port [flags]")
		return nil
	}
	return usageError{fmt.Errorf("bcd site: unknown command %q (expected join or run)", args[0])}
}

func runSiteJoin(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f := newFlags("site join", stderr)
	token := f.str("token", "", "site token bcst_<id>.<secret> (prefer the environment: flags show in ps)")
	gateway := f.str("gateway", "", "gateway host:port")
	root := f.str("root", DefaultSiteRoot, "state directory")
	keyFile := f.str("joinservice-key", "", "joinservice's HPKE public key: PEM PUBLIC KEY (X25519) or 32 bytes hex/base64 (default <root>/joinservice.pub)")
	keyID := f.str("joinservice-key-id", "", "id of that key (default: the PEM's Key-Id header, else derived from the key)")
	caFile := f.str("ca", "", "PEM CA certificates that sign the gateway's certificate (default: the system's roots)")
	serverName := f.str("server-name", "", "name on the gateway's certificate (default: the host of --gateway)")
	hostname := f.str("hostname", "", "host name to enroll with (default: this host's)")
	if err := f.parse(args); err != nil {
		return err
	}
	if *token == "" || *gateway == "" {
		return usageError{errors.New("--token and --gateway are required")}
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
	pub, pemID, err := join.ParsePublicKey(b)
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
	id, err := site.Join(ctx, join.Config{
		Gateway: *gateway, ServerName: *serverName, RootCAs: roots, Token: *token,
		JoinserviceKey: pub, JoinserviceKeyID: cmp.Or(*keyID, pemID), State: store, Claims: site.HostClaims{Hostname: *hostname},
	})
	if err != nil {
		return err
	}
	leaf, err := id.Stored.Leaf()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "enrolled as site agent %s of %s (certificate valid until %s); state in %s\n", id.AgentID, id.SiteID,
		leaf.NotAfter.UTC().Format("2006-01-02 15:04:05Z"), store.Root())
	return nil
}

func runSiteRun(ctx context.Context, args []string, stderr io.Writer) error {
	f := newFlags("site run", stderr)
	gateway := f.str("gateway", "", "gateway host:port")
	root := f.str("root", DefaultSiteRoot, "state directory (written by bcd site join)")
	serverName := f.str("server-name", "", "name on the gateway's certificate (default: the host of --gateway)")
	hostname := f.str("hostname", "", "host name to say in Hello (default: this host's)")
	ttl := f.str("lease-ttl", site.DefaultLeaseTTL.String(), "the boot lease to ask for (renewed every third of it), at most "+site.MaxLeaseTTL.String())
	bootIP := f.str("boot-ip", "", "this host's IPv4 address on the boot network: serve PXE there while holding the boot lease (empty: PXE off)")
	bootIface := f.str("boot-interface", "", "the boot network's interface the DHCP sockets bind to (default: unbound)")
	ipxeDir := f.str("ipxe-dir", "/usr/lib/ipxe", "directory of the iPXE binaries (Debian's ipxe package)")
	cacheDir := f.str("cache-dir", "", "image cache directory (default <root>/images)")
	httpAddr := f.str("http-addr", ":80", "HTTP boot listen address")
	dhcpAddr := f.str("dhcp-addr", ":67", "proxy DHCP listen address")
	pxeAddr := f.str("pxe-addr", ":4011", "PXE boot server listen address")
	tftpAddr := f.str("tftp-addr", ":69", "TFTP listen address")
	ramdiskGateway := f.str("ramdisk-gateway", "", "gateway host:port put on the ramdisk's kernel command line (default: --gateway)")
	if err := f.parse(args); err != nil {
		return err
	}
	if *gateway == "" {
		return usageError{errors.New("--gateway is required")}
	}
	leaseTTL, err := time.ParseDuration(*ttl)
	if err != nil || leaseTTL <= 0 || leaseTTL > site.MaxLeaseTTL {
		return usageError{fmt.Errorf("--lease-ttl %q: want a duration up to %s", *ttl, site.MaxLeaseTTL)}
	}
	var ip netip.Addr
	if *bootIP != "" {
		if ip, err = netip.ParseAddr(*bootIP); err != nil || !ip.Is4() {
			return usageError{fmt.Errorf("--boot-ip %q: want an IPv4 address", *bootIP)}
		}
	}
	store, err := state.Open(*root)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(stderr, nil))
	var boot site.BootServer = leaseOnly{logger}
	var table *pxe.Table
	if ip.IsValid() {
		table = pxe.NewTable()
		pb, err := site.NewPXEBoot(pxe.Config{
			IP: ip, Interface: *bootIface, DHCPAddr: *dhcpAddr, PXEAddr: *pxeAddr, TFTPAddr: *tftpAddr, HTTPAddr: *httpAddr,
			IPXEDir: *ipxeDir, CacheDir: cmp.Or(*cacheDir, filepath.Join(store.Root(), "images")),
			Gateway: cmp.Or(*ramdiskGateway, *gateway), Machines: table, Logger: logger,
		})
		if err != nil {
			return usageError{err}
		}
		boot = pb
	} else {
		logger.Info("PXE is off: no --boot-ip; the agent holds the boot lease and runs BMC tasks only")
	}
	return site.Run(ctx, site.Config{
		Gateway: *gateway, ServerName: *serverName, State: store, Boot: boot, Version: version(),
		Hostname: *hostname, LeaseTTL: leaseTTL, Logger: logger, PXE: table,
	})
}

// leaseOnly is the boot server without --boot-ip: it holds the lease and
// says so, serving no PXE.
type leaseOnly struct{ log *slog.Logger }

func (l leaseOnly) Serve(epoch int64) error {
	l.log.Info("holding the site's boot lease (PXE off: no --boot-ip)", "epoch", epoch)
	return nil
}

func (l leaseOnly) Stop() { l.log.Info("released the site's boot lease") }
