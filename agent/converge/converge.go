// Package converge converges a node on its desired state (a DesiredState:
// a NodeSpec at a generation). Each NodeSpec section has one Handler with an
// idempotent Plan, computed from what is on the node now and the desired
// section, and an Apply that carries the plan out. The Converger runs every
// handler and reports one SectionStatus per section, plus the observed
// generation: the desired generation once every section converged or failed
// terminally, else the previous one. It persists that number so a restarted
// daemon tells the control plane (Hello.observed_generation) how far it got.
//
// All disk I/O happens under the state root (state.Store.Root()):
//
//	observed_generation   the last fully observed generation, decimal
//	cdi/bettercompute.io-gpu.json the CDI spec (devices), when Config.CDI is
//	                      unset; a node's bcd writes it into the engines'
//	                      CDI directory (/var/run/cdi) instead
//	runtime.json          what Docker's daemon.json keys held before the
//	                      runtime section set them (runtime); the engines'
//	                      files and the section's CDI directories are under
//	                      Config.Runtime.Root (see package engines)
//	site.json             NTP, DNS, proxy, OTLP endpoint, log level (site);
//	                      the system files they make are under Config.Site.Root
//	                      (see package siteconf)
//	health.json           health-check intervals and thresholds (health)
//
// Files are written atomically and only when their content changes, so
// applying the same desired state twice is a no-op.
package converge

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/bettercompute/bettercompute/agent/cdi"
	"github.com/bettercompute/bettercompute/agent/engines"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/siteconf"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/agent/vps"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// ObservedGenerationFile is the file, under the root, that holds the last
// fully observed generation.
const ObservedGenerationFile = "observed_generation"

// DesiredStateFile is the file, under the root, that holds the last desired
// state the node fully observed (protobuf JSON). [New] applies it again, so
// a node that restarts repairs whatever changed while it was down (a
// devices file edited, removed or left over) before the control plane
// speaks: it exposes exactly its booked GPUs again.
const DesiredStateFile = "desired_state.json"

// Current is what a handler's Plan sees of the node: its id, its GPUs and
// the files under the root.
type Current struct {
	// Root is the state root; handlers read and write only under it.
	Root string
	// NodeID is the node's own id.
	NodeID string
	// GPUs is the set of GPU UUIDs in the node's inventory.
	GPUs map[string]bool
	// Minors are the GPUs' minor numbers (/dev/nvidia<minor>) by UUID.
	Minors map[string]int
	// Write writes a file atomically; nil means state.WriteAtomic.
	Write func(path string, data []byte, mode os.FileMode) error
}

// write is c.Write, or state.WriteAtomic.
func (c Current) write(path string, data []byte, mode os.FileMode) error {
	if c.Write != nil {
		return c.Write(path, data, mode)
	}
	return state.WriteAtomic(path, data, mode)
}

// ReadFile returns the content of rel (a path under Root), or nil when the
// file does not exist.
func (c Current) ReadFile(rel string) ([]byte, error) {
	b, err := os.ReadFile(filepath.Join(c.Root, rel))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return b, err
}

// Action is one file change under the root: write Data to Path, or remove
// Path when Remove is set.
type Action struct {
	// Path is relative to the root.
	Path string
	// Root, when set, is the root Path is under instead of the state root
	// (the site handler's system files under Config.SiteRoot).
	Root string
	// Data is the file's new content.
	Data []byte
	// Remove removes the file instead.
	Remove bool
}

// String describes the action.
func (a Action) String() string {
	p := a.Path
	if a.Root != "" {
		p = filepath.Join(a.Root, a.Path)
	}
	if a.Remove {
		return "remove " + p
	}
	return fmt.Sprintf("write %s (%d bytes)", p, len(a.Data))
}

