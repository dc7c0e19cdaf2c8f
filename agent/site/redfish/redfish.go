// Package redfish is the site agent's client for machines' BMCs, over the
// DMTF Redfish API (github.com/stmcginnis/gofish underneath): Connect opens a
// session (or uses HTTP Basic), Inventory reads the machine as a plain
// struct, Power turns it on, off, cycles it or shuts it down gracefully,
// BootOnce sets a one-time boot override (PXE or disk), PowerState and
// WaitPowerState read the power state, and Close logs out.
//
// Every call runs under a deadline: the caller's context, bounded by
// Config.Timeout. Answers 503 and 429 are retried a bounded number of times
// with back-off; what still fails is an *Error naming the BMC and the
// operation, matching ErrAuth, ErrTLS, ErrUnavailable, ErrUnsupported, ErrBMC or
// ErrConfig with errors.Is. Neither errors nor logs ever carry the password or the session
// token. Power actions are idempotent: powering on a machine that is on (or
// off one that is off) succeeds without a reset, and a 409 from a reset that
// raced to the wanted state is success.
//
// TLS: BMCs use self-signed certificates, so pin one (Config.CAPEM, which
// replaces the system roots, or Config.CertificateSHA256, the certificate
// itself), trust the first one seen (Config.TrustOnFirstUse, reported to
// Config.OnCertificate, for the caller to pin) or set Config.Insecure
// explicitly; with none of them the system roots verify the BMC. Every
// connection reports the SHA-256 of the certificate the BMC presented to
// Config.OnCertificate.
//
// A Client serializes its calls; use one per BMC.
package redfish

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/stmcginnis/gofish"
	"github.com/stmcginnis/gofish/common"
	gf "github.com/stmcginnis/gofish/redfish"
)

// Limits on configuration and on what a BMC may report.
const (
	MaxEndpoint   = 2048
	MaxCredential = 256
	MaxCAPEM      = 64 << 10
	maxMembers    = 1024
)

// Config is what Connect needs. Zero values are documented field by field.
type Config struct {
	// Endpoint is the BMC's base URL, https://host[:port] (required; no path,
	// no user info).
	Endpoint string
	// Username and Password are the BMC account (required, at most 256 bytes).
	Username string
	Password string
	// CAPEM pins the CA (or the BMC's self-signed certificate) in PEM; it
	// replaces the system roots. Empty: the system roots.
	CAPEM []byte
	// Insecure skips certificate verification; it must be set explicitly and
	// excludes CAPEM, CertificateSHA256 and TrustOnFirstUse. Logged as a
	// warning on connect.
	Insecure bool
	// CertificateSHA256 pins the BMC's certificate: the lowercase hex
	// SHA-256 of its DER. Any other certificate fails the connection with
	// ErrTLS (a *CertificateChangedError in the chain). With CAPEM, the
	// chain is verified too; alone, it replaces chain verification.
	CertificateSHA256 string
	// TrustOnFirstUse accepts whatever certificate the BMC presents, for
	// the caller to pin what OnCertificate reports (excludes the others).
	TrustOnFirstUse bool
	// OnCertificate, when set, receives the SHA-256 of the certificate the
	// BMC presented at each TLS handshake, before it is checked.
	OnCertificate func(sha256 string)
	// ServerName overrides the name the certificate is checked against
	// (default: the endpoint's host).
	ServerName string
	// BasicAuth sends HTTP Basic credentials on every request instead of
	// opening a Redfish session (default false: a session, deleted on Close).
	BasicAuth bool
	// SystemID picks the ComputerSystem by Id (default: the first one).
	SystemID string
	// Timeout bounds every call, the caller's deadline permitting (default 30 s).
	Timeout time.Duration
	// Attempts is how many times a request answered 503/429 is tried in all
	// (default 4; 1 disables retries).
	Attempts int
	// RetryDelay is the first back-off (default 500 ms), doubling up to
	// MaxRetryDelay (default 5 s), which also caps Retry-After.
	RetryDelay    time.Duration
	MaxRetryDelay time.Duration
	// PollInterval is WaitPowerState's interval (default 2 s).
	PollInterval time.Duration
	// Logger receives the client's logs (default: discard).
	Logger *slog.Logger
}

