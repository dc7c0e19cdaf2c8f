package inventory

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// The health checks, by the names GPU.failed_checks and the NodeSpec health
// section's disabled_checks use.
const (
	// CheckXID fails on a critical XID error (HealthConfig.CriticalXIDs).
	// NVIDIA's critical XIDs call for a reset, so the failure holds until
	// the GPU is reset ([Collector.ResetGPU], gpu.reset) or, on the
	// mock, until the XID is no longer injected.
	CheckXID = "xid"
	// CheckECC fails on volatile ECC errors above the thresholds.
	CheckECC = "ecc"
	// CheckRetiredPages fails on more retired pages than the maximum, a
	// pending page retirement, or a pending or failed row remap.
	CheckRetiredPages = "retired_pages"
	// CheckThermal fails while HW thermal slowdown is active, or above
	// the temperature limit when one is set.
	CheckThermal = "thermal"
	// CheckPower fails while HW power-brake slowdown is active.
	CheckPower = "power"
	// CheckPCIeLink fails when the PCIe link runs narrower or at a lower
	// generation than its maximum (the generation is not compared while
	// the GPU idles: idle GPUs lower it to save power).
	CheckPCIeLink = "pcie_link"
	// CheckFallenOffBus fails when NVML answers ERROR_GPU_IS_LOST or the
	// GPU raised XID 79. It cannot be disabled.
	CheckFallenOffBus = "fallen_off_bus"
)

// Checks are every health check, in the order reasons list them.
var Checks = []string{CheckXID, CheckECC, CheckRetiredPages, CheckThermal, CheckPower, CheckPCIeLink, CheckFallenOffBus}

// Defaults of the health section.
const (
	// DefaultCheckInterval is how often the daemon checks its GPUs.
	DefaultCheckInterval = 30 * time.Second
	// DefaultMaxRetiredPages is the retired pages a GPU may have.
	DefaultMaxRetiredPages = 60
)

// DefaultCriticalXIDs are the XIDs that fail CheckXID when the section
// names none.
var DefaultCriticalXIDs = []uint32{48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}

// xidFallenOffBus is "GPU has fallen off the bus".
const xidFallenOffBus = 79

// HealthConfig is the NodeSpec health section as the checks use it. The
// zero value is the defaults.
type HealthConfig struct {
	// MaxGPUTemperatureCelsius fails CheckThermal above it; zero: only HW
	// thermal slowdown does.
	MaxGPUTemperatureCelsius uint32
	// MaxUncorrectableECCErrors fails CheckECC above it (volatile count).
	MaxUncorrectableECCErrors uint32
	// MaxCorrectableECCErrors fails CheckECC above it; zero: no limit.
	MaxCorrectableECCErrors uint32
	// CriticalXIDs fail CheckXID; empty: DefaultCriticalXIDs.
	CriticalXIDs []uint32
	// MaxRetiredPages fails CheckRetiredPages above it; zero:
	// DefaultMaxRetiredPages.
	MaxRetiredPages uint32
	// DisabledChecks are not run (CheckFallenOffBus always is).
	DisabledChecks []string
}

// CheckSet is a set of health checks (a bit per entry of Checks).
type CheckSet uint8

// checkBit is name's bit, 0 for an unknown name.
func checkBit(name string) CheckSet {
	if i := slices.Index(Checks, name); i >= 0 {
		return 1 << i
	}
	return 0
}

var (
	bitXID          = checkBit(CheckXID)
	bitECC          = checkBit(CheckECC)
	bitRetiredPages = checkBit(CheckRetiredPages)
	bitThermal      = checkBit(CheckThermal)
	bitPower        = checkBit(CheckPower)
	bitPCIeLink     = checkBit(CheckPCIeLink)
	bitFallenOff    = checkBit(CheckFallenOffBus)
)

// ParseChecks is the set of the checks named (unknown names are ignored).
func ParseChecks(names []string) CheckSet {
	var s CheckSet
	for _, n := range names {
		s |= checkBit(n)
	}
	return s
}

// Has reports whether the set holds the check named name.
func (s CheckSet) Has(name string) bool { b := checkBit(name); return b != 0 && s&b != 0 }

// Names lists the set's checks in Checks order (nil when empty).
func (s CheckSet) Names() []string {
	if s == 0 {
		return nil
	}
	var out []string
	for i, n := range Checks {
		if s&(1<<i) != 0 {
			out = append(out, n)
		}
	}
	return out
}

