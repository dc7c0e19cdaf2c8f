package redfish_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"log/slog"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/site/redfish"
)

const (
	user     = "admin"
	password = "s3cr3t-Pa55w0rd-never-logged"
)

// syncBuffer is a goroutine-safe log sink.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type env struct {
	bmc    *fakebmc.BMC
	srv    *httptest.Server
	caPEM  []byte
	logs   *syncBuffer // both sides
	logger *slog.Logger
	boots  *bootLog
}

type bootLog struct {
	mu      sync.Mutex
	targets []string
}

func (b *bootLog) add(t string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.targets = append(b.targets, t)
}

func (b *bootLog) get() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.targets)
}

func testMachine() fakebmc.Machine {
	return fakebmc.Machine{
		SystemID:     "System.Embedded.1",
		Manufacturer: "Dell Inc.",
		Model:        "PowerEdge XE9680",
		SerialNumber: "ABC1234",
		UUID:         "4C4C4544-0042-3410-8031-B4C04F333233",
		CPUs: []fakebmc.CPU{
			{Model: "AMD EPYC 9654", Manufacturer: "AMD", Cores: 96, Threads: 192},
			{Model: "AMD EPYC 9654", Manufacturer: "AMD", Cores: 96, Threads: 192},
		},
		DIMMs: []fakebmc.DIMM{{CapacityMiB: 32768}, {CapacityMiB: 32768}, {CapacityMiB: 65536}},
		NICs: []fakebmc.NIC{
			{MAC: "B4:96:91:AA:00:01", SpeedMbps: 25000},
			{MAC: "b4:96:91:aa:00:02", SpeedMbps: 400000},
		},
		Disks: []fakebmc.Disk{
			{Model: "Samsung PM1733", SerialNumber: "S4YNNA0R100001", CapacityBytes: 1920383410176, MediaType: "SSD"},
			{Model: "Seagate Exos", SerialNumber: "ZL2ABCDE", CapacityBytes: 16000900661248, MediaType: "HDD"},
			{Model: "Samsung PM1733", SerialNumber: "S4YNNA0R100002", CapacityBytes: 1920383410176, MediaType: "SSD"},
		},
	}
}

func setup(t *testing.T) *env {
	t.Helper()
	logs := &syncBuffer{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e := &env{logs: logs, logger: logger, boots: &bootLog{}}
	e.bmc = fakebmc.Must(fakebmc.Config{
		Machine:   testMachine(),
		Username:  user,
		Password:  password,
		Logger:    logger.With("side", "bmc"),
		OnPowerOn: e.boots.add,
	})
	e.srv = httptest.NewUnstartedServer(e.bmc)
	e.srv.Config.ErrorLog = slog.NewLogLogger(logger.With("side", "bmc").Handler(), slog.LevelWarn)
	e.srv.StartTLS()
	t.Cleanup(e.srv.Close)
	e.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: e.srv.Certificate().Raw})
	return e
}

func (e *env) config() redfish.Config {
	return redfish.Config{
		Endpoint:      e.srv.URL,
		Username:      user,
		Password:      password,
		CAPEM:         e.caPEM,
		Timeout:       20 * time.Second,
		RetryDelay:    time.Millisecond,
		MaxRetryDelay: 5 * time.Millisecond,
		PollInterval:  10 * time.Millisecond,
		Logger:        e.logger.With("side", "client"),
	}
}

