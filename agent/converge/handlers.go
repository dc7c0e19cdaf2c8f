package converge

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/bettercompute/bettercompute/agent/cdi"
	"github.com/bettercompute/bettercompute/agent/engines"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/siteconf"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/runtimespec"
	"github.com/bettercompute/bettercompute/proto/sitespec"
)

// Files the handlers keep under the root.
const (
	// CDISpecFile is the devices handler's CDI spec when Config.CDI is
	// unset (tests and simulated nodes): <root>/cdi/bettercompute.io-gpu.json.
	CDISpecFile = "cdi/" + cdi.SpecFile
	// SiteFile is the site handler's settings.
	SiteFile = "site.json"
	// HealthFile is the health handler's settings.
	HealthFile = "health.json"
	// CDIKind is the CDI kind of the devices the spec names.
	CDIKind = cdi.Kind
)

// empty reports whether a section is unset or has nothing set.
func empty(m proto.Message) bool { return m == nil || proto.Size(m) == 0 }

func marshal(v any) []byte {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		panic(err) // plain structs of strings and numbers always marshal
	}
	return append(b, '\n')
}

// identityHandler checks that the spec is for this node; it changes
// nothing on disk.
type identityHandler struct{}

func (identityHandler) Section() string { return "identity" }

func (identityHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	id := d.GetIdentity()
	if id == nil || id.GetNodeId() == cur.NodeID {
		return Plan{}, nil
	}
	return Plan{Terminal: fmt.Sprintf("the spec is for node %q, this node is %q", id.GetNodeId(), cur.NodeID)}, nil
}

func (identityHandler) Apply(context.Context, Current, Plan) error { return nil }

// devicesHandler keeps the node's CDI spec (package cdi) offering exactly
// the booked GPUs: one device per GPU (by UUID) and one per reservation
// (sorted by reservation, UUIDs in spec order), and no spec file when the
// section is empty. The spec goes into every CDI directory of the runtime
// section (runtimespec.Dirs, under the runtime root), or, with no valid
// runtime section, into the default writer's directory (bcd's --cdi-dir);
// a directory it wrote to and no longer names has the spec removed. A GPU
// not in the inventory is left out and makes the section FAILED, so the
// GPUs that are there, and the removal of GPUs taken away, still take
// effect; the next converge retries. A spec file that differs from what
// the handler last wrote was edited or removed by hand: the pass that
// finds it restores it and says so in the reason ("drifted: …"); the next
// pass reports plain convergence.
type devicesHandler struct {
	def     *cdi.Writer            // the directory with no runtime section
	root    string                 // the runtime section's directories are under it
	writers map[string]*cdi.Writer // by directory
	last    map[string][]byte      // by directory: what the file last held by the handler's doing (nil: absent)
	wrote   map[string]bool        // by directory: whether last is known (the handler manages it)
	migs    func(context.Context) (map[string]inventory.MIGDevice, error)
	pending cdi.Spec      // the spec Plan generated, for Apply
	write   []*cdi.Writer // where Apply writes pending
	drop    []*cdi.Writer // where Apply removes the spec
	// runner runs docker for its discovered-devices check (nil: none).
	runner engines.Runner
	// check is what outcome verifies once the spec is on disk (nil: a
	// failed plan or nothing offered); verified is the key of the last
	// check that passed and note what it said.
	check          *resolveCheck
	verified, note string
}

// resolveCheck is the resolution the devices handler checks after a pass:
// every device of the spec, as an engine resolves it, from the
// directories written.
type resolveCheck struct {
	names   []string
	dirs    []string
	inject  bool // every device node is on the host
	docker  bool // the runtime section names docker
	summary string
	key     string
}

func newDevicesHandler(def *cdi.Writer, root string, migs func(context.Context) (map[string]inventory.MIGDevice, error), runner engines.Runner) *devicesHandler {
	return &devicesHandler{def: def, root: root, migs: migs, writers: map[string]*cdi.Writer{def.Dir(): def},
		last: map[string][]byte{}, wrote: map[string]bool{}, runner: runner}
}

func (*devicesHandler) Section() string { return "devices" }

