// Package pxe is the boot server of `bcd site`: everything a machine on the
// site's boot network needs to go from power-on to `bcd ramdisk` (or back
// to its local disk), served by the site agent itself.
//
// What runs where, all on the site host, on the boot network's interface:
//
//	UDP 67    proxy DHCP: answers only PXE/HTTP-boot clients whose MAC the
//	          Machines interface knows; never offers an address (yiaddr
//	          0.0.0.0, no lease options), so the site's own DHCP server
//	          keeps handing out leases. The offer carries option 60
//	          "PXEClient" (or "HTTPClient"), option 43 "boot the offered file,
//	          no discovery", next-server and the boot file:
//	            BIOS (arch 0)                 undionly.kpxe over TFTP
//	            UEFI x64 (arch 7, 9)          ipxe.efi over TFTP
//	            UEFI HTTP boot (arch 16)      http://<ip>/ipxe/ipxe.efi
//	            iPXE (user class "iPXE")      http://<ip>/boot/<mac>.ipxe
//	UDP 4011  the PXE boot server port: the same answer as an ACK, for ROMs
//	          that ask there after their lease.
//	UDP 69    TFTP, read-only: the iPXE binaries from IPXEDir and nothing
//	          else (Debian's `ipxe` package puts them in /usr/lib/ipxe).
//	TCP 80    HTTP:
//	            /boot/<mac>.ipxe          the machine's iPXE script: boot
//	                                      `bcd ramdisk` (kernel and initrd
//	                                      from the image cache, the gateway
//	                                      and a one-time boot token on the
//	                                      command line; a second fetch is 410)
//	                                      or the local disk; 404 if unknown
//	            /images/sha256/<hex>      the content-addressed image cache,
//	                                      Range requests supported
//	            /ipxe/<name>              iPXE binaries for UEFI HTTP boot
//
// The control-plane side (the site session, the boot lease, Redfish) lives
// elsewhere in `bcd site`; it feeds decisions and tokens in through
// Machines (Table is the in-memory one) and images through Prefetch. This
// package imports nothing of the control plane.
package pxe

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4/server4"
	"github.com/pin/tftp/v3"
)

// Config configures a Server. Zero values take the defaults named.
type Config struct {
	// IP is the site host's IPv4 address on the boot network: next-server,
	// the DHCP server identifier and the host of every URL handed out.
	// Required.
	IP netip.Addr
	// Interface is the boot network's interface; the DHCP sockets are bound
	// to it so broadcasts leave and arrive there. Empty: unbound (a host
	// with one interface, tests).
	Interface string
	// DHCPAddr is the proxy DHCP listen address. Empty: ":67".
	DHCPAddr string
	// PXEAddr is the PXE boot server listen address. Empty: ":4011".
	PXEAddr string
	// TFTPAddr is the TFTP listen address. Empty: ":69".
	TFTPAddr string
	// HTTPAddr is the HTTP listen address; its port goes into the URLs.
	// Empty: ":80".
	HTTPAddr string
	// IPXEDir holds the iPXE binaries. Empty: /usr/lib/ipxe.
	IPXEDir string
	// BIOSBootFile and UEFIBootFile name the iPXE binaries in IPXEDir.
	// Empty: undionly.kpxe and ipxe.efi.
	BIOSBootFile string
	UEFIBootFile string
	// CacheDir holds the image cache. Required.
	CacheDir string
	// CacheMaxBytes bounds the image cache. Zero: 32 GiB.
	CacheMaxBytes int64
	// UpstreamClient fetches images from upstream. Nil: a default client.
	UpstreamClient *http.Client
	// Gateway is the control-plane gateway address (host:port) the ramdisk
	// dials, put on its kernel command line. Required.
	Gateway string
	// Machines gives per-MAC boot decisions and boot tokens. Required.
	Machines Machines
	// Logger; nil: slog.Default().
	Logger *slog.Logger
}