// GPUHealth is one GPU's health after a pass of the checks.
type GPUHealth struct {
	// Index is the driver's index, UUID the GPU's UUID.
	Index int
	UUID  string
	// Failed are the checks the GPU failed; none: healthy.
	Failed CheckSet
	// Reason names each failed check with its numbers, e.g. "xid:
	// critical XID 79; fallen_off_bus: NVML reports the GPU lost".
	Reason string
	// TemperatureCelsius and UncorrectableECC are what the checks read
	// (zero when unreadable).
	TemperatureCelsius uint32
	UncorrectableECC   uint64
}

// Healthy reports whether every check passed.
func (g *GPUHealth) Healthy() bool { return g.Failed == 0 }

// rules is a HealthConfig prepared for the checks.
type rules struct {
	cfg      HealthConfig
	disabled CheckSet
	critical []uint32
	retired  uint32
}

func newRules(cfg HealthConfig) *rules {
	r := &rules{cfg: cfg, critical: slices.Clone(cfg.CriticalXIDs), retired: cfg.MaxRetiredPages}
	if len(r.critical) == 0 {
		r.critical = DefaultCriticalXIDs
	}
	if r.retired == 0 {
		r.retired = DefaultMaxRetiredPages
	}
	for _, n := range cfg.DisabledChecks {
		r.disabled |= checkBit(n)
	}
	r.disabled &^= bitFallenOff
	return r
}

func (r *rules) on(b CheckSet) bool { return r.disabled&b == 0 }

// SetHealthConfig sets the thresholds and checks every later pass uses
// (CheckHealth, GPUs, Report).
func (c *Collector) SetHealthConfig(cfg HealthConfig) { c.rules.Store(newRules(cfg)) }

// HealthConfig returns the settings in use.
func (c *Collector) HealthConfig() HealthConfig { return c.currentRules().cfg }

func (c *Collector) currentRules() *rules {
	if r := c.rules.Load(); r != nil {
		return r
	}
	return defaultRules
}

var defaultRules = newRules(HealthConfig{})

// devState is what the collector keeps of one GPU between passes: its
// handle and UUID (read once), the XIDs it raised since its last reset and
// its last identity.
type devState struct {
	d     nvml.Device
	uuid  string
	xids  []uint32
	ident *identity
	// xidEvents counts every XID event NVML delivered for the GPU since
	// the collector first read it (the telemetry's XID count).
	xidEvents uint64
}

// CheckHealth runs the checks on every GPU and returns their health in dst
// (reused: a pass over healthy GPUs allocates nothing). It returns an
// error only when NVML cannot be queried at all.
func (c *Collector) CheckHealth(ctx context.Context, dst []GPUHealth) ([]GPUHealth, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return dst[:0], errors.New("inventory: collector closed")
	}
	if err := c.prepare(); err != nil {
		return dst[:0], err
	}
	r := c.currentRules()
	dst = slices.Grow(dst[:0], len(c.devs))[:len(c.devs)]
	for i, st := range c.devs {
		if err := ctx.Err(); err != nil {
			return dst[:0], err
		}
		c.check(st, i, r, &dst[i])
	}
	return dst, nil
}

// ResetGPU forgets the critical XIDs the GPU raised (it was reset). It
// reports whether a GPU has that UUID.
func (c *Collector) ResetGPU(uuid string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, st := range c.devs {
		if st.uuid == uuid {
			st.xids = st.xids[:0]
			return true
		}
	}
	return false
}

// prepare refreshes the injected faults, reads the device handles once
// (after Open or Rescan) and drains the XID events. c.mu is held.
func (c *Collector) prepare() (err error) {
	defer func() {
		// go-nvml panics on some symbol lookups when the library is
		// half-loaded; turn that into an error.
		if r := recover(); r != nil {
			err = fmt.Errorf("inventory: nvml: %v", r)
		}
	}()
	c.faults.Refresh()
	if c.devs == nil {
		n, ret := c.lib.DeviceGetCount()
		if ret != nvml.SUCCESS {
			return fmt.Errorf("inventory: device count: %s", nvml.ErrorString(ret))
		}
		devs := make([]*devState, n)
		for i := range n {
			d, ret := c.lib.DeviceGetHandleByIndex(i)
			if ret != nvml.SUCCESS {
				return fmt.Errorf("inventory: gpu %d: handle: %s", i, nvml.ErrorString(ret))
			}
			uuid, ret := d.GetUUID()
			if ret != nvml.SUCCESS {
				return fmt.Errorf("inventory: gpu %d: uuid: %s", i, nvml.ErrorString(ret))
			}
			devs[i] = &devState{d: d, uuid: uuid, xids: c.carried[uuid]}
		}
		c.devs, c.carried = devs, nil
		c.eventReasons = eventReasonsSupported(c.lib)
	}
	c.drainXIDs()
	return nil
}