// Errors that *Error matches with errors.Is.
var (
	// ErrAuth: the BMC refused the credentials or the session (401, 403).
	ErrAuth = errors.New("authentication failed")
	// ErrUnavailable: the BMC stayed busy (503, 429) after the retries, or
	// could not be reached.
	ErrUnavailable = errors.New("bmc unavailable")
	// ErrUnsupported: the BMC does not offer what was asked (a reset type, a
	// boot target).
	ErrUnsupported = errors.New("not supported by the bmc")
	// ErrTLS: the BMC's certificate did not verify (pin its CA, or set
	// Insecure explicitly).
	ErrTLS = errors.New("bmc certificate not trusted")
	// ErrBMC: any other error answer from the BMC.
	ErrBMC = errors.New("bmc error")
	// ErrConfig: the Config is invalid.
	ErrConfig = errors.New("invalid redfish config")
)

// CertificateChangedError is a BMC presenting a certificate other than the
// pinned one (Config.CertificateSHA256).
type CertificateChangedError struct {
	// Pinned and Presented are the certificates' SHA-256 (Presented empty
	// when the BMC presented none).
	Pinned, Presented string
}

func (e *CertificateChangedError) Error() string {
	if e.Presented == "" {
		return "the bmc presented no certificate"
	}
	return fmt.Sprintf("the bmc's certificate changed: it presented sha256 %s, pinned %s", e.Presented, e.Pinned)
}

// Error is a failed call: which BMC, which operation, and why.
type Error struct {
	// BMC is the endpoint.
	BMC string
	// Op is the operation: connect, inventory, power on, boot-once pxe, ….
	Op string
	// Status is the HTTP status the BMC answered (0 when none).
	Status int
	// Code is the Redfish MessageId of the answer, when it gave one.
	Code string
	// Kind is ErrAuth, ErrTLS, ErrUnavailable, ErrUnsupported, ErrBMC or ErrConfig.
	Kind error
	// Message is the detail, scrubbed of the password and bounded.
	Message string
	// Err is the underlying error (context errors, transport errors), if any.
	Err error
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "bmc %s: %s: %v", e.BMC, e.Op, e.Kind)
	if e.Status != 0 {
		fmt.Fprintf(&b, " (HTTP %d", e.Status)
		if e.Code != "" {
			fmt.Fprintf(&b, " %s", e.Code)
		}
		b.WriteString(")")
	}
	if e.Message != "" {
		b.WriteString(": " + e.Message)
	}
	return b.String()
}

// Is matches e's Kind.
func (e *Error) Is(target error) bool { return target == e.Kind }

// Unwrap returns the underlying error (context.DeadlineExceeded, …).
func (e *Error) Unwrap() error { return e.Err }

// PowerState is the system's power state as Redfish reports it.
type PowerState string

// Power states.
const (
	PowerOn          PowerState = "On"
	PowerOff         PowerState = "Off"
	PowerPoweringOn  PowerState = "PoweringOn"
	PowerPoweringOff PowerState = "PoweringOff"
	PowerPaused      PowerState = "Paused"
)

// PowerAction is what Power does.
type PowerAction string

// Power actions.
const (
	ActionOn          PowerAction = "on"
	ActionOff         PowerAction = "off"          // ForceOff
	ActionCycle       PowerAction = "cycle"        // PowerCycle, or ForceRestart; On when off
	ActionGracefulOff PowerAction = "graceful-off" // GracefulShutdown
)

// BootTarget is where BootOnce boots the machine next.
type BootTarget string

// Boot targets.
const (
	BootPXE  BootTarget = "pxe"
	BootDisk BootTarget = "disk"
)

// Inventory is the machine as its BMC describes it.
type Inventory struct {
	Manufacturer string
	Model        string
	SerialNumber string
	UUID         string
	PowerState   PowerState
	// CPUCount is the number of processor sockets; CPUModel the first one's
	// model; CPUCores the total cores.
	CPUCount int
	CPUModel string
	CPUCores int
	// MemoryMiB is the installed memory: the DIMMs' sum, else the summary.
	MemoryMiB int64
	NICs      []NIC
	Disks     []Disk
}

// NIC is an Ethernet interface.
type NIC struct {
	ID string
	// MAC is the MAC address, lowercase and colon separated.
	MAC       string
	SpeedMbps int
}

// Disk is a drive.
type Disk struct {
	ID            string
	Model         string
	SerialNumber  string
	CapacityBytes int64
	MediaType     string
}