// Plan is what a handler would do to converge its section. An empty plan
// with no Failure and no Terminal means the section has converged.
type Plan struct {
	// Actions are the changes Apply makes; none when the node already
	// matches.
	Actions []Action
	// Failure, when set, makes the section FAILED (retried) even after
	// Actions are applied: e.g. a GPU the section names is not on the node.
	Failure string
	// Terminal, when set, makes the section FAILED_TERMINAL: retrying
	// cannot help (invalid or unsupported). Actions are still applied.
	Terminal string
	// Summary, when set, is the section's status reason once converged:
	// what the node now has (e.g. the GPUs it exposes).
	Summary string
	// Steps are changes other than files that Apply makes (e.g. "start
	// inst_a"); Apply runs when there are Actions or Steps.
	Steps []string
}

// Handler converges one NodeSpec section.
type Handler interface {
	// Section is the NodeSpec field name ("devices", "site", …).
	Section() string
	// Plan compares the node (cur) with the desired spec's section. It only
	// reads; planning again after Apply returns an empty plan.
	Plan(cur Current, desired *agentv1.NodeSpec) (Plan, error)
	// Apply carries p out.
	Apply(ctx context.Context, cur Current, p Plan) error
}

// Config sets up a Converger.
type Config struct {
	// Root is the state root (state.Store.Root()).
	Root string
	// NodeID is the node's own id.
	NodeID string
	// GPUs returns the UUIDs of the node's GPUs (from its inventory); it is
	// called on every Converge. Nil means the node has no GPUs.
	GPUs func(ctx context.Context) ([]string, error)
	// Minors returns the GPUs' minor numbers by UUID (NVML's); nil, or a
	// GPU it leaves out, means the GPU's position in GPUs' list.
	Minors func(ctx context.Context) (map[string]int, error)
	// CDI writes the devices section's CDI spec; nil means a writer for
	// <Root>/cdi (CDISpecFile) with the host's /dev and driver.
	CDI *cdi.Writer
	// Logger logs section failures; nil means slog.Default().
	Logger *slog.Logger
	// Write writes a file atomically; nil means state.WriteAtomic (the
	// store's own WriteAtomic skips fsyncs for a simulated node).
	Write func(path string, data []byte, mode os.FileMode) error
	// VPS runs the instances section; nil means this node runs no VPS
	// runtime (the section is FAILED_TERMINAL unless empty).
	VPS *vps.Reconciler
	// OnSection, when set, hears how long each section's plan and apply
	// took and the state it reached (the SectionState's name without its
	// prefix, e.g. CONVERGED): the daemon's telemetry.
	OnSection func(section, state string, d time.Duration)
	// Site wires the site section into the node and the daemon.
	Site Site
	// Runtime wires the runtime section's engines and CDI directories.
	Runtime Runtime
	// Agent wires the agent section (bcd's own upgrades).
	Agent Agent
	// Driver returns the NVIDIA driver version (NVML's); nil means none is
	// known. DevicesStale compares it, and Minors, with what the last
	// Converge saw: a driver upgrade regenerates the CDI spec at the next
	// drift check instead of the next periodic converge.
	Driver func(ctx context.Context) (string, error)
	// MIGDevices returns the node's MIG devices by MIG UUID (NVML's), for
	// a devices section that books slices; nil means none.
	MIGDevices func(ctx context.Context) (map[string]inventory.MIGDevice, error)
	// MIG reads and applies the GPUs' MIG layouts (the mig section); nil
	// means this node has no NVML to do it with (the section is
	// FAILED_TERMINAL unless empty).
	MIG MIG
}

// Site says where the site section's settings go.
type Site struct {
	// Root is the root the section's system files are written under
	// (siteconf.Plan): "/" on a real node; "" writes none, the fields are
	// only recorded in SiteFile (a simulated node).
	Root string
	// LogLevel is the daemon's log level, switched live by the section's
	// log_level; DefaultLogLevel is what it goes back to when the field is
	// unset. Nil leaves the level alone.
	LogLevel        *slog.LevelVar
	DefaultLogLevel slog.Level
	// OnChange, when set, is called with the settings whenever the applied
	// ones change, and once from New with those persisted (the telemetry
	// exporter follows OTLPEndpoint, the daemon's HTTP client Proxy). It
	// runs on the converging goroutine, must be quick and must not call
	// Converge.
	OnChange func(siteconf.Settings)
}