// eventReasonsSupported: drivers from 535 have
// nvmlDeviceGetCurrentClocksEventReasons; older ones only the throttle
// reasons it replaced.
func eventReasonsSupported(lib nvml.Interface) bool {
	v, ret := lib.SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		return false
	}
	major, _, _ := strings.Cut(v, ".")
	n, err := strconv.Atoi(major)
	return err == nil && n >= 535
}

// maxEventsPerPass bounds the XID events one pass reads; maxXIDsPerGPU the
// distinct XIDs kept per GPU until its reset.
const (
	maxEventsPerPass = 1024
	maxXIDsPerGPU    = 64
)

// drainXIDs creates the XID event set on first use and latches the
// critical XIDs waiting in it (EventSetWait with a zero timeout until it
// times out). A device that cannot register skips CheckXID. c.mu is held.
func (c *Collector) drainXIDs() {
	if c.events == nil && !c.eventsFailed {
		set, ret := c.lib.EventSetCreate()
		if ret != nvml.SUCCESS {
			c.eventsFailed = true
			c.log("XID events unavailable; the xid check is skipped", ret)
		} else {
			c.events = set
			for i, st := range c.devs {
				if ret := st.d.RegisterEvents(nvml.EventTypeXidCriticalError, set); ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_SUPPORTED {
					c.log(fmt.Sprintf("gpu %d: XID events unavailable; the xid check is skipped", i), ret)
				}
			}
		}
	}
	if c.faults != nil {
		// The mock: a latched XID no longer injected was mended.
		for i, st := range c.devs {
			if len(st.xids) > 0 {
				f := c.faults.Get(i)
				st.xids = slices.DeleteFunc(st.xids, func(x uint32) bool { return !slices.Contains(f.XIDs, x) })
			}
		}
	}
	if c.events == nil {
		return
	}
	for range maxEventsPerPass {
		ev, ret := c.events.Wait(0)
		if ret != nvml.SUCCESS {
			return // ERROR_TIMEOUT: drained
		}
		if ev.EventType&nvml.EventTypeXidCriticalError == 0 || ev.Device == nil {
			continue
		}
		// Every XID is kept (once): CheckXID picks the critical ones
		// with the settings of the pass, so a change of the set applies
		// to XIDs already read.
		xid := uint32(ev.EventData)
		for _, st := range c.devs {
			if st.d != ev.Device {
				continue
			}
			st.xidEvents++
			if !slices.Contains(st.xids, xid) && len(st.xids) < maxXIDsPerGPU {
				st.xids = append(st.xids, xid)
			}
			break
		}
	}
}

// log reports a degraded check once per cause.
func (c *Collector) log(msg string, ret nvml.Return) {
	if c.cfg.Logger != nil {
		c.cfg.Logger.Warn("inventory: "+msg, "nvml", nvml.ErrorString(ret))
	}
}

// skip reports whether ret means the query is not available here (the
// check is skipped).
func skip(ret nvml.Return) bool {
	return ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_FUNCTION_NOT_FOUND || ret == nvml.ERROR_NO_PERMISSION
}