// Client is a connection to one BMC. Its methods are safe for concurrent use
// and run one at a time.
type Client struct {
	cfg Config
	log *slog.Logger
	tr  *transport

	mu     sync.Mutex
	api    *gofish.APIClient
	closed bool
}

func (c Config) validate() error {
	bad := func(field, msg string) error {
		return &Error{BMC: redactURL(c.Endpoint), Op: "connect", Kind: ErrConfig, Message: field + ": " + msg}
	}
	if c.Endpoint == "" || len(c.Endpoint) > MaxEndpoint {
		return bad("endpoint", "required, at most 2048 bytes")
	}
	u, err := url.Parse(c.Endpoint)
	if err != nil || u.Scheme != "https" || u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
		return bad("endpoint", "want https://host[:port]")
	}
	if c.Username == "" || len(c.Username) > MaxCredential {
		return bad("username", "required, at most 256 bytes")
	}
	if c.Password == "" || len(c.Password) > MaxCredential {
		return bad("password", "required, at most 256 bytes")
	}
	if len(c.CAPEM) > MaxCAPEM {
		return bad("caPEM", "at most 64 KiB")
	}
	if c.Insecure && len(c.CAPEM) > 0 {
		return bad("insecure", "excludes a pinned CA")
	}
	if c.CertificateSHA256 != "" {
		if b, err := hex.DecodeString(c.CertificateSHA256); err != nil || len(b) != sha256.Size || strings.ToLower(c.CertificateSHA256) != c.CertificateSHA256 {
			return bad("certificateSHA256", "want 64 lowercase hex digits")
		}
		if c.Insecure {
			return bad("insecure", "excludes a pinned certificate")
		}
	}
	if c.TrustOnFirstUse && (c.Insecure || len(c.CAPEM) > 0 || c.CertificateSHA256 != "") {
		return bad("trustOnFirstUse", "excludes insecure, a pinned CA and a pinned certificate")
	}
	if c.Timeout < 0 || c.Attempts < 0 || c.RetryDelay < 0 || c.MaxRetryDelay < 0 || c.PollInterval < 0 {
		return bad("timeout", "durations and attempts must not be negative")
	}
	return nil
}

// redactURL keeps only scheme and host of an endpoint for messages.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		if len(s) > 64 {
			s = s[:64]
		}
		return fmt.Sprintf("%q", s)
	}
	return u.Scheme + "://" + u.Host
}

// insecureWarned holds the endpoints whose unverified certificate was
// already logged at warn.
var insecureWarned sync.Map