// writersFor are the writers of the directories d's runtime section names
// (the default one without a valid section).
func (h *devicesHandler) writersFor(d *agentv1.NodeSpec) ([]*cdi.Writer, error) {
	r := d.GetRuntime()
	if empty(r) || len(runtimespec.Validate(r)) > 0 {
		return []*cdi.Writer{h.def}, nil
	}
	var out []*cdi.Writer
	for _, dir := range runtimespec.Dirs(r) {
		abs := filepath.Join(h.root, dir)
		w, ok := h.writers[abs]
		if !ok {
			var err error
			if w, err = h.def.In(abs); err != nil {
				return nil, err
			}
			h.writers[abs] = w
		}
		out = append(out, w)
	}
	return out, nil
}

func (h *devicesHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	sec := d.GetDevices()
	var terminal, missing []string
	seenRsv, seenGPU := map[string]bool{}, map[string]string{}
	var rsvs []cdi.Reservation
	asg := slices.Clone(sec.GetAssignments())
	// MIG devices (MIG-…) the section books: looked up once, after the
	// mig section (which runs first) made them.
	var migs map[string]inventory.MIGDevice
	var migGPUs []cdi.GPU
	if h.migs != nil && slices.ContainsFunc(asg, func(a *agentv1.DeviceAssignment) bool {
		return slices.ContainsFunc(a.GetGpuUuids(), func(u string) bool { return strings.HasPrefix(u, "MIG-") })
	}) {
		var err error
		if migs, err = h.migs(context.Background()); err != nil {
			return Plan{}, fmt.Errorf("reading the MIG devices: %w", err)
		}
	}
	slices.SortStableFunc(asg, func(a, b *agentv1.DeviceAssignment) int {
		return strings.Compare(a.GetReservationId(), b.GetReservationId())
	})
	for _, a := range asg {
		rsv := a.GetReservationId()
		switch {
		case rsv == "":
			terminal = append(terminal, "an assignment has no reservation id")
			continue
		case seenRsv[rsv]:
			terminal = append(terminal, fmt.Sprintf("reservation %s is assigned twice", rsv))
			continue
		case cdi.ValidName(rsv) != nil:
			terminal = append(terminal, fmt.Sprintf("reservation %q is not a CDI device name: %v", rsv, cdi.ValidName(rsv)))
			continue
		}
		seenRsv[rsv] = true
		var uuids []string
		for _, u := range a.GetGpuUuids() {
			if err := cdi.ValidName(u); err != nil {
				terminal = append(terminal, fmt.Sprintf("GPU %q of %s is not a CDI device name: %v", u, rsv, err))
				continue
			}
			if other, ok := seenGPU[u]; ok {
				terminal = append(terminal, fmt.Sprintf("GPU %s is assigned to both %s and %s", u, other, rsv))
				continue
			}
			seenGPU[u] = rsv
			if md, ok := migs[u]; ok && cur.GPUs[md.GPU] {
				migGPUs = append(migGPUs, cdi.GPU{UUID: u, Minor: cur.Minors[md.GPU], MIG: &cdi.MIGInstance{GI: md.GI, CI: md.CI}})
				uuids = append(uuids, u)
				continue
			}
			if !cur.GPUs[u] {
				missing = append(missing, u)
				continue
			}
			uuids = append(uuids, u)
		}
		if len(uuids) > 0 {
			rsvs = append(rsvs, cdi.Reservation{ID: rsv, GPUs: uuids})
		}
	}
	gpus := make([]cdi.GPU, 0, len(cur.GPUs))
	for u := range cur.GPUs {
		gpus = append(gpus, cdi.GPU{UUID: u, Minor: cur.Minors[u]})
	}
	gpus = append(gpus, migGPUs...)
	var p Plan
	spec, err := h.def.Generate(gpus, rsvs)
	if err != nil {
		return Plan{}, err // names were checked and GPUs filtered above
	}
	if len(terminal) > 0 {
		p.Terminal = "invalid devices section: " + strings.Join(terminal, "; ")
	}
	if len(missing) > 0 {
		p.Failure = "GPUs not in this node's inventory: " + strings.Join(missing, ", ")
	}
	ws, err := h.writersFor(d)
	if err != nil {
		return Plan{}, err
	}
	p.Summary = exposure(rsvs)
	if spec.Raw != nil {
		dirs := make([]string, len(ws))
		for i, w := range ws {
			dirs[i] = w.Dir()
		}
		p.Summary += "; CDI spec in " + strings.Join(dirs, ", ")
	}
	if len(spec.Notes) > 0 {
		p.Summary += "; " + strings.Join(spec.Notes, "; ")
	}
	h.pending, h.write, h.drop = spec, nil, nil
	var drifted []string
	wanted := map[string]bool{}
	for _, w := range ws {
		wanted[w.Dir()] = true
		st, err := w.Check(spec, h.last[w.Dir()])
		if err != nil {
			return Plan{}, err
		}
		if st == cdi.Current {
			// The file is what the section wants: watch it from here on.
			h.last[w.Dir()], h.wrote[w.Dir()] = spec.Data, true
			continue
		}
		h.write = append(h.write, w)
		if spec.Raw == nil {
			p.Steps = append(p.Steps, "remove "+w.Path())
		} else {
			p.Steps = append(p.Steps, fmt.Sprintf("write %s (%d bytes)", w.Path(), len(spec.Data)))
		}
		if st == cdi.Drifted {
			drifted = append(drifted, w.Path())
		}
	}
	for _, dir := range slices.Sorted(maps.Keys(h.wrote)) {
		if wanted[dir] {
			continue
		}
		w := h.writers[dir]
		if st, err := w.Check(cdi.Spec{}, nil); err == nil && st == cdi.Current {
			delete(h.wrote, dir)
			delete(h.last, dir)
			continue
		}
		h.drop = append(h.drop, w)
		p.Steps = append(p.Steps, "remove "+w.Path()+" (no longer a CDI directory of the runtime section)")
	}
	if len(drifted) > 0 {
		p.Summary = fmt.Sprintf("drifted: %s was edited or removed by hand, restored; %s", strings.Join(drifted, ", "), p.Summary)
	}
	h.check = nil
	if spec.Raw != nil && p.Terminal == "" && p.Failure == "" {
		c := &resolveCheck{summary: p.Summary, inject: !slices.ContainsFunc(spec.Notes, func(n string) bool {
			return strings.HasPrefix(n, cdi.MissingNodesNote)
		})}
		for _, dev := range spec.Raw.Devices {
			c.names = append(c.names, cdi.Kind+"="+dev.Name)
		}
		for _, w := range ws {
			c.dirs = append(c.dirs, w.Dir())
		}
		r := d.GetRuntime()
		c.docker = !empty(r) && len(runtimespec.Validate(r)) == 0 && slices.Contains(r.GetEngines(), runtimespec.Docker)
		sum := sha256.Sum256(spec.Data)
		c.key = fmt.Sprintf("%x|%s|%t|%t", sum, strings.Join(c.dirs, ","), c.inject, c.docker)
		h.check = c
	}
	return p, nil
}