// check runs the checks on one GPU into h. c.mu is held.
func (c *Collector) check(st *devState, index int, r *rules, h *GPUHealth) {
	*h = GPUHealth{Index: index, UUID: st.uuid}
	var buf [8]string
	reasons := buf[:0]
	lost := false
	fail := func(b CheckSet, reason string) {
		if b == bitFallenOff {
			if h.Failed&bitFallenOff != 0 {
				return
			}
		}
		h.Failed |= b
		reasons = append(reasons, reason)
	}
	// query handles a query's error: lost → fallen off; unavailable →
	// skipped; other → the check fails. It reports whether ret is SUCCESS.
	query := func(b CheckSet, what string, ret nvml.Return) bool {
		switch {
		case ret == nvml.SUCCESS:
			return true
		case ret == nvml.ERROR_GPU_IS_LOST:
			lost = true
		case skip(ret):
		default:
			if on := b &^ r.disabled; on != 0 {
				fail(on, Checks[bitIndex(on)]+": "+what+" query failed: "+nvml.ErrorString(ret))
			}
		}
		return false
	}
	d := st.d

	if r.on(bitXID) && len(st.xids) > 0 {
		crit := st.xids[:0:0]
		for _, x := range st.xids {
			if slices.Contains(r.critical, x) {
				crit = append(crit, x)
			}
		}
		if len(crit) > 0 {
			fail(bitXID, "xid: critical XID "+joinUints(crit))
		}
	}
	if slices.Contains(st.xids, xidFallenOffBus) {
		lost = true
	}

	if t, ret := d.GetTemperature(nvml.TEMPERATURE_GPU); query(bitThermal, "temperature", ret) {
		h.TemperatureCelsius = t
	}
	if e, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); query(bitECC, "ECC", ret) {
		h.UncorrectableECC = e
	}
	if !lost && r.on(bitECC) {
		if e := h.UncorrectableECC; e > uint64(r.cfg.MaxUncorrectableECCErrors) {
			fail(bitECC, fmt.Sprintf("ecc: %d volatile uncorrectable ECC errors (max %d)", e, r.cfg.MaxUncorrectableECCErrors))
		}
		if m := r.cfg.MaxCorrectableECCErrors; m > 0 {
			if e, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC); query(bitECC, "ECC", ret) && e > uint64(m) {
				fail(bitECC, fmt.Sprintf("ecc: %d volatile correctable ECC errors (max %d)", e, m))
			}
		}
	}

	if !lost && r.on(bitRetiredPages) {
		var pages int
		supported := false
		for _, cause := range []nvml.PageRetirementCause{nvml.PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, nvml.PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR} {
			if p, ret := d.GetRetiredPages(cause); query(bitRetiredPages, "retired pages", ret) {
				pages += len(p)
				supported = true
			}
		}
		if supported && pages > int(r.retired) {
			fail(bitRetiredPages, fmt.Sprintf("retired_pages: %d pages retired (max %d)", pages, r.retired))
		}
		if pending, ret := d.GetRetiredPagesPendingStatus(); query(bitRetiredPages, "retired pages", ret) && pending == nvml.FEATURE_ENABLED {
			fail(bitRetiredPages, "retired_pages: page retirement pending (reset required)")
		}
		if _, _, pending, failed, ret := d.GetRemappedRows(); query(bitRetiredPages, "remapped rows", ret) {
			switch {
			case failed:
				fail(bitRetiredPages, "retired_pages: row remapping failed")
			case pending:
				fail(bitRetiredPages, "retired_pages: row remapping pending (reset required)")
			}
		}
	}

	var reasonsMask uint64
	idle := false
	if !lost && (r.on(bitThermal) || r.on(bitPower) || r.on(bitPCIeLink)) {
		var ret nvml.Return
		if c.eventReasons {
			reasonsMask, ret = d.GetCurrentClocksEventReasons()
		} else {
			reasonsMask, ret = d.GetCurrentClocksThrottleReasons()
		}
		if !query(bitThermal|bitPower, "clock event reasons", ret) {
			reasonsMask = 0
		}
		idle = reasonsMask&nvml.ClocksThrottleReasonGpuIdle != 0
	}
	if !lost && r.on(bitThermal) {
		if reasonsMask&nvml.ClocksThrottleReasonHwThermalSlowdown != 0 {
			fail(bitThermal, fmt.Sprintf("thermal: HW thermal slowdown active at %d °C", h.TemperatureCelsius))
		}
		if m := r.cfg.MaxGPUTemperatureCelsius; m > 0 && h.TemperatureCelsius > m {
			fail(bitThermal, fmt.Sprintf("thermal: temperature %d °C above %d °C", h.TemperatureCelsius, m))
		}
	}
	if !lost && r.on(bitPower) && reasonsMask&nvml.ClocksThrottleReasonHwPowerBrakeSlowdown != 0 {
		fail(bitPower, "power: HW power-brake slowdown active")
	}

	if !lost && r.on(bitPCIeLink) {
		cw, ret1 := d.GetCurrPcieLinkWidth()
		mw, ret2 := d.GetMaxPcieLinkWidth()
		if query(bitPCIeLink, "PCIe link width", ret1) && query(bitPCIeLink, "PCIe link width", ret2) && cw < mw {
			fail(bitPCIeLink, fmt.Sprintf("pcie_link: link width x%d below x%d", cw, mw))
		}
		if !idle {
			cg, ret1 := d.GetCurrPcieLinkGeneration()
			mg, ret2 := d.GetMaxPcieLinkGeneration()
			if query(bitPCIeLink, "PCIe link generation", ret1) && query(bitPCIeLink, "PCIe link generation", ret2) && cg < mg {
				fail(bitPCIeLink, fmt.Sprintf("pcie_link: link generation %d below %d", cg, mg))
			}
		}
	}

	if lost {
		reason := "fallen_off_bus: NVML reports the GPU lost (ERROR_GPU_IS_LOST)"
		if slices.Contains(st.xids, xidFallenOffBus) {
			reason = "fallen_off_bus: XID 79, the GPU has fallen off the bus"
		}
		fail(bitFallenOff, reason)
	}
	if len(reasons) > 0 {
		h.Reason = strings.Join(reasons, "; ")
	}
}