// Connect validates cfg, reaches the BMC's service root, authenticates and
// finds the system. The context bounds only the connect itself.
func Connect(ctx context.Context, cfg Config) (*Client, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.Endpoint = strings.TrimSuffix(cfg.Endpoint, "/")
	cfg.Timeout = cmp.Or(cfg.Timeout, 30*time.Second)
	cfg.Attempts = cmp.Or(cfg.Attempts, 4)
	cfg.RetryDelay = cmp.Or(cfg.RetryDelay, 500*time.Millisecond)
	cfg.MaxRetryDelay = cmp.Or(cfg.MaxRetryDelay, 5*time.Second)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, 2*time.Second)
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("bmc", cfg.Endpoint)
	c := &Client{cfg: cfg, log: log}

	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.ServerName}
	switch {
	case cfg.Insecure:
		tlsCfg.InsecureSkipVerify = true
		// Once per BMC per process: a site agent connects for every task.
		if _, seen := insecureWarned.LoadOrStore(cfg.Endpoint, true); !seen {
			log.Warn("bmc certificate not verified (insecure); later connections to it log at debug")
		} else {
			log.Debug("bmc certificate not verified (insecure)")
		}
	case cfg.TrustOnFirstUse:
		tlsCfg.InsecureSkipVerify = true
		log.Info("bmc certificate trusted on first use: the caller pins it")
	case len(cfg.CAPEM) > 0:
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(cfg.CAPEM) {
			return nil, &Error{BMC: cfg.Endpoint, Op: "connect", Kind: ErrConfig, Message: "caPEM: no certificate in PEM"}
		}
		tlsCfg.RootCAs = pool
	case cfg.CertificateSHA256 != "":
		// The pin alone decides: exactly that certificate, whatever signed it.
		tlsCfg.InsecureSkipVerify = true
	}
	// Runs after chain verification (when there is one) and even with
	// InsecureSkipVerify: it reports and checks the pin.
	tlsCfg.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return &CertificateChangedError{Pinned: cfg.CertificateSHA256}
		}
		sum := sha256.Sum256(cs.PeerCertificates[0].Raw)
		got := hex.EncodeToString(sum[:])
		if cfg.OnCertificate != nil {
			cfg.OnCertificate(got)
		}
		if cfg.CertificateSHA256 != "" && got != cfg.CertificateSHA256 {
			return &CertificateChangedError{Pinned: cfg.CertificateSHA256, Presented: got}
		}
		return nil
	}
	base := &http.Transport{
		Proxy:                  nil, // BMCs sit on the site's management network
		DialContext:            (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:        tlsCfg,
		TLSHandshakeTimeout:    10 * time.Second,
		ResponseHeaderTimeout:  cfg.Timeout,
		MaxIdleConnsPerHost:    2,
		MaxConnsPerHost:        4,
		IdleConnTimeout:        60 * time.Second,
		MaxResponseHeaderBytes: 64 << 10,
	}
	c.tr = &transport{
		base: base, log: log,
		attempts: cfg.Attempts, delay: cfg.RetryDelay, maxDelay: cfg.MaxRetryDelay,
	}
	err := c.do(ctx, "connect", func(ctx context.Context) error {
		api, err := gofish.ConnectContext(context.Background(), gofish.ClientConfig{
			Endpoint:              cfg.Endpoint,
			Username:              cfg.Username,
			Password:              cfg.Password,
			BasicAuth:             cfg.BasicAuth,
			HTTPClient:            &http.Client{Transport: c.tr, CheckRedirect: noRedirect},
			MaxConcurrentRequests: 1,
		})
		if err != nil {
			return err
		}
		if !cfg.BasicAuth {
			if s, err := api.GetSession(); err != nil || s.Token == "" {
				return &Error{Kind: ErrAuth, Message: "the bmc opened no session (no X-Auth-Token)"}
			}
		}
		c.api = api
		// Basic auth is checked by the first authenticated request.
		_, err = c.system()
		return err
	})
	if err != nil {
		if c.api != nil {
			_ = c.logout() // logged by logout; the client is closed either way
		}
		base.CloseIdleConnections()
		return nil, err
	}
	log.Info("bmc connected", "session", !cfg.BasicAuth)
	return c, nil
}

// noRedirect refuses redirects: credentials never follow one elsewhere.
func noRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// do runs fn as operation op under the call deadline, one at a time, and
// turns its error into an *Error.
func (c *Client) do(ctx context.Context, op string, fn func(ctx context.Context) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return &Error{BMC: c.cfg.Endpoint, Op: op, Kind: ErrConfig, Message: "client closed"}
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	c.tr.setContext(ctx)
	defer c.tr.endOperation()
	err := fn(ctx)
	if err == nil {
		return nil
	}
	return c.wrap(ctx, op, err)
}

// wrap classifies err and scrubs it of the password.
func (c *Client) wrap(ctx context.Context, op string, err error) error {
	e := &Error{BMC: c.cfg.Endpoint, Op: op, Kind: ErrBMC}
	var ours *Error
	var rf *common.Error
	var coll *common.CollectionError
	switch {
	case errors.As(err, &ours):
		e.Kind, e.Status, e.Code, e.Message, e.Err = ours.Kind, ours.Status, ours.Code, ours.Message, ours.Err
	case ctx.Err() != nil:
		e.Kind, e.Err, e.Message = ErrUnavailable, ctx.Err(), ctx.Err().Error()
	case errors.As(err, &rf):
		fromRedfish(e, rf)
	case errors.As(err, &coll):
		// A collection member failed: report the first Redfish error in it.
		e.Message = err.Error()
		for _, f := range coll.Failures {
			if errors.As(f, &rf) {
				fromRedfish(e, rf)
				break
			}
		}
	default:
		var netErr net.Error
		var uerr *url.Error
		var unknownCA x509.UnknownAuthorityError
		var badHost x509.HostnameError
		var invalid x509.CertificateInvalidError
		var verify *tls.CertificateVerificationError
		var changed *CertificateChangedError
		switch {
		case errors.As(err, &unknownCA) || errors.As(err, &badHost) || errors.As(err, &invalid) || errors.As(err, &verify) ||
			errors.As(err, &changed):
			e.Kind = ErrTLS
		case errors.As(err, &netErr) || errors.As(err, &uerr):
			e.Kind = ErrUnavailable
		}
		e.Err = err
		e.Message = err.Error()
	}
	e.Message = c.scrub(e.Message)
	return e
}