// outcome checks, once the spec is on disk, that every device it offers
// resolves as a container engine resolves it (cdi.Resolve: the library the
// engines run, over the directories written) and, where the runtime
// section names docker, that the daemon has discovered them. A failure is
// FAILED (retried), naming the device; a pass is cached until the spec,
// its directories or the engines change.
func (h *devicesHandler) outcome() (agentv1.SectionState, string, bool) {
	c := h.check
	if c == nil {
		return 0, "", false
	}
	if c.key != h.verified {
		note, problem := h.verify(c)
		if problem != "" {
			h.verified = ""
			return agentv1.SectionState_SECTION_STATE_FAILED, problem + "; " + c.summary, true
		}
		h.verified, h.note = c.key, note
	}
	return agentv1.SectionState_SECTION_STATE_CONVERGED, c.summary + h.note, true
}

func (h *devicesHandler) verify(c *resolveCheck) (note, problem string) {
	res, err := cdi.Resolve(c.dirs, c.names, c.inject)
	if err != nil {
		return "", "checking the spec: " + err.Error()
	}
	if len(res.Problems) > 0 {
		return "", "the CDI library, as the engines run it, does not resolve " + strings.Join(res.Problems, "; ")
	}
	if c.inject {
		note = fmt.Sprintf("; %d devices resolve as the engines resolve them (%d device nodes)", res.Devices, res.DeviceNodes)
	} else {
		note = fmt.Sprintf("; %d devices resolve as the engines resolve them (injection not tried: device nodes missing)", res.Devices)
	}
	if c.docker {
		ctx, cancel := context.WithTimeout(context.Background(), engines.CheckTimeout)
		defer cancel()
		lacks, why := engines.DockerDevices(ctx, h.runner, c.names)
		switch {
		case why != "":
			note += "; docker " + why
		case len(lacks) > 0:
			return "", "docker has not discovered " + strings.Join(lacks, ", ")
		default:
			note += "; docker has discovered them"
		}
	}
	return note, ""
}