func bitIndex(b CheckSet) int {
	for i := range Checks {
		if b&(1<<i) != 0 {
			return i
		}
	}
	return 0
}

func joinUints(xs []uint32) string {
	var b []byte
	for i, x := range xs {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = strconv.AppendUint(b, uint64(x), 10)
	}
	return string(b)
}

// ComputeProcesses returns the pids of the compute processes running on
// the GPU with this UUID. A GPU off the bus runs none. ok is false when no
// GPU has the UUID.
func (c *Collector) ComputeProcesses(_ context.Context, uuid string) (pids []uint32, ok bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, false, errors.New("inventory: collector closed")
	}
	if err := c.prepare(); err != nil {
		return nil, false, err
	}
	i := slices.IndexFunc(c.devs, func(st *devState) bool { return st.uuid == uuid })
	if i < 0 {
		return nil, false, nil
	}
	ps, ret := c.devs[i].d.GetComputeRunningProcesses()
	switch ret {
	case nvml.SUCCESS:
	case nvml.ERROR_GPU_IS_LOST:
		return nil, true, nil
	default:
		return nil, true, fmt.Errorf("inventory: gpu %d: compute processes: %s", i, nvml.ErrorString(ret))
	}
	for _, p := range ps {
		pids = append(pids, p.Pid)
	}
	return pids, true, nil
}

// ResetTimeout bounds one nvidia-smi --gpu-reset.
const ResetTimeout = 2 * time.Minute

// Reset resets the GPU with this UUID: on the mock it clears the GPU's
// injected faults (a GPU off the bus comes back); on real NVML it runs
// `nvidia-smi --gpu-reset -i <uuid>` under ctx (and ResetTimeout). Either
// way the XIDs the GPU raised are forgotten and the device handles read
// again on the next pass.
func (c *Collector) Reset(ctx context.Context, uuid string) error {
	c.mu.Lock()
	i := slices.IndexFunc(c.devs, func(st *devState) bool { return st.uuid == uuid })
	c.mu.Unlock()
	if c.faults != nil {
		if i < 0 {
			// Not read yet: find its index.
			if _, err := c.CheckHealth(ctx, nil); err != nil {
				return err
			}
			c.mu.Lock()
			i = slices.IndexFunc(c.devs, func(st *devState) bool { return st.uuid == uuid })
			c.mu.Unlock()
		}
		if i < 0 {
			return fmt.Errorf("inventory: no GPU %s", uuid)
		}
		if err := c.faults.Clear(i); err != nil {
			return fmt.Errorf("inventory: reset %s: %w", uuid, err)
		}
		// A reset GPU loses its MIG instances; a pending MIG mode applies.
		c.mu.Lock()
		if m, ok := c.lib.(*mockLib); ok {
			m.resetMIG(i)
		}
		c.mu.Unlock()
	} else {
		ctx, cancel := context.WithTimeout(ctx, ResetTimeout)
		defer cancel()
		out, err := exec.CommandContext(ctx, "nvidia-smi", "--gpu-reset", "-i", uuid).CombinedOutput()
		if err != nil {
			return fmt.Errorf("nvidia-smi --gpu-reset -i %s: %w: %s", uuid, err, strings.TrimSpace(string(out)))
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, st := range c.devs {
		if st.uuid == uuid {
			st.xids = st.xids[:0]
		}
	}
	if c.faults == nil && c.open {
		c.freeEvents() // the reset GPU's handle and event registration are new
	}
	delete(c.carried, uuid)
	return nil
}