// fromRedfish fills e from a Redfish error answer.
func fromRedfish(e *Error, rf *common.Error) {
	e.Status = rf.HTTPReturnedStatusCode
	e.Code = rf.Code
	e.Message = rf.Message
	if len(rf.ExtendedInfos) > 0 && rf.ExtendedInfos[0].Message != "" {
		e.Message = rf.ExtendedInfos[0].Message
		e.Code = cmp.Or(rf.ExtendedInfos[0].MessageID, e.Code)
	}
	switch e.Status {
	case http.StatusUnauthorized, http.StatusForbidden:
		e.Kind = ErrAuth
	case http.StatusServiceUnavailable, http.StatusTooManyRequests:
		e.Kind = ErrUnavailable
	default:
		e.Kind = ErrBMC
	}
}

// scrub removes the credentials from a message and bounds it.
func (c *Client) scrub(s string) string {
	if c.cfg.Password != "" {
		s = strings.ReplaceAll(s, c.cfg.Password, "[redacted]")
	}
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 512 {
		s = s[:512] + "…"
	}
	return s
}

// system fetches the ComputerSystem.
func (c *Client) system() (*gf.ComputerSystem, error) {
	if c.cfg.SystemID != "" {
		return gf.GetComputerSystem(c.api, "/redfish/v1/Systems/"+url.PathEscape(c.cfg.SystemID))
	}
	systems, err := c.api.Service.Systems()
	if err != nil {
		return nil, err
	}
	if len(systems) == 0 {
		return nil, &Error{Kind: ErrUnsupported, Message: "the bmc lists no computer system"}
	}
	first := systems[0]
	for _, s := range systems[1:] {
		if s.ODataID < first.ODataID {
			first = s
		}
	}
	return first, nil
}

// PowerState reads the system's power state.
func (c *Client) PowerState(ctx context.Context) (PowerState, error) {
	var st PowerState
	err := c.do(ctx, "power state", func(context.Context) error {
		sys, err := c.system()
		if err != nil {
			return err
		}
		st = PowerState(sys.PowerState)
		return nil
	})
	return st, err
}

// WaitPowerState polls until the system reports want or ctx ends (each
// poll under its own call deadline).
func (c *Client) WaitPowerState(ctx context.Context, want PowerState) error {
	t := time.NewTicker(c.cfg.PollInterval)
	defer t.Stop()
	for {
		st, err := c.PowerState(ctx)
		if err == nil && st == want {
			return nil
		}
		if ctx.Err() != nil {
			return &Error{BMC: c.cfg.Endpoint, Op: "wait power " + string(want), Kind: ErrUnavailable,
				Err: ctx.Err(), Message: fmt.Sprintf("power state still %q", st)}
		}
		select {
		case <-t.C:
		case <-ctx.Done():
		}
	}
}

// ParsePowerAction parses on, off, cycle or graceful-off.
func ParsePowerAction(s string) (PowerAction, error) {
	switch a := PowerAction(s); a {
	case ActionOn, ActionOff, ActionCycle, ActionGracefulOff:
		return a, nil
	}
	return "", fmt.Errorf("power action %q: want on, off, cycle or graceful-off", s)
}

