// Package fakebmc is a fake Redfish BMC for tests, the simulator and
// `make run`: an http.Handler that serves the DMTF Redfish resources the site
// agent uses for one machine — the ServiceRoot, the Systems collection and one
// ComputerSystem with its Processors, Memory, EthernetInterfaces and
// Storage/Drives, the ComputerSystem.Reset action (with its ActionInfo), PATCH
// of the boot override, and the SessionService.
//
// Every resource carries @odata.id and @odata.type; the system carries an ETag
// and honours If-Match. Everything but the service root and session creation
// needs HTTP Basic credentials or a session token (X-Auth-Token) from
// POST /redfish/v1/SessionService/Sessions.
//
// Power and boot behave like a real BMC, synchronously: a reset that brings
// the machine up "boots" it from the override target when one is set (else
// from the configured default, Hdd), calls the OnPowerOn hook with that target
// ("Pxe", "Hdd") and, for a one-time override (BootSourceOverrideEnabled
// Once), resets the override to Disabled. On and ForceOff on a machine
// already in that state answer 409, as iDRAC does.
//
// Faults: FailNext makes the next N requests answer 503 with a Redfish error,
// SetLatency delays every response. Actions lists what was done (resets,
// boot overrides, boots, sessions). The BMC logs each request (method, path,
// status, user) and never a password, a token or a request body.
package fakebmc