// Converger runs every section's handler against a desired state. Converge
// must not be called concurrently; ObservedGeneration and Health may be
// called from any goroutine.
type Converger struct {
	cfg      Config
	handlers []Handler
	observed atomic.Int64
	health   *healthHandler
	devices  *devicesHandler
	booked   bookings
	site     *siteHandler
	tunnels  *tunnelsHandler
	mu       sync.Mutex // serialises Converge
	// seen is the driver version and minor numbers the last Converge saw
	// (guarded by mu).
	seen gpuView
}

// gpuView is what the CDI spec is generated from besides the bookings.
type gpuView struct {
	driver string
	minors map[string]int
}

// New returns a Converger for the node, loading the persisted observed
// generation and health settings from the root.
func New(cfg Config) (*Converger, error) {
	if cfg.Root == "" || cfg.NodeID == "" {
		return nil, errors.New("converge: root and node id are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.CDI == nil {
		w, err := cdi.New(cdi.Config{Dir: filepath.Join(cfg.Root, filepath.Dir(CDISpecFile))})
		if err != nil {
			return nil, fmt.Errorf("converge: %w", err)
		}
		cfg.CDI = w
	}
	if cfg.Runtime.Root == "" {
		cfg.Runtime.Root = cfg.Root
	}
	c := &Converger{cfg: cfg, health: &healthHandler{}, devices: newDevicesHandler(cfg.CDI, cfg.Runtime.Root, cfg.MIGDevices, cfg.Runtime.Runner), site: &siteHandler{
		root: cfg.Site.Root, level: cfg.Site.LogLevel, def: cfg.Site.DefaultLogLevel, onChange: cfg.Site.OnChange}, tunnels: &tunnelsHandler{}}
	c.handlers = []Handler{
		identityHandler{},
		c.site,
		&runtimeHandler{cfg: engines.Config{Root: cfg.Runtime.Root, Runner: cfg.Runtime.Runner, NvidiaCTK: cfg.Runtime.NvidiaCTK}},
		// mig before devices: a booking may name the slices it makes.
		&migHandler{mig: cfg.MIG},
		c.devices,
		instances(cfg.VPS),
		c.health,
		&agentHandler{cfg: cfg.Agent},
		c.tunnels,
	}
	b, err := os.ReadFile(filepath.Join(cfg.Root, ObservedGenerationFile))
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("converge: %w", err)
	default:
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("converge: %s: bad generation %q", ObservedGenerationFile, strings.TrimSpace(string(b)))
		}
		c.observed.Store(n)
	}
	if err := c.health.load(cfg.Root); err != nil {
		return nil, err
	}
	if err := c.site.load(cfg.Root, true); err != nil {
		return nil, err
	}
	if err := c.tunnels.load(cfg.Root); err != nil {
		return nil, err
	}
	if err := c.resume(); err != nil {
		return nil, err
	}
	return c, nil
}

// resume applies the persisted last fully observed desired state again
// (see [DesiredStateFile]); the observed generation does not change.
func (c *Converger) resume() error {
	b, err := os.ReadFile(filepath.Join(c.cfg.Root, DesiredStateFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("converge: %w", err)
	}
	var ds agentv1.DesiredState
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, &ds); err != nil {
		// A damaged copy only loses the repair at start; the control plane
		// sends the spec again when the node is behind.
		c.cfg.Logger.Warn("ignoring a damaged persisted desired state", "file", DesiredStateFile, "err", err)
		return nil
	}
	c.Converge(context.Background(), &ds)
	return nil
}