func (e *env) connect(t *testing.T) *redfish.Client {
	t.Helper()
	c, err := redfish.Connect(t.Context(), e.config())
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func (e *env) resets() []string {
	var out []string
	for _, a := range e.bmc.Actions() {
		if a.Kind == "Reset" {
			out = append(out, a.Detail)
		}
	}
	return out
}

func TestInventoryMatchesMachine(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c := e.connect(t)
	inv, err := c.Inventory(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := &redfish.Inventory{
		Manufacturer: "Dell Inc.", Model: "PowerEdge XE9680", SerialNumber: "ABC1234",
		UUID: "4c4c4544-0042-3410-8031-b4c04f333233", PowerState: redfish.PowerOff,
		CPUCount: 2, CPUModel: "AMD EPYC 9654", CPUCores: 192, MemoryMiB: 131072,
		NICs: []redfish.NIC{
			{ID: "NIC1", MAC: "b4:96:91:aa:00:01", SpeedMbps: 25000},
			{ID: "NIC2", MAC: "b4:96:91:aa:00:02", SpeedMbps: 400000},
		},
		Disks: []redfish.Disk{
			{ID: "Disk1", Model: "Samsung PM1733", SerialNumber: "S4YNNA0R100001", CapacityBytes: 1920383410176, MediaType: "SSD"},
			{ID: "Disk2", Model: "Seagate Exos", SerialNumber: "ZL2ABCDE", CapacityBytes: 16000900661248, MediaType: "HDD"},
			{ID: "Disk3", Model: "Samsung PM1733", SerialNumber: "S4YNNA0R100002", CapacityBytes: 1920383410176, MediaType: "SSD"},
		},
	}
	if got, w := inv, want; !equalInventory(got, w) {
		t.Errorf("inventory\n got %+v\nwant %+v", *got, *w)
	}
}

func equalInventory(a, b *redfish.Inventory) bool {
	return a.Manufacturer == b.Manufacturer && a.Model == b.Model && a.SerialNumber == b.SerialNumber &&
		a.UUID == b.UUID && a.PowerState == b.PowerState && a.CPUCount == b.CPUCount &&
		a.CPUModel == b.CPUModel && a.CPUCores == b.CPUCores && a.MemoryMiB == b.MemoryMiB &&
		slices.Equal(a.NICs, b.NICs) && slices.Equal(a.Disks, b.Disks)
}

func TestPowerActions(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c := e.connect(t)
	ctx := t.Context()
	steps := []struct {
		action redfish.PowerAction
		want   redfish.PowerState
		resets []string // the resets so far
	}{
		{redfish.ActionOff, redfish.PowerOff, nil}, // already off: no reset
		{redfish.ActionOn, redfish.PowerOn, []string{"On"}},
		{redfish.ActionOn, redfish.PowerOn, []string{"On"}}, // already on: success, no reset
		{redfish.ActionCycle, redfish.PowerOn, []string{"On", "PowerCycle"}},
		{redfish.ActionGracefulOff, redfish.PowerOff, []string{"On", "PowerCycle", "GracefulShutdown"}},
		{redfish.ActionGracefulOff, redfish.PowerOff, []string{"On", "PowerCycle", "GracefulShutdown"}},
		{redfish.ActionCycle, redfish.PowerOn, []string{"On", "PowerCycle", "GracefulShutdown", "On"}}, // cycle of an off machine powers it on
		{redfish.ActionOff, redfish.PowerOff, []string{"On", "PowerCycle", "GracefulShutdown", "On", "ForceOff"}},
	}
	for i, s := range steps {
		if err := c.Power(ctx, s.action); err != nil {
			t.Fatalf("step %d: power %s: %v", i, s.action, err)
		}
		st, err := c.PowerState(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st != s.want || e.bmc.PowerState() != string(s.want) {
			t.Errorf("step %d: after %s: client sees %s, bmc %s; want %s", i, s.action, st, e.bmc.PowerState(), s.want)
		}
		if got := e.resets(); !slices.Equal(got, s.resets) {
			t.Errorf("step %d: after %s: resets %v, want %v", i, s.action, got, s.resets)
		}
	}
	if err := c.WaitPowerState(ctx, redfish.PowerOff); err != nil {
		t.Errorf("wait off: %v", err)
	}
	if err := c.Power(ctx, "reboot"); !errors.Is(err, redfish.ErrConfig) {
		t.Errorf("power reboot: %v, want ErrConfig", err)
	}
}

func TestBootOncePXE(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c := e.connect(t)
	ctx := t.Context()
	if err := c.BootOnce(ctx, redfish.BootPXE); err != nil {
		t.Fatal(err)
	}
	if en, tg := e.bmc.BootOverride(); en != "Once" || tg != "Pxe" {
		t.Fatalf("override %s/%s, want Once/Pxe", en, tg)
	}
	if len(e.boots.get()) != 0 {
		t.Fatalf("booted before power on: %v", e.boots.get())
	}
	if err := c.Power(ctx, redfish.ActionOn); err != nil {
		t.Fatal(err)
	}
	if got := e.boots.get(); !slices.Equal(got, []string{"Pxe"}) {
		t.Fatalf("boots %v, want [Pxe]", got)
	}
	if en, tg := e.bmc.BootOverride(); en != "Disabled" || tg != "None" {
		t.Errorf("override after boot %s/%s, want Disabled/None", en, tg)
	}
	// The next boot is from disk again: the override was one-time.
	if err := c.Power(ctx, redfish.ActionCycle); err != nil {
		t.Fatal(err)
	}
	if got := e.boots.get(); !slices.Equal(got, []string{"Pxe", "Hdd"}) {
		t.Errorf("boots %v, want [Pxe Hdd]", got)
	}
	// BootOnce disk is accepted, and a bad target is refused before any request.
	if err := c.BootOnce(ctx, redfish.BootDisk); err != nil {
		t.Fatal(err)
	}
	if err := c.BootOnce(ctx, "usb"); !errors.Is(err, redfish.ErrConfig) {
		t.Errorf("boot-once usb: %v, want ErrConfig", err)
	}
}

func TestWrongCredentials(t *testing.T) {
	t.Parallel()
	e := setup(t)
	for _, basic := range []bool{false, true} {
		cfg := e.config()
		cfg.Password = "wrong-" + password
		cfg.BasicAuth = basic
		c, err := redfish.Connect(t.Context(), cfg)
		if err == nil {
			c.Close()
			t.Fatalf("basic=%v: connect with a wrong password succeeded", basic)
		}
		if !errors.Is(err, redfish.ErrAuth) {
			t.Errorf("basic=%v: %v, want ErrAuth", basic, err)
		}
		msg := err.Error()
		if strings.Contains(msg, password) || !strings.Contains(msg, e.srv.URL) || !strings.Contains(msg, "connect") || !strings.Contains(msg, "401") {
			t.Errorf("basic=%v: error %q: want the bmc, the operation and 401, never the password", basic, msg)
		}
	}
	if e.bmc.Sessions() != 0 {
		t.Errorf("%d sessions open after failed logins", e.bmc.Sessions())
	}
}

func TestRetries(t *testing.T) {
	t.Parallel()
	t.Run("transient 503s are retried", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		c := e.connect(t)
		e.bmc.FailNext(3) // Attempts defaults to 4
		if err := c.Power(t.Context(), redfish.ActionOn); err != nil {
			t.Fatalf("power on through 3 × 503: %v", err)
		}
		if e.bmc.PowerState() != "On" {
			t.Errorf("power %s after retried power on", e.bmc.PowerState())
		}
	})
	t.Run("a BMC that stays busy is surfaced after bounded attempts", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		cfg := e.config()
		cfg.Attempts = 3
		c, err := redfish.Connect(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		e.bmc.FailNext(100)
		before := e.bmc.Requests()
		_, err = c.Inventory(t.Context())
		if !errors.Is(err, redfish.ErrUnavailable) || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "inventory") {
			t.Fatalf("inventory against a busy bmc: %v, want ErrUnavailable naming 503 and the operation", err)
		}
		var re *redfish.Error
		if !errors.As(err, &re) || re.Status != 503 || re.BMC != e.srv.URL {
			t.Errorf("error %#v: want Status 503 and BMC %s", re, e.srv.URL)
		}
		if n := e.bmc.Requests() - before; n != 3 {
			t.Errorf("%d requests for one busy call, want exactly Attempts=3", n)
		}
	})
	t.Run("a slow BMC hits the call deadline", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		c := e.connect(t)
		e.bmc.SetLatency(time.Hour)
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		_, err := c.PowerState(ctx)
		if !errors.Is(err, redfish.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("power state of a hung bmc: %v, want ErrUnavailable wrapping DeadlineExceeded", err)
		}
		e.bmc.SetLatency(0)
		if _, err := c.PowerState(t.Context()); err != nil {
			t.Errorf("the client is unusable after a deadline: %v", err)
		}
	})
}