import (
	"cmp"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Boot override values (DMTF ComputerSystem.BootSourceOverrideEnabled and
// BootSourceOverrideTarget).
const (
	OverrideOnce       = "Once"
	OverrideContinuous = "Continuous"
	OverrideDisabled   = "Disabled"

	TargetNone = "None"
	TargetPxe  = "Pxe"
	TargetHdd  = "Hdd"
)

// Reset types the fake accepts (DMTF ResetType).
const (
	ResetOn               = "On"
	ResetForceOff         = "ForceOff"
	ResetGracefulShutdown = "GracefulShutdown"
	ResetForceRestart     = "ForceRestart"
	ResetPowerCycle       = "PowerCycle"
)

// ResetTypes lists the reset types in the order the ActionInfo gives them.
var resetTypes = []string{ResetOn, ResetForceOff, ResetGracefulShutdown, ResetForceRestart, ResetPowerCycle}

var (
	overrideValues = []string{OverrideOnce, OverrideContinuous, OverrideDisabled}
	targetValues   = []string{TargetNone, TargetPxe, TargetHdd}
)

// Machine describes the simulated machine. Zero fields get the defaults of
// DefaultMachine field by field (a zero slice takes the default list).
type Machine struct {
	// SystemID is the ComputerSystem's Id (default "1").
	SystemID     string
	Manufacturer string
	Model        string
	SerialNumber string
	// UUID is the system UUID (default a fixed one; give each machine its own).
	UUID string
	// CPUs are the processor sockets.
	CPUs []CPU
	// DIMMs are the memory modules; MemorySummary totals them.
	DIMMs []DIMM
	// NICs are the Ethernet interfaces.
	NICs []NIC
	// Disks are the drives of the one Storage subsystem.
	Disks []Disk
	// PoweredOn is the power state at start (default off).
	PoweredOn bool
	// DefaultBoot is the target a boot without an override uses (default Hdd).
	DefaultBoot string
}

// CPU is one processor socket.
type CPU struct {
	Model        string
	Manufacturer string
	Cores        int
	Threads      int
}

// DIMM is one memory module.
type DIMM struct {
	CapacityMiB  int
	SerialNumber string
}

// NIC is one Ethernet interface.
type NIC struct {
	// MAC is the MAC address, colon separated.
	MAC       string
	SpeedMbps int
}

// Disk is one drive.
type Disk struct {
	Model         string
	SerialNumber  string
	CapacityBytes int64
	// MediaType is SSD or HDD (default SSD).
	MediaType string
}

// DefaultMachine is a 2-socket GPU server: 2 × 56-core CPUs, 16 × 64 GiB
// DIMMs (1 TiB), two NICs and two NVMe drives.
func DefaultMachine() Machine {
	m := Machine{
		SystemID:     "1",
		Manufacturer: "Better Compute Sim",
		Model:        "BC-H200-8",
		SerialNumber: "SIM0000001",
		UUID:         "4c4c4544-0000-4000-8000-000000000001",
		NICs: []NIC{
			{MAC: "02:00:00:00:00:01", SpeedMbps: 100000},
			{MAC: "02:00:00:00:00:02", SpeedMbps: 100000},
		},
		Disks: []Disk{
			{Model: "SIM NVMe 3.84TB", SerialNumber: "SIMDISK0001", CapacityBytes: 3840755982336, MediaType: "SSD"},
			{Model: "SIM NVMe 3.84TB", SerialNumber: "SIMDISK0002", CapacityBytes: 3840755982336, MediaType: "SSD"},
		},
		DefaultBoot: TargetHdd,
	}
	for range 2 {
		m.CPUs = append(m.CPUs, CPU{Model: "Intel(R) Xeon(R) Platinum 8480+", Manufacturer: "Intel(R) Corporation", Cores: 56, Threads: 112})
	}
	for i := range 16 {
		m.DIMMs = append(m.DIMMs, DIMM{CapacityMiB: 65536, SerialNumber: fmt.Sprintf("SIMDIMM%04d", i+1)})
	}
	return m
}

func (m Machine) withDefaults() Machine {
	d := DefaultMachine()
	m.SystemID = cmp.Or(m.SystemID, d.SystemID)
	m.Manufacturer = cmp.Or(m.Manufacturer, d.Manufacturer)
	m.Model = cmp.Or(m.Model, d.Model)
	m.SerialNumber = cmp.Or(m.SerialNumber, d.SerialNumber)
	m.UUID = cmp.Or(m.UUID, d.UUID)
	m.DefaultBoot = cmp.Or(m.DefaultBoot, d.DefaultBoot)
	if m.CPUs == nil {
		m.CPUs = d.CPUs
	}
	if m.DIMMs == nil {
		m.DIMMs = d.DIMMs
	}
	if m.NICs == nil {
		m.NICs = d.NICs
	}
	if m.Disks == nil {
		m.Disks = d.Disks
	}
	return m
}

// Config configures a BMC.
type Config struct {
	// Machine is the simulated machine (zero fields: DefaultMachine's).
	Machine Machine
	// Username and Password are the one account's credentials (required).
	Username string
	Password string
	// Logger receives one line per request (default: discard).
	Logger *slog.Logger
	// OnPowerOn is called, synchronously inside the request that powered the
	// machine up, with the boot target ("Pxe", "Hdd"). It must not call back
	// into the BMC's HTTP API on the same goroutine; start a goroutine for
	// long work (a simulated ramdisk).
	OnPowerOn func(bootTarget string)
	// OnPowerOff is called, likewise, when the machine loses power.
	OnPowerOff func()
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Action is one thing the BMC did.
type Action struct {
	Time time.Time
	// Kind is Reset, BootOverride, Boot, PowerOff, SessionCreate or SessionDelete.
	Kind string
	// Detail: the ResetType, "<Enabled>/<Target>", the boot target, or the user.
	Detail string
}

// BMC is the fake Redfish service of one machine. It is safe for concurrent use.
type BMC struct {
	cfg Config
	log *slog.Logger
	now func() time.Time

	mu         sync.Mutex
	machine    Machine
	powerOn    bool
	override   string // BootSourceOverrideEnabled
	target     string // BootSourceOverrideTarget
	generation int    // bumps on every change of the system; the ETag
	sessions   map[string]*session
	nextSess   int
	actions    []Action
	failNext   int
	requests   int
	latency    time.Duration
	onPowerOn  func(string)
	onPowerOff func()
}

type session struct {
	id    string
	token string
	user  string
}

// Limits on what the fake accepts.
const (
	maxBody       = 64 << 10
	maxSessions   = 64
	maxCredential = 256
)

// New returns a BMC for cfg.
func New(cfg Config) (*BMC, error) {
	if cfg.Username == "" || cfg.Password == "" {
		return nil, errors.New("fakebmc: username and password are required")
	}
	m := cfg.Machine.withDefaults()
	if m.DefaultBoot != TargetPxe && m.DefaultBoot != TargetHdd {
		return nil, fmt.Errorf("fakebmc: DefaultBoot %q: want Pxe or Hdd", m.DefaultBoot)
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	b := &BMC{
		cfg:        cfg,
		log:        cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		now:        now,
		machine:    m,
		powerOn:    m.PoweredOn,
		override:   OverrideDisabled,
		target:     TargetNone,
		generation: 1,
		sessions:   map[string]*session{},
		onPowerOn:  cfg.OnPowerOn,
		onPowerOff: cfg.OnPowerOff,
	}
	return b, nil
}

// Must is New that panics on a bad Config (tests, examples).
func Must(cfg Config) *BMC {
	b, err := New(cfg)
	if err != nil {
		panic(err)
	}
	return b
}

// OnPowerOn replaces the power-on hook (see Config.OnPowerOn).
func (b *BMC) OnPowerOn(fn func(bootTarget string)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.onPowerOn = fn
}

// OnPowerOff replaces the power-off hook.
func (b *BMC) OnPowerOff(fn func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.onPowerOff = fn
}

// FailNext makes the next n requests (any path, authenticated or not) answer
// 503 Service Unavailable.
func (b *BMC) FailNext(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failNext = n
}

// SetLatency delays every response by d (until the request's context ends).
func (b *BMC) SetLatency(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.latency = d
}

// PowerState is "On" or "Off".
func (b *BMC) PowerState() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return powerState(b.powerOn)
}

// BootOverride returns BootSourceOverrideEnabled and BootSourceOverrideTarget.
func (b *BMC) BootOverride() (enabled, target string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.override, b.target
}

// Actions returns a copy of what the BMC did, oldest first.
func (b *BMC) Actions() []Action {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]Action(nil), b.actions...)
}

// Sessions is the number of open sessions.
func (b *BMC) Sessions() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.sessions)
}