func (c *Config) fill() error {
	if !c.IP.Is4() {
		return fmt.Errorf("ip: %q: want an IPv4 address", c.IP)
	}
	if c.Machines == nil {
		return errors.New("machines: required")
	}
	if c.CacheDir == "" {
		return errors.New("cache dir: required")
	}
	host, port, err := net.SplitHostPort(c.Gateway)
	if err != nil || host == "" || port == "" || !cmdlineSafe(c.Gateway) || len(c.Gateway) > 255 {
		return fmt.Errorf("gateway: %q: want host:port", c.Gateway)
	}
	c.DHCPAddr = cmp.Or(c.DHCPAddr, ":67")
	c.PXEAddr = cmp.Or(c.PXEAddr, ":4011")
	c.TFTPAddr = cmp.Or(c.TFTPAddr, ":69")
	c.HTTPAddr = cmp.Or(c.HTTPAddr, ":80")
	c.IPXEDir = cmp.Or(c.IPXEDir, "/usr/lib/ipxe")
	c.BIOSBootFile = cmp.Or(c.BIOSBootFile, "undionly.kpxe")
	c.UEFIBootFile = cmp.Or(c.UEFIBootFile, "ipxe.efi")
	for _, f := range []string{c.BIOSBootFile, c.UEFIBootFile} {
		if strings.ContainsAny(f, `/\`) || f == "." || f == ".." || len(f) > 127 || !cmdlineSafe(f) {
			return fmt.Errorf("boot file: %q: want a plain file name", f)
		}
	}
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return nil
}

// Server runs the proxy DHCP, TFTP and HTTP boot services and the image
// cache. Start it once; Stop is safe before Start and more than once.
type Server struct {
	cfg   Config
	log   *slog.Logger
	files *bootFiles

	mu      sync.Mutex
	started bool
	stopped bool
	cache   *Cache
	dhcp    net.PacketConn
	pxe     net.PacketConn
	tftpLn  net.PacketConn
	tftp    *tftp.Server
	httpLn  net.Listener
	http    *http.Server
	baseURL string
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// New checks cfg and returns a server that is not yet listening.
func New(cfg Config) (*Server, error) {
	if err := cfg.fill(); err != nil {
		return nil, fmt.Errorf("pxe config: %w", err)
	}
	return &Server{
		cfg: cfg,
		log: cfg.Logger.With("component", "pxe"),
		files: &bootFiles{
			dir:     cfg.IPXEDir,
			allowed: map[string]bool{cfg.BIOSBootFile: true, cfg.UEFIBootFile: true},
			log:     cfg.Logger.With("component", "pxe"),
		},
	}, nil
}

// Start opens every listener (failing, with none left open, if one
// cannot be opened) and serves until Stop.
func (s *Server) Start(ctx context.Context) (err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started || s.stopped {
		return errors.New("pxe: already started")
	}
	defer func() {
		if err != nil {
			s.closeLocked()
			s.stopped = true // a failed server is not restarted; make a new one
		}
	}()
	for _, f := range []string{s.cfg.BIOSBootFile, s.cfg.UEFIBootFile} {
		if _, err := os.Stat(filepath.Join(s.cfg.IPXEDir, f)); err != nil {
			s.log.WarnContext(ctx, "iPXE binary missing; install Debian's ipxe package", "file", f, "error", err)
		}
	}
	s.cache, err = NewCache(CacheConfig{Dir: s.cfg.CacheDir, MaxBytes: s.cfg.CacheMaxBytes,
		Client: s.cfg.UpstreamClient, Logger: s.log})
	if err != nil {
		return err
	}
	if s.dhcp, err = listenDHCP(s.cfg.Interface, s.cfg.DHCPAddr); err != nil {
		return fmt.Errorf("proxy dhcp: %w", err)
	}
	if s.pxe, err = listenDHCP(s.cfg.Interface, s.cfg.PXEAddr); err != nil {
		return fmt.Errorf("pxe boot server: %w", err)
	}
	if s.tftpLn, err = net.ListenPacket("udp4", s.cfg.TFTPAddr); err != nil {
		return fmt.Errorf("tftp: %w", err)
	}
	if s.httpLn, err = net.Listen("tcp4", s.cfg.HTTPAddr); err != nil {
		return fmt.Errorf("http: %w", err)
	}
	port := s.httpLn.Addr().(*net.TCPAddr).Port
	s.baseURL = "http://" + s.cfg.IP.String()
	if port != 80 {
		s.baseURL += ":" + strconv.Itoa(port)
	}

	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	base := func() string { return s.baseURL }
	proxy := &proxyDHCP{
		ip:       net.IP(s.cfg.IP.AsSlice()),
		machines: s.cfg.Machines,
		log:      s.log,
		bios:     s.cfg.BIOSBootFile,
		uefi:     s.cfg.UEFIBootFile,
		baseURL:  base,
	}
	sc := &scripts{
		machines: s.cfg.Machines,
		cache:    s.cache,
		gateway:  s.cfg.Gateway,
		baseURL:  base,
		log:      s.log,
		used:     newTokenSet(),
		prefetch: func(img Image) {
			if err := s.cache.Warm(img); err != nil {
				s.log.WarnContext(runCtx, "image cache: warm", "sha256", img.SHA256, "error", err)
			}
		},
	}
	mux := http.NewServeMux()
	mux.Handle("GET /boot/{file}", sc)
	mux.Handle("GET /images/sha256/{hex}", s.cache)
	mux.Handle("GET /ipxe/{name}", s.files)
	s.http = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.tftp = tftp.NewServer(s.files.tftpRead, nil) // nil: writes refused
	s.tftp.SetTimeout(5 * time.Second)

	s.wg.Add(4)
	go func() { defer s.wg.Done(); proxy.serve(runCtx, s.dhcp, phaseDHCP) }()
	go func() { defer s.wg.Done(); proxy.serve(runCtx, s.pxe, phasePXE) }()
	go func() { defer s.wg.Done(); _ = s.tftp.Serve(s.tftpLn) }()
	go func() {
		defer s.wg.Done()
		if err := s.http.Serve(s.httpLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.ErrorContext(runCtx, "http boot server", "error", err)
		}
	}()
	s.started = true
	s.log.InfoContext(ctx, "pxe boot server started", "ip", s.cfg.IP, "interface", s.cfg.Interface,
		"dhcp", s.dhcp.LocalAddr(), "pxe", s.pxe.LocalAddr(), "tftp", s.tftpLn.LocalAddr(), "http", s.baseURL)
	return nil
}

func listenDHCP(iface, addr string) (net.PacketConn, error) {
	ua, err := net.ResolveUDPAddr("udp4", addr)
	if err != nil {
		return nil, err
	}
	// SO_BROADCAST, SO_REUSEADDR and, when iface is set, SO_BINDTODEVICE.
	return server4.NewIPv4UDPConn(iface, ua)
}

// Stop closes every listener, waits for transfers and fetches in flight
// (HTTP responses get 5 s to finish) and returns.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return
	}
	s.stopped = true
	s.closeLocked()
	s.log.Info("pxe boot server stopped")
}

func (s *Server) closeLocked() {
	if s.cancel != nil {
		s.cancel()
	}
	for _, c := range []net.PacketConn{s.dhcp, s.pxe} {
		if c != nil {
			c.Close()
		}
	}
	if s.tftp != nil {
		s.tftp.Shutdown()
	}
	if s.tftpLn != nil {
		s.tftpLn.Close() // in case Serve had not yet taken it when Shutdown ran
	}
	if s.http != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if s.http.Shutdown(ctx) != nil {
			s.http.Close()
		}
		cancel()
	} else if s.httpLn != nil {
		s.httpLn.Close()
	}
	if s.cache != nil {
		s.cache.Close()
	}
	s.wg.Wait()
}

// Prefetch fetches img into the image cache now (the control plane calls
// it ahead of a boot). Start first.
func (s *Server) Prefetch(ctx context.Context, img Image) error {
	s.mu.Lock()
	c := s.cache
	s.mu.Unlock()
	if c == nil {
		return errors.New("pxe: not started")
	}
	return c.Prefetch(ctx, img)
}

// Addrs are the addresses a started server listens on.
type Addrs struct {
	DHCP, PXE, TFTP net.Addr
	HTTP            net.Addr
	// BaseURL is the HTTP base handed to clients: http://<IP>[:port].
	BaseURL string
}

// Addrs returns where the server listens; zero before Start.
func (s *Server) Addrs() Addrs {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.started {
		return Addrs{}
	}
	return Addrs{DHCP: s.dhcp.LocalAddr(), PXE: s.pxe.LocalAddr(), TFTP: s.tftpLn.LocalAddr(),
		HTTP: s.httpLn.Addr(), BaseURL: s.baseURL}
}