// exposure says what the spec offers, for the section's status reason:
// "exposes 4 GPUs: rsv_a (GPU-1,GPU-2) as bettercompute.io/gpu=rsv_a, …".
func exposure(rsvs []cdi.Reservation) string {
	if len(rsvs) == 0 {
		return "exposes no GPUs"
	}
	n := 0
	parts := make([]string, 0, len(rsvs))
	for _, r := range rsvs {
		n += len(r.GPUs)
		parts = append(parts, fmt.Sprintf("%s (%s) as %s=%s", r.ID, strings.Join(r.GPUs, ","), cdi.Kind, r.ID))
	}
	return fmt.Sprintf("exposes %d GPUs: %s", n, strings.Join(parts, ", "))
}

// drifted reports whether a spec file differs from what h last wrote.
func (h *devicesHandler) drifted() bool {
	for dir := range h.wrote {
		st, err := h.writers[dir].Check(cdi.Spec{Data: h.last[dir]}, h.last[dir])
		if err != nil || st != cdi.Current {
			return true
		}
	}
	return false
}

func (h *devicesHandler) Apply(context.Context, Current, Plan) error {
	for _, w := range h.write {
		if err := w.Write(h.pending); err != nil {
			return err
		}
		h.last[w.Dir()], h.wrote[w.Dir()] = h.pending.Data, true
	}
	for _, w := range h.drop {
		if err := w.Write(cdi.Spec{}); err != nil {
			return err
		}
		delete(h.wrote, w.Dir())
		delete(h.last, w.Dir())
	}
	return nil
}

// SiteFileContent is SiteFile: the section's fields, each left out when
// unset. It is the record the daemon's in-memory settings (log level, OTLP
// endpoint, proxy) are loaded from at start.
type SiteFileContent struct {
	Gateways      *[]string `json:"gateways,omitempty"`
	NTPServers    *[]string `json:"ntp_servers,omitempty"`
	DNSServers    *[]string `json:"dns_servers,omitempty"`
	HTTPProxy     *string   `json:"http_proxy,omitempty"`
	NoProxy       *[]string `json:"no_proxy,omitempty"`
	OTLPEndpoint  *string   `json:"otlp_endpoint,omitempty"`
	LogLevel      *string   `json:"log_level,omitempty"`
	SearchDomains *[]string `json:"search_domains,omitempty"`
	// TelemetryInterval is a Go duration ("10s").
	TelemetryInterval *string `json:"telemetry_interval,omitempty"`
}

// settings are the fields the node applies.
func (c SiteFileContent) settings() siteconf.Settings {
	deref := func(p *[]string) []string {
		if p == nil {
			return nil
		}
		return *p
	}
	str := func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	}
	set := siteconf.Settings{
		NTPServers: deref(c.NTPServers), DNSServers: deref(c.DNSServers), SearchDomains: deref(c.SearchDomains), HTTPProxy: str(c.HTTPProxy),
		NoProxy: deref(c.NoProxy), OTLPEndpoint: str(c.OTLPEndpoint), LogLevel: str(c.LogLevel),
	}
	if c.TelemetryInterval != nil {
		// Unparsable or zero: -1, which Validate refuses.
		set.TelemetryInterval = -1
		if d, err := time.ParseDuration(*c.TelemetryInterval); err == nil && d != 0 {
			set.TelemetryInterval = d
		}
	}
	return set
}