// Power performs action. On when on, off or graceful-off when off succeed
// without a reset; cycle of a machine that is off powers it on.
func (c *Client) Power(ctx context.Context, action PowerAction) error {
	op := "power " + string(action)
	if _, err := ParsePowerAction(string(action)); err != nil {
		return &Error{BMC: c.cfg.Endpoint, Op: op, Kind: ErrConfig, Message: err.Error()}
	}
	return c.do(ctx, op, func(ctx context.Context) error {
		sys, err := c.system()
		if err != nil {
			return err
		}
		st := PowerState(sys.PowerState)
		var want []gf.ResetType
		switch action {
		case ActionOn:
			if st == PowerOn || st == PowerPoweringOn {
				c.log.InfoContext(ctx, "bmc power: already on")
				return nil
			}
			want = []gf.ResetType{gf.OnResetType}
		case ActionOff, ActionGracefulOff:
			if st == PowerOff {
				c.log.InfoContext(ctx, "bmc power: already off", "action", action)
				return nil
			}
			want = []gf.ResetType{gf.ForceOffResetType}
			if action == ActionGracefulOff {
				want = []gf.ResetType{gf.GracefulShutdownResetType}
			}
		case ActionCycle:
			if st == PowerOff {
				want = []gf.ResetType{gf.OnResetType}
			} else {
				want = []gf.ResetType{gf.PowerCycleResetType, gf.ForceRestartResetType}
			}
		}
		rt, ok := pickReset(sys.SupportedResetTypes, want)
		if !ok {
			return &Error{Kind: ErrUnsupported, Message: fmt.Sprintf("reset type %s not offered (offered: %v)", want[0], sys.SupportedResetTypes)}
		}
		c.log.InfoContext(ctx, "bmc reset", "action", action, "resetType", rt, "was", st)
		err = sys.Reset(rt)
		var rf *common.Error
		if errors.As(err, &rf) && rf.HTTPReturnedStatusCode == http.StatusConflict && action != ActionCycle {
			// Raced with another change: fine if the machine is where we want it.
			if now, gerr := c.system(); gerr == nil {
				if (action == ActionOn && PowerState(now.PowerState) == PowerOn) ||
					(action != ActionOn && PowerState(now.PowerState) == PowerOff) {
					return nil
				}
			}
		}
		return err
	})
}

// pickReset returns the first of want the BMC offers (all, if it lists none).
func pickReset(offered []gf.ResetType, want []gf.ResetType) (gf.ResetType, bool) {
	if len(offered) == 0 {
		return want[0], true
	}
	for _, w := range want {
		for _, o := range offered {
			if o == w {
				return w, true
			}
		}
	}
	return "", false
}

// BootOnce makes the next boot, only, boot from target (PXE or the disk),
// and checks that the BMC took it.
func (c *Client) BootOnce(ctx context.Context, target BootTarget) error {
	op := "boot-once " + string(target)
	var rt gf.BootSourceOverrideTarget
	switch target {
	case BootPXE:
		rt = gf.PxeBootSourceOverrideTarget
	case BootDisk:
		rt = gf.HddBootSourceOverrideTarget
	default:
		return &Error{BMC: c.cfg.Endpoint, Op: op, Kind: ErrConfig, Message: fmt.Sprintf("boot target %q: want pxe or disk", target)}
	}
	return c.do(ctx, op, func(ctx context.Context) error {
		sys, err := c.system()
		if err != nil {
			return err
		}
		if allowed := allowableTargets(sys.RawData); len(allowed) > 0 && !contains(allowed, string(rt)) {
			return &Error{Kind: ErrUnsupported, Message: fmt.Sprintf("boot target %s not offered (offered: %v)", rt, allowed)}
		}
		if err := sys.SetBoot(gf.Boot{
			BootSourceOverrideEnabled: gf.OnceBootSourceOverrideEnabled,
			BootSourceOverrideTarget:  rt,
		}); err != nil {
			return err
		}
		after, err := c.system()
		if err != nil {
			return err
		}
		if after.Boot.BootSourceOverrideTarget != rt || after.Boot.BootSourceOverrideEnabled != gf.OnceBootSourceOverrideEnabled {
			return &Error{Kind: ErrBMC, Message: fmt.Sprintf("the bmc reports override %s/%s after setting Once/%s",
				after.Boot.BootSourceOverrideEnabled, after.Boot.BootSourceOverrideTarget, rt)}
		}
		c.log.InfoContext(ctx, "bmc boot override set", "target", rt, "enabled", "Once")
		return nil
	})
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// Close logs out of the session (if any) and releases connections. It is
// safe to call more than once.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.logout()
	c.tr.base.(*http.Transport).CloseIdleConnections()
	return err
}

// logout deletes the session; c.mu is held or c is not yet shared.
func (c *Client) logout() error {
	s, err := c.api.GetSession()
	if err != nil || s.ID == "" {
		return nil // basic auth: nothing to close
	}
	ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.Timeout, 10*time.Second))
	defer cancel()
	c.tr.setContext(ctx)
	defer c.tr.endOperation()
	if err := gf.DeleteSession(c.api, s.ID); err != nil {
		werr := c.wrap(ctx, "logout", err)
		c.log.Warn("bmc logout failed", "err", werr)
		return werr
	}
	c.log.Info("bmc logged out")
	return nil
}