// Requests is the number of requests served so far (including failed ones).
func (b *BMC) Requests() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.requests
}

// Machine returns the machine description (with defaults filled in).
func (b *BMC) Machine() Machine {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.machine
}

// HostPowerOff powers the machine off from the host side (the OS halted),
// as a ramdisk that finished would; no hook is called.
func (b *BMC) HostPowerOff() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.powerOn {
		b.powerOn = false
		b.generation++
		b.record("PowerOff", "host")
	}
}

func powerState(on bool) string {
	if on {
		return "On"
	}
	return "Off"
}

// record appends an action; b.mu is held.
func (b *BMC) record(kind, detail string) {
	b.actions = append(b.actions, Action{Time: b.now(), Kind: kind, Detail: detail})
}

func newToken() string {
	var p [24]byte
	_, _ = rand.Read(p[:])
	return hex.EncodeToString(p[:])
}

func equal(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// ServeHTTP serves the Redfish API.
func (b *BMC) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
	user := ""
	defer func() {
		// Never the body, headers, query or credentials: method, path, status, user.
		b.log.LogAttrs(r.Context(), slog.LevelInfo, "redfish request",
			slog.String("method", r.Method), slog.String("path", r.URL.Path),
			slog.Int("status", rec.status), slog.String("user", user))
	}()

	b.mu.Lock()
	b.requests++
	latency := b.latency
	fail := b.failNext > 0
	if fail {
		b.failNext--
	}
	b.mu.Unlock()
	if latency > 0 {
		t := time.NewTimer(latency)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			rec.status = 499
			return
		}
	}
	if fail {
		writeError(rec, http.StatusServiceUnavailable, "Base.1.16.ServiceTemporarilyUnavailable",
			"The service is temporarily unavailable.")
		return
	}
	r.Body = http.MaxBytesReader(rec, r.Body, maxBody)

	path := strings.TrimSuffix(r.URL.Path, "/")
	switch path {
	case "/redfish":
		if !allow(rec, r, http.MethodGet) {
			return
		}
		writeJSON(rec, http.StatusOK, map[string]any{"v1": "/redfish/v1/"})
		return
	case "/redfish/v1":
		if !allow(rec, r, http.MethodGet) {
			return
		}
		writeJSON(rec, http.StatusOK, b.serviceRoot())
		return
	case sessionsPath:
		if r.Method == http.MethodPost {
			user = b.createSession(rec, r)
			return
		}
	}

	var ok bool
	user, ok = b.authenticate(r)
	if !ok {
		rec.Header().Set("WWW-Authenticate", `Basic realm="fakebmc"`)
		writeError(rec, http.StatusUnauthorized, "Base.1.16.NoValidSession",
			"There is no valid session established with the implementation.")
		return
	}
	b.route(rec, r, path)
}

// authenticate checks X-Auth-Token, then Basic credentials.
func (b *BMC) authenticate(r *http.Request) (string, bool) {
	if tok := r.Header.Get("X-Auth-Token"); tok != "" {
		b.mu.Lock()
		defer b.mu.Unlock()
		for _, s := range b.sessions {
			if equal(s.token, tok) {
				return s.user, true
			}
		}
		return "", false
	}
	u, p, ok := r.BasicAuth()
	if !ok || len(u) > maxCredential || len(p) > maxCredential {
		return "", false
	}
	if equal(u, b.cfg.Username) && equal(p, b.cfg.Password) {
		return u, true
	}
	return "", false
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.status = code
	s.ResponseWriter.WriteHeader(code)
}