// siteHandler records the section in SiteFile (removed when the section is
// empty), writes the system files siteconf.Plan names under root (none when
// root is ""), and keeps the applied settings in memory: it switches the
// daemon's log level and tells onChange. Its status reason has one entry
// per field ("ntp_servers: applied (…); dns_servers: unset; …"); a field
// that cannot be applied here (DNS without systemd-resolved) makes the
// section FAILED_TERMINAL with the others still applied.
type siteHandler struct {
	root     string
	level    *slog.LevelVar
	def      slog.Level
	onChange func(siteconf.Settings)

	mu  sync.Mutex
	cur siteconf.Settings
}

func (*siteHandler) Section() string { return "site" }

func list(l *agentv1.StringList) *[]string {
	if l == nil {
		return nil
	}
	v := append([]string{}, l.GetValues()...)
	return &v
}

func (h *siteHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	s := d.GetSite()
	var c SiteFileContent
	if s != nil {
		c = SiteFileContent{
			Gateways: list(s.GetGateways()), NTPServers: list(s.GetNtpServers()), DNSServers: list(s.GetDnsServers()),
			HTTPProxy: s.HttpProxy, NoProxy: list(s.GetNoProxy()), OTLPEndpoint: s.OtlpEndpoint, LogLevel: s.LogLevel,
			SearchDomains: list(s.GetSearchDomains()),
		}
		if d := s.GetTelemetryInterval(); d != nil {
			v := d.AsDuration().String()
			c.TelemetryInterval = &v
		}
	}
	// The section is checked as it came, by the rule pools.update applies
	// (proto/sitespec), then as the daemon will read it.
	var bad []string
	for _, p := range sitespec.Validate(sitespec.FromProto(s)) {
		bad = append(bad, p.String())
	}
	set := c.settings()
	if len(bad) == 0 {
		bad = siteconf.Validate(set)
	}
	if len(bad) > 0 {
		return Plan{Terminal: "invalid site section: " + strings.Join(bad, "; ")}, nil
	}
	var data []byte
	if c != (SiteFileContent{}) {
		data = marshal(c)
	}
	acts, err := fileAction(cur, SiteFile, data)
	if err != nil {
		return Plan{}, err
	}
	files, fields := siteconf.Plan(h.root, set)
	for _, f := range files {
		a, err := fileAction(Current{Root: h.root}, f.Path, f.Data)
		if err != nil {
			return Plan{}, err
		}
		for i := range a {
			a[i].Root = h.root
		}
		acts = append(acts, a...)
	}
	p := Plan{Actions: acts}
	var failed []string
	parts := make([]string, 0, len(fields))
	for _, f := range fields {
		parts = append(parts, f.String())
		if f.State == siteconf.Failed {
			failed = append(failed, f.Name)
		}
	}
	p.Summary = strings.Join(parts, "; ")
	if len(failed) > 0 {
		p.Terminal = "not applied: " + strings.Join(failed, ", ") + "; " + p.Summary
	}
	// The in-memory settings follow the spec even when no file changes
	// (e.g. the daemon started with SiteFile already in place).
	if !set.Equal(h.current()) {
		p.Steps = append(p.Steps, "apply the daemon's site settings")
	}
	return p, nil
}

func (h *siteHandler) Apply(_ context.Context, cur Current, p Plan) error {
	if err := applyFiles(cur, p.Actions); err != nil {
		return err
	}
	return h.load(cur.Root, false)
}

// load reads SiteFile (absent: nothing set) and applies its daemon
// settings: the log level, and onChange when they changed (or always, with
// initial).
func (h *siteHandler) load(root string, initial bool) error {
	b, err := Current{Root: root}.ReadFile(SiteFile)
	if err != nil {
		return fmt.Errorf("converge: %w", err)
	}
	var c SiteFileContent
	if b != nil {
		if err := json.Unmarshal(b, &c); err != nil {
			return fmt.Errorf("converge: %s: %w", SiteFile, err)
		}
	}
	set := c.settings()
	if bad := siteconf.Validate(set); len(bad) > 0 {
		// Written by an older daemon that checked less: nothing of it is
		// used; the spec's next converge says what is wrong.
		set = siteconf.Settings{}
	}
	h.mu.Lock()
	changed := !set.Equal(h.cur)
	h.cur = set
	h.mu.Unlock()
	if h.level != nil {
		h.level.Set(set.Level(h.def))
	}
	if h.onChange != nil && (changed || initial) {
		h.onChange(set)
	}
	return nil
}