// Handlers are the section handlers in the order they run: NodeSpec field
// order, but mig before devices (a booking may name the MIG slices the mig
// section makes in the same pass).
func (c *Converger) Handlers() []Handler { return c.handlers }

// ObservedGeneration is the last fully observed generation (0 before any).
func (c *Converger) ObservedGeneration() int64 { return c.observed.Load() }

// Health returns the health settings last applied (zero before any); the
// daemon's health checks read their intervals here.
func (c *Converger) Health() Health { return c.health.current() }

// DevicesDrifted reports whether the devices section's CDI spec on disk
// differs from what it last wrote (edited or removed by hand since); the
// daemon checks it more often than it re-converges, and converges at once
// when it is. False before the section wrote anything.
func (c *Converger) DevicesDrifted() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.devices.drifted()
}

// DevicesStale reports whether the devices section's CDI spec needs a
// converge now: a spec file was edited or removed by hand
// (DevicesDrifted), or the NVIDIA driver version or the GPUs' minor
// numbers differ from those the last Converge generated it from (a driver
// upgrade or reload). The daemon calls it every drift check interval.
func (c *Converger) DevicesStale(ctx context.Context) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.devices.drifted() {
		return true
	}
	if len(c.devices.wrote) == 0 {
		return false // nothing written yet: the next Converge generates it
	}
	v, err := c.view(ctx)
	return err == nil && !v.equal(c.seen)
}

// view reads the driver version and minor numbers.
func (c *Converger) view(ctx context.Context) (gpuView, error) {
	var v gpuView
	var err error
	if c.cfg.Driver != nil {
		if v.driver, err = c.cfg.Driver(ctx); err != nil {
			return v, err
		}
	}
	if c.cfg.Minors != nil {
		if v.minors, err = c.cfg.Minors(ctx); err != nil {
			return v, err
		}
	}
	return v, nil
}

func (v gpuView) equal(o gpuView) bool { return v.driver == o.driver && maps.Equal(v.minors, o.minors) }

// Site returns the site settings last applied (zero before any).
func (c *Converger) Site() siteconf.Settings { return c.site.current() }

// Converge plans and applies every section of ds and returns the status of
// each section (all with ds's generation) and the observed generation: ds's
// generation when every section converged or failed terminally, else the
// previous one. It never lowers the observed generation. A nil spec has
// every section empty.
func (c *Converger) Converge(ctx context.Context, ds *agentv1.DesiredState) ([]*agentv1.SectionStatus, int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	gen := ds.GetGeneration()
	spec := ds.GetSpec()
	if spec == nil {
		spec = &agentv1.NodeSpec{}
	}
	c.booked.set(spec)
	cur := Current{Root: c.cfg.Root, NodeID: c.cfg.NodeID, GPUs: map[string]bool{}, Minors: map[string]int{}, Write: c.cfg.Write}
	var gpuErr error
	if c.cfg.GPUs != nil {
		uuids, err := c.cfg.GPUs(ctx)
		if err != nil {
			gpuErr = fmt.Errorf("reading the GPU inventory: %w", err)
		}
		var minors map[string]int
		if c.cfg.Minors != nil && err == nil {
			if minors, err = c.cfg.Minors(ctx); err != nil {
				gpuErr = fmt.Errorf("reading the GPUs' minor numbers: %w", err)
			}
		}
		c.seen.minors = minors
		for i, u := range uuids {
			cur.GPUs[u] = true
			m, ok := minors[u]
			if !ok {
				m = i
			}
			cur.Minors[u] = m
		}
	}

	if c.cfg.Driver != nil {
		if v, err := c.cfg.Driver(ctx); err == nil {
			c.seen.driver = v
		}
	}

	out := make([]*agentv1.SectionStatus, 0, len(c.handlers))
	complete := true
	for _, h := range c.handlers {
		st := &agentv1.SectionStatus{Section: h.Section(), Generation: gen}
		start := time.Now()
		state, reason := c.run(ctx, h, cur, spec)
		if c.cfg.OnSection != nil {
			c.cfg.OnSection(h.Section(), strings.TrimPrefix(state.String(), "SECTION_STATE_"), time.Since(start))
		}
		if h.Section() == "devices" && gpuErr != nil && state == agentv1.SectionState_SECTION_STATE_FAILED {
			reason = reason + " (" + gpuErr.Error() + ")"
		}
		st.State, st.Reason = state, reason
		if r, ok := h.(instanceReporter); ok {
			st.Instances = r.instanceStatuses()
		}
		if state != agentv1.SectionState_SECTION_STATE_CONVERGED && state != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL {
			complete = false
			c.cfg.Logger.WarnContext(ctx, "section not converged", "section", h.Section(), "generation", gen, "reason", reason)
		}
		out = append(out, st)
	}
	if complete && gen >= c.observed.Load() && gen > 0 {
		c.persistDesired(ctx, ds)
	}
	if complete && gen > c.observed.Load() {
		path := filepath.Join(c.cfg.Root, ObservedGenerationFile)
		if err := (Current{Write: c.cfg.Write}).write(path, []byte(strconv.FormatInt(gen, 10)+"\n"), 0o644); err != nil {
			// Not advancing is safe: the control plane sends the spec again.
			c.cfg.Logger.ErrorContext(ctx, "persisting the observed generation", "err", err)
		} else {
			c.observed.Store(gen)
		}
	}
	return out, c.observed.Load()
}