func TestTLS(t *testing.T) {
	t.Parallel()
	e := setup(t)
	t.Run("unpinned self-signed certificate is refused", func(t *testing.T) {
		cfg := e.config()
		cfg.CAPEM = nil
		_, err := redfish.Connect(t.Context(), cfg)
		if !errors.Is(err, redfish.ErrTLS) {
			t.Fatalf("connect without a pinned CA: %v, want ErrTLS", err)
		}
	})
	t.Run("explicit insecure connects", func(t *testing.T) {
		cfg := e.config()
		cfg.CAPEM, cfg.Insecure = nil, true
		c, err := redfish.Connect(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	})
	t.Run("insecure and a pinned CA together are refused", func(t *testing.T) {
		cfg := e.config()
		cfg.Insecure = true
		if _, err := redfish.Connect(t.Context(), cfg); !errors.Is(err, redfish.ErrConfig) || !strings.Contains(err.Error(), "insecure") {
			t.Fatalf("%v, want ErrConfig naming insecure", err)
		}
	})
	t.Run("fakebmc.StartTLS with its pinned certificate", func(t *testing.T) {
		b := fakebmc.Must(fakebmc.Config{Username: user, Password: password})
		s, err := fakebmc.StartTLS(b, "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		cfg := e.config()
		cfg.Endpoint, cfg.CAPEM = s.URL, s.CAPEM
		c, err := redfish.Connect(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		inv, err := c.Inventory(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		d := fakebmc.DefaultMachine()
		if inv.SerialNumber != d.SerialNumber || len(inv.NICs) != len(d.NICs) || inv.MemoryMiB != 16*65536 {
			t.Errorf("default machine inventory %+v", inv)
		}
		// A different server's certificate is not trusted.
		cfg.CAPEM = e.caPEM
		if _, err := redfish.Connect(t.Context(), cfg); !errors.Is(err, redfish.ErrTLS) {
			t.Errorf("connect with another server's CA: %v, want ErrTLS", err)
		}
	})
}

func TestSessionLifecycle(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c, err := redfish.Connect(t.Context(), e.config())
	if err != nil {
		t.Fatal(err)
	}
	if e.bmc.Sessions() != 1 {
		t.Fatalf("%d sessions after connect, want 1", e.bmc.Sessions())
	}
	if err := c.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if e.bmc.Sessions() != 0 {
		t.Errorf("%d sessions after close, want 0", e.bmc.Sessions())
	}
	if err := c.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	if _, err := c.PowerState(t.Context()); err == nil {
		t.Error("a call after close succeeded")
	}

	cfg := e.config()
	cfg.BasicAuth = true
	b, err := redfish.Connect(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := b.Inventory(t.Context()); err != nil {
		t.Fatal(err)
	}
	if e.bmc.Sessions() != 0 {
		t.Errorf("basic auth opened %d sessions", e.bmc.Sessions())
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	good := redfish.Config{Endpoint: "https://10.0.0.5", Username: "u", Password: "p"}
	cases := []struct {
		name  string
		edit  func(*redfish.Config)
		field string
	}{
		{"plain http", func(c *redfish.Config) { c.Endpoint = "http://10.0.0.5" }, "endpoint"},
		{"user info", func(c *redfish.Config) { c.Endpoint = "https://root:" + password + "@10.0.0.5" }, "endpoint"},
		{"path", func(c *redfish.Config) { c.Endpoint = "https://10.0.0.5/redfish/v1" }, "endpoint"},
		{"no username", func(c *redfish.Config) { c.Username = "" }, "username"},
		{"no password", func(c *redfish.Config) { c.Password = "" }, "password"},
		{"long password", func(c *redfish.Config) { c.Password = strings.Repeat("x", 257) }, "password"},
		{"bad PEM", func(c *redfish.Config) { c.CAPEM = []byte("not a pem") }, "caPEM"},
	}
	for _, tc := range cases {
		cfg := good
		tc.edit(&cfg)
		_, err := redfish.Connect(t.Context(), cfg)
		if !errors.Is(err, redfish.ErrConfig) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: %v, want ErrConfig naming %s", tc.name, err, tc.field)
		}
		if err != nil && strings.Contains(err.Error(), password) {
			t.Errorf("%s: error carries the password: %v", tc.name, err)
		}
	}
}

// TestNoSecretsInLogs captures every log line of both sides, at debug level,
// over a full session (a failed login, connect, inventory, power, boot
// override, retries, logout) and checks the password appears nowhere.
func TestNoSecretsInLogs(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := t.Context()
	bad := e.config()
	bad.Password = "wrong-" + password
	if _, err := redfish.Connect(ctx, bad); err == nil {
		t.Fatal("wrong password accepted")
	}
	for _, basic := range []bool{false, true} {
		cfg := e.config()
		cfg.BasicAuth = basic
		c, err := redfish.Connect(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Inventory(ctx); err != nil {
			t.Fatal(err)
		}
		e.bmc.FailNext(1)
		if err := c.BootOnce(ctx, redfish.BootPXE); err != nil {
			t.Fatal(err)
		}
		if err := c.Power(ctx, redfish.ActionCycle); err != nil {
			t.Fatal(err)
		}
		if err := c.Power(ctx, redfish.ActionOff); err != nil {
			t.Fatal(err)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
	logs := e.logs.String()
	if testing.Verbose() {
		t.Log(logs)
	}
	for _, want := range []string{"side=bmc", "side=client", "ComputerSystem.Reset", "SessionService/Sessions", "bmc busy, retrying", "bmc logged out", "status=401"} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %q: the capture is not seeing the session\n%s", want, logs)
		}
	}
	basic := base64.StdEncoding.EncodeToString([]byte(user + ":" + password))
	for _, secret := range []string{password, basic, strings.TrimRight(basic, "=")} {
		if strings.Contains(logs, secret) {
			t.Errorf("logs contain a secret %q", secret)
		}
	}
}

// TestBMCCertificatePinning: a pinned certificate (its SHA-256) connects
// without a CA; another pin is refused at the handshake with ErrTLS and a
// *CertificateChangedError naming both digests, before any request (so
// before the credentials) reaches the BMC; trust on first use connects and
// reports the certificate; the modes exclude insecure and each other.
func TestBMCCertificatePinning(t *testing.T) {
	t.Parallel()
	e := setup(t)
	sum := sha256.Sum256(e.srv.Certificate().Raw)
	presented := hex.EncodeToString(sum[:])
	var seen []string
	var mu sync.Mutex
	record := func(s string) { mu.Lock(); seen = append(seen, s); mu.Unlock() }

	cfg := e.config()
	cfg.CAPEM, cfg.CertificateSHA256, cfg.OnCertificate = nil, presented, record
	c, err := redfish.Connect(t.Context(), cfg)
	if err != nil {
		t.Fatalf("the right pin: %v", err)
	}
	c.Close()

	before := e.bmc.Requests()
	cfg.CertificateSHA256 = strings.Repeat("ab", 32)
	_, err = redfish.Connect(t.Context(), cfg)
	var changed *redfish.CertificateChangedError
	if !errors.Is(err, redfish.ErrTLS) || !errors.As(err, &changed) || changed.Presented != presented || !strings.Contains(err.Error(), presented) {
		t.Fatalf("another pin: %v, want ErrTLS with the certificate changed", err)
	}
	if n := e.bmc.Requests() - before; n != 0 {
		t.Fatalf("%d requests reached the BMC whose certificate is not the pinned one", n)
	}

	tofu := e.config()
	tofu.CAPEM, tofu.TrustOnFirstUse, tofu.OnCertificate = nil, true, record
	c, err = redfish.Connect(t.Context(), tofu)
	if err != nil {
		t.Fatalf("trust on first use: %v", err)
	}
	c.Close()
	mu.Lock()
	for _, s := range seen {
		if s != presented {
			t.Errorf("reported %q, want %s", s, presented)
		}
	}
	if len(seen) < 3 {
		t.Errorf("%d certificates reported, want one per connection (3)", len(seen))
	}
	mu.Unlock()

	for name, edit := range map[string]func(*redfish.Config){
		"insecure and a pin": func(c *redfish.Config) { c.CAPEM, c.Insecure, c.CertificateSHA256 = nil, true, presented },
		"tofu and a CA":      func(c *redfish.Config) { c.TrustOnFirstUse = true },
		"tofu and insecure":  func(c *redfish.Config) { c.CAPEM, c.TrustOnFirstUse, c.Insecure = nil, true, true },
		"a pin not hex":      func(c *redfish.Config) { c.CertificateSHA256 = strings.Repeat("zz", 32) },
		"an upper-case pin":  func(c *redfish.Config) { c.CertificateSHA256 = strings.ToUpper(presented) },
	} {
		c := e.config()
		edit(&c)
		if _, err := redfish.Connect(t.Context(), c); !errors.Is(err, redfish.ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", name, err)
		}
	}
}