func (h *siteHandler) current() siteconf.Settings {
	h.mu.Lock()
	defer h.mu.Unlock()
	v := h.cur
	v.NTPServers, v.DNSServers, v.NoProxy = slices.Clone(v.NTPServers), slices.Clone(v.DNSServers), slices.Clone(v.NoProxy)
	v.SearchDomains = slices.Clone(v.SearchDomains)
	return v
}

// Health is the health section as the daemon's checks use it. Zero
// durations and thresholds mean the daemon's defaults (no diagnostics for
// DiagnosticsInterval; see Interval and Checks for the others).
type Health struct {
	CheckInterval             time.Duration
	DiagnosticsInterval       time.Duration
	DiagnosticsLevel          string
	MaxGPUTemperatureCelsius  uint32
	MaxUncorrectableECCErrors uint32
	MaxCorrectableECCErrors   uint32
	CriticalXIDs              []uint32
	MaxRetiredPages           uint32
	DisabledChecks            []string
}

// Equal reports whether h and o are the same settings.
func (h Health) Equal(o Health) bool {
	return h.CheckInterval == o.CheckInterval && h.DiagnosticsInterval == o.DiagnosticsInterval &&
		h.DiagnosticsLevel == o.DiagnosticsLevel && h.MaxGPUTemperatureCelsius == o.MaxGPUTemperatureCelsius &&
		h.MaxUncorrectableECCErrors == o.MaxUncorrectableECCErrors && h.MaxCorrectableECCErrors == o.MaxCorrectableECCErrors &&
		h.MaxRetiredPages == o.MaxRetiredPages && slices.Equal(h.CriticalXIDs, o.CriticalXIDs) &&
		slices.Equal(h.DisabledChecks, o.DisabledChecks)
}

// Interval is how often the GPU health checks run: CheckInterval, or
// inventory.DefaultCheckInterval when the section sets none.
func (h Health) Interval() time.Duration {
	if h.CheckInterval > 0 {
		return h.CheckInterval
	}
	return inventory.DefaultCheckInterval
}

// Checks is the section as the inventory's health checks take it.
func (h Health) Checks() inventory.HealthConfig {
	return inventory.HealthConfig{
		MaxGPUTemperatureCelsius: h.MaxGPUTemperatureCelsius, MaxUncorrectableECCErrors: h.MaxUncorrectableECCErrors,
		MaxCorrectableECCErrors: h.MaxCorrectableECCErrors, CriticalXIDs: slices.Clone(h.CriticalXIDs),
		MaxRetiredPages: h.MaxRetiredPages, DisabledChecks: slices.Clone(h.DisabledChecks),
	}
}

// Bounds of the health section.
const (
	// MinCheckInterval is the shortest check_interval a node takes.
	MinCheckInterval = time.Second
	// MaxCriticalXIDs bounds critical_xids.
	MaxCriticalXIDs = 64
	// MaxXID is the largest XID code critical_xids may name.
	MaxXID = 1024
)

// healthFileContent is HealthFile.
type healthFileContent struct {
	CheckInterval             string   `json:"check_interval,omitempty"`
	DiagnosticsInterval       string   `json:"diagnostics_interval,omitempty"`
	DiagnosticsLevel          string   `json:"diagnostics_level,omitempty"`
	MaxGPUTemperatureCelsius  uint32   `json:"max_gpu_temperature_celsius,omitempty"`
	MaxUncorrectableECCErrors uint32   `json:"max_uncorrectable_ecc_errors,omitempty"`
	MaxCorrectableECCErrors   uint32   `json:"max_correctable_ecc_errors,omitempty"`
	CriticalXIDs              []uint32 `json:"critical_xids,omitempty"`
	MaxRetiredPages           uint32   `json:"max_retired_pages,omitempty"`
	DisabledChecks            []string `json:"disabled_checks,omitempty"`
}

// healthHandler writes HealthFile (removed when the section is empty) and
// keeps the applied settings for the daemon.
type healthHandler struct {
	mu  sync.Mutex
	cur Health
	// changed is closed and replaced when cur changes.
	changed chan struct{}
	// last is the last background diagnostics run (RunDiagnostics),
	// the section's status reason once converged.
	last atomic.Pointer[Diagnostics]
}