// persistDesired keeps ds as the last fully observed desired state.
func (c *Converger) persistDesired(ctx context.Context, ds *agentv1.DesiredState) {
	b, err := protojson.Marshal(ds)
	if err == nil {
		err = (Current{Write: c.cfg.Write}).write(filepath.Join(c.cfg.Root, DesiredStateFile), b, 0o600)
	}
	if err != nil {
		c.cfg.Logger.ErrorContext(ctx, "persisting the desired state", "err", err)
	}
}

// run plans and applies one section.
func (c *Converger) run(ctx context.Context, h Handler, cur Current, spec *agentv1.NodeSpec) (agentv1.SectionState, string) {
	p, err := h.Plan(cur, spec)
	if err != nil {
		return agentv1.SectionState_SECTION_STATE_FAILED, "planning: " + err.Error()
	}
	if len(p.Actions) > 0 || len(p.Steps) > 0 {
		if err := h.Apply(ctx, cur, p); err != nil {
			return agentv1.SectionState_SECTION_STATE_FAILED, "applying: " + err.Error()
		}
	}
	if r, ok := h.(outcomeReporter); ok {
		if state, reason, ok := r.outcome(); ok {
			return state, reason
		}
	}
	switch {
	case p.Terminal != "":
		return agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL, p.Terminal
	case p.Failure != "":
		return agentv1.SectionState_SECTION_STATE_FAILED, p.Failure
	}
	return agentv1.SectionState_SECTION_STATE_CONVERGED, p.Summary
}

// applyFiles carries out file actions under root.
func applyFiles(cur Current, actions []Action) error {
	for _, a := range actions {
		path := filepath.Join(cmp.Or(a.Root, cur.Root), a.Path)
		if a.Remove {
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := cur.write(path, a.Data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// fileAction returns the action that makes rel hold data (nil: absent), or
// none when it already does.
func fileAction(cur Current, rel string, data []byte) ([]Action, error) {
	have, err := cur.ReadFile(rel)
	if err != nil {
		return nil, err
	}
	switch {
	case data == nil && have == nil:
		return nil, nil
	case data == nil:
		return []Action{{Path: rel, Remove: true}}, nil
	case have != nil && string(have) == string(data):
		return nil, nil
	}
	return []Action{{Path: rel, Data: data}}, nil
}