// changes returns a channel closed when the applied settings next change.
func (h *healthHandler) changes() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.changed == nil {
		h.changed = make(chan struct{})
	}
	return h.changed
}

func (*healthHandler) Section() string { return "health" }

func (h *healthHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	hs := d.GetHealth()
	var summary string
	if run := h.last.Load(); run != nil {
		summary = run.Summary
	}
	if empty(hs) {
		acts, err := fileAction(cur, HealthFile, nil)
		return Plan{Actions: acts, Summary: summary}, err
	}
	var bad []string
	for _, f := range []struct {
		name string
		d    *durationpb.Duration
	}{{"check_interval", hs.GetCheckInterval()}, {"diagnostics_interval", hs.GetDiagnosticsInterval()}} {
		switch {
		case f.d == nil:
		case f.d.CheckValid() != nil:
			bad = append(bad, f.name+": "+f.d.CheckValid().Error())
		case f.d.AsDuration() < 0:
			bad = append(bad, f.name+" is negative")
		}
	}
	if ci := hs.GetCheckInterval(); ci != nil && ci.CheckValid() == nil && ci.AsDuration() > 0 && ci.AsDuration() < MinCheckInterval {
		bad = append(bad, fmt.Sprintf("check_interval %s is below %s", ci.AsDuration(), MinCheckInterval))
	}
	if l := hs.GetDiagnosticsLevel(); l != "" && !slices.Contains([]string{"quick", "medium", "long"}, l) {
		bad = append(bad, fmt.Sprintf("diagnostics level %q: want quick, medium or long", l))
	}
	if n := len(hs.GetCriticalXids()); n > MaxCriticalXIDs {
		bad = append(bad, fmt.Sprintf("critical_xids: %d, at most %d", n, MaxCriticalXIDs))
	}
	for _, x := range hs.GetCriticalXids() {
		if x == 0 || x > MaxXID {
			bad = append(bad, fmt.Sprintf("critical_xids: %d is not an XID (1 to %d)", x, MaxXID))
			break
		}
	}
	if n := len(hs.GetDisabledChecks()); n > len(inventory.Checks) {
		bad = append(bad, fmt.Sprintf("disabled_checks: %d, at most %d", n, len(inventory.Checks)))
	}
	for _, c := range hs.GetDisabledChecks() {
		switch {
		case c == inventory.CheckFallenOffBus:
			bad = append(bad, "disabled_checks: fallen_off_bus cannot be turned off")
		case !slices.Contains(inventory.Checks, c):
			bad = append(bad, fmt.Sprintf("disabled_checks: unknown check %q (want one of %s)", c, strings.Join(inventory.Checks[:len(inventory.Checks)-1], ", ")))
		}
	}
	if len(bad) > 0 {
		slices.Sort(bad)
		bad = slices.Compact(bad)
		return Plan{Terminal: "invalid health section: " + strings.Join(bad, "; ")}, nil
	}
	c := healthFileContent{
		DiagnosticsLevel:          hs.GetDiagnosticsLevel(),
		MaxGPUTemperatureCelsius:  hs.GetMaxGpuTemperatureCelsius(),
		MaxUncorrectableECCErrors: hs.GetMaxUncorrectableEccErrors(),
		MaxCorrectableECCErrors:   hs.GetMaxCorrectableEccErrors(),
		CriticalXIDs:              hs.GetCriticalXids(),
		MaxRetiredPages:           hs.GetMaxRetiredPages(),
		DisabledChecks:            hs.GetDisabledChecks(),
	}
	if hs.GetCheckInterval() != nil {
		c.CheckInterval = hs.GetCheckInterval().AsDuration().String()
	}
	if hs.GetDiagnosticsInterval() != nil {
		c.DiagnosticsInterval = hs.GetDiagnosticsInterval().AsDuration().String()
	}
	acts, err := fileAction(cur, HealthFile, marshal(c))
	return Plan{Actions: acts, Summary: summary}, err
}

func (h *healthHandler) Apply(_ context.Context, cur Current, p Plan) error {
	if err := applyFiles(cur, p.Actions); err != nil {
		return err
	}
	return h.load(cur.Root)
}

// load reads HealthFile (absent: zero settings).
func (h *healthHandler) load(root string) error {
	b, err := Current{Root: root}.ReadFile(HealthFile)
	if err != nil {
		return fmt.Errorf("converge: %w", err)
	}
	var v Health
	if b != nil {
		var c healthFileContent
		if err := json.Unmarshal(b, &c); err != nil {
			return fmt.Errorf("converge: %s: %w", HealthFile, err)
		}
		v = Health{DiagnosticsLevel: c.DiagnosticsLevel, MaxGPUTemperatureCelsius: c.MaxGPUTemperatureCelsius,
			MaxUncorrectableECCErrors: c.MaxUncorrectableECCErrors, MaxCorrectableECCErrors: c.MaxCorrectableECCErrors,
			CriticalXIDs: c.CriticalXIDs, MaxRetiredPages: c.MaxRetiredPages, DisabledChecks: c.DisabledChecks}
		for _, f := range []struct {
			s string
			d *time.Duration
		}{{c.CheckInterval, &v.CheckInterval}, {c.DiagnosticsInterval, &v.DiagnosticsInterval}} {
			if f.s == "" {
				continue
			}
			if *f.d, err = time.ParseDuration(f.s); err != nil {
				return fmt.Errorf("converge: %s: %w", HealthFile, err)
			}
		}
	}
	h.mu.Lock()
	if !h.cur.Equal(v) && h.changed != nil {
		close(h.changed)
		h.changed = nil
	}
	h.cur = v
	h.mu.Unlock()
	return nil
}

func (h *healthHandler) current() Health {
	h.mu.Lock()
	defer h.mu.Unlock()
	v := h.cur
	v.CriticalXIDs, v.DisabledChecks = slices.Clone(v.CriticalXIDs), slices.Clone(v.DisabledChecks)
	return v
}

// unsupported is a section whose handler is not built yet: converged when
// the section is empty, else FAILED_TERMINAL with what it would do.
type unsupported struct {
	section string
	would   func(*agentv1.NodeSpec) (proto.Message, string)
}

func (u unsupported) Section() string { return u.section }

func (u unsupported) Plan(_ Current, d *agentv1.NodeSpec) (Plan, error) {
	m, would := u.would(d)
	if empty(m) {
		return Plan{}, nil
	}
	return Plan{Terminal: "not built yet: would " + would}, nil
}

func (unsupported) Apply(context.Context, Current, Plan) error { return nil }

func planMig(d *agentv1.NodeSpec) (proto.Message, string) {
	m := d.GetMig()
	var parts []string
	for _, g := range m.GetGpus() {
		if !g.GetMigEnabled() {
			parts = append(parts, "disable MIG on "+g.GetGpuUuid())
			continue
		}
		parts = append(parts, fmt.Sprintf("enable MIG on %s with instances [%s]", g.GetGpuUuid(), strings.Join(g.GetProfiles(), ", ")))
	}
	return m, strings.Join(parts, "; ")
}

func planInstances(d *agentv1.NodeSpec) (proto.Message, string) {
	in := d.GetInstances()
	var parts []string
	for _, i := range in.GetInstances() {
		parts = append(parts, fmt.Sprintf("%s %s (image %s, %d vCPUs, %d bytes, GPUs [%s])",
			map[bool]string{true: "stop", false: "run"}[i.GetState() == "stopped"], i.GetId(), i.GetImage(), i.GetVcpus(), i.GetMemoryBytes(), strings.Join(i.GetGpuUuids(), ", ")))
	}
	if len(parts) == 0 {
		return in, "stop every VPS instance on this host"
	}
	return in, strings.Join(parts, "; ") + ", and stop any other instance"
}

func planAgent(d *agentv1.NodeSpec) (proto.Message, string) {
	a := d.GetAgent()
	var parts []string
	if v := a.GetDesiredVersion(); v != "" {
		parts = append(parts, "upgrade bcd to "+v)
	}
	if ch := a.GetChannel(); ch != "" {
		parts = append(parts, "follow release channel "+ch)
	}
	return a, strings.Join(parts, " and ")
}
