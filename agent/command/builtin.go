package command

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// diagNvml checks every GPU asked for through NVML (and, at a level above
// quick, DCGM's diagnostics: commandkinds.DiagRunLevel) and, on a daemon
// with a Ramdisk (burn-in), every disk of its inventory; it fails, with the
// result attached, when any GPU or disk is unhealthy, and when the level's
// DCGM run could not run (DCGM not installed) or gave no readable result.
func (e *Executor) diagNvml(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetDiagNvml()
	runLevel, ok := commandkinds.DiagRunLevel(p.GetLevel())
	if !ok {
		return nil, fmt.Errorf("unknown diag level %q (%s)", p.GetLevel(), strings.Join(commandkinds.DiagLevels, ", "))
	}
	d, ok := e.cfg.Inventory.(interface {
		DiagnoseAt(ctx context.Context, uuids []string, runLevel int) (*agentv1.DiagNvmlResult, error)
	})
	if !ok && e.cfg.Ramdisk == nil {
		return nil, errors.New("NVML diagnostics are not available on this daemon")
	}
	res := &agentv1.DiagNvmlResult{}
	if ok {
		var err error
		if res, err = d.DiagnoseAt(ctx, p.GetGpuUuids(), runLevel); err != nil {
			return nil, err
		}
	}
	res.Level = cmp.Or(p.GetLevel(), commandkinds.DiagLevelQuick)
	out := &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiagNvml{DiagNvml: res}}
	var bad []string
	for _, g := range res.GetGpus() {
		if !g.GetHealthy() {
			bad = append(bad, fmt.Sprintf("gpu %d (%s): %s", g.GetIndex(), g.GetUuid(), g.GetReason()))
		}
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("%d of %d GPUs unhealthy: %s", len(bad), len(res.GetGpus()), strings.Join(bad, "; "))
	}
	if dc := res.GetDcgm(); dc != nil && dc.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_PASSED {
		// NOT_INSTALLED and ERROR: the level asked for did not run; a
		// failure on no single GPU (a deployment check).
		return out, fmt.Errorf("diag level %s: %s", res.GetLevel(), dc.GetReason())
	}
	if e.cfg.Ramdisk != nil {
		disks, err := e.cfg.Ramdisk.CheckDisks(ctx)
		res.Disks = disks
		if err != nil {
			return out, fmt.Errorf("disk burn-in: %w", err)
		}
		for _, c := range disks {
			if !c.GetHealthy() {
				bad = append(bad, fmt.Sprintf("%s: %s", c.GetPath(), c.GetReason()))
			}
		}
		if len(bad) > 0 {
			return out, fmt.Errorf("%d of %d disks unhealthy: %s", len(bad), len(disks), strings.Join(bad, "; "))
		}
	}
	return out, nil
}

// Ramdisk runs the commissioning kinds on a machine booted into bcd
// ramdisk (an *ramdisk.Ramdisk). Each method must return once ctx ends.
type Ramdisk interface {
	// WipeDisks runs disk.wipe; a result returned with an error says what
	// was wiped before it.
	WipeDisks(ctx context.Context, p *agentv1.DiskWipe) (*agentv1.DiskWipeResult, error)
	// DeployImage runs image.deploy, failing unless the SHA-256 of what it
	// wrote is the payload's.
	DeployImage(ctx context.Context, p *agentv1.ImageDeploy) (*agentv1.ImageDeployResult, error)
	// LoadKexec fetches, checks and loads node.kexec's kernel and initrd;
	// ExecKexec then boots into them (it returns only on failure, or, with
	// a test hook, once the call is recorded).
	LoadKexec(ctx context.Context, p *agentv1.NodeKexec) error
	ExecKexec(ctx context.Context) error
	// CheckDisks is the burn-in check of every disk of the inventory,
	// added to diag.nvml's result.
	CheckDisks(ctx context.Context) ([]*agentv1.DiskCheck, error)
}

// diskWipe wipes disks through the Ramdisk; the result (signed, with a
// ResultKey) lists every disk wiped, also when a later one failed.
func (e *Executor) diskWipe(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetDiskWipe()
	e.log.Warn("wiping disks", "disks", p.GetDisks(), "method", p.GetMethod().String(), "reason", p.GetReason())
	res, err := e.cfg.Ramdisk.WipeDisks(ctx, p)
	if res == nil {
		if err != nil {
			return nil, err
		}
		res = &agentv1.DiskWipeResult{}
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiskWipe{DiskWipe: res}}, err
}

// imageDeploy streams an image onto a disk through the Ramdisk.
func (e *Executor) imageDeploy(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetImageDeploy()
	e.log.Warn("deploying an image", "disk", p.GetDisk(), "url", p.GetUrl(), "sha256", p.GetSha256())
	res, err := e.cfg.Ramdisk.DeployImage(ctx, p)
	if res == nil {
		return nil, err
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_ImageDeploy{ImageDeploy: res}}, err
}

// inventoryRefresh re-collects the sections (rescanning first when asked)
// and hands the report to OnInventory.
func (e *Executor) inventoryRefresh(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetInventoryRefresh()
	if e.cfg.Inventory == nil {
		return nil, errors.New("inventory is not available on this daemon")
	}
	if p.GetRescan() {
		r, ok := e.cfg.Inventory.(interface {
			Rescan(ctx context.Context) error
		})
		if !ok {
			return nil, errors.New("rescan is not available on this daemon")
		}
		if err := r.Rescan(ctx); err != nil {
			return nil, err
		}
	}
	rep, err := e.cfg.Inventory.Report(ctx, p.GetSections())
	if err != nil {
		return nil, err
	}
	if e.cfg.OnInventory != nil {
		e.cfg.OnInventory(rep)
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_InventoryRefresh{InventoryRefresh: &agentv1.InventoryRefreshResult{
		Sections: rep.GetSections(), GpuCount: uint32(len(rep.GetGpus())),
	}}}, nil
}

// since drops the lines logged before cutoff: lines that start with
// slog's "time=<RFC 3339>"; lines without a time go with the line before.
// older reports whether a line before cutoff was dropped.
func since(data []byte, cutoff time.Time) (out []byte, older bool) {
	keep := false
	for line := range bytes.Lines(data) {
		if rest, ok := bytes.CutPrefix(line, []byte("time=")); ok {
			ts, _, _ := bytes.Cut(rest, []byte(" "))
			if t, err := time.Parse(time.RFC3339Nano, string(ts)); err == nil {
				keep = !t.Before(cutoff)
				older = older || !keep
			}
		}
		if keep {
			out = append(out, line...)
		}
	}
	return out, older
}

// Resetter resets one GPU (gpu.reset): *inventory.Collector runs
// nvidia-smi --gpu-reset on real NVML and clears the injected faults on
// the mock. It must return once ctx ends.
type Resetter interface {
	Reset(ctx context.Context, uuid string) error
}

// GPUInventory is what gpu.reset reads of the inventory (an
// *inventory.Collector): the compute processes on a GPU (ok false: no
// such GPU) and the GPUs' health checked again.
type GPUInventory interface {
	ComputeProcesses(ctx context.Context, uuid string) (pids []uint32, ok bool, err error)
	Check(ctx context.Context, uuids []string) ([]*agentv1.GpuCheck, error)
}

// gpuReset resets the GPUs asked for, in order, after checking that none
// runs compute processes (unless force), checks them again and hands a
// fresh GPU inventory to OnInventory. It fails, with the result attached,
// when a GPU is still unhealthy after its reset.
func (e *Executor) gpuReset(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetGpuReset()
	uuids := p.GetGpuUuids()
	switch {
	case len(uuids) == 0:
		return nil, errors.New("gpu_uuids: at least one GPU")
	case len(uuids) > commandkinds.MaxResetGPUs:
		return nil, fmt.Errorf("gpu_uuids: %d GPUs, at most %d", len(uuids), commandkinds.MaxResetGPUs)
	case len([]rune(p.GetReason())) > commandkinds.MaxResetReason:
		return nil, fmt.Errorf("reason: at most %d characters", commandkinds.MaxResetReason)
	}
	for i, u := range uuids {
		if slices.Contains(uuids[:i], u) {
			return nil, fmt.Errorf("gpu_uuids: %s named twice", u)
		}
	}
	inv, _ := e.cfg.Inventory.(GPUInventory)
	var busy []string
	for _, u := range uuids {
		pids, ok, err := inv.ComputeProcesses(ctx, u)
		switch {
		case !ok && err == nil:
			return nil, fmt.Errorf("no GPU %s on this node", u)
		case err != nil && !p.GetForce():
			return nil, fmt.Errorf("cannot tell whether GPU %s runs compute processes (%v); set force to reset it anyway", u, err)
		case len(pids) > 0:
			busy = append(busy, fmt.Sprintf("%s (%d: pids %s)", u, len(pids), joinPIDs(pids)))
		}
	}
	if len(busy) > 0 && !p.GetForce() {
		return nil, fmt.Errorf("refusing to reset: compute processes are running on GPU %s; set force to reset anyway (they die)", strings.Join(busy, ", "))
	}
	e.log.Warn("resetting GPUs", "gpus", uuids, "force", p.GetForce(), "reason", p.GetReason(), "busy", busy)
	res := &agentv1.GpuResetResult{}
	out := &agentv1.CommandResult{Kind: &agentv1.CommandResult_GpuReset{GpuReset: res}}
	for _, u := range uuids {
		if err := e.cfg.Resetter.Reset(ctx, u); err != nil {
			return out, fmt.Errorf("reset %s: %w", u, err)
		}
		res.ResetUuids = append(res.ResetUuids, u)
	}
	checks, err := inv.Check(ctx, uuids)
	if err != nil {
		return out, fmt.Errorf("checking the GPUs after the reset: %w", err)
	}
	res.Gpus = checks
	if e.cfg.OnInventory != nil {
		if rep, err := e.cfg.Inventory.Report(ctx, []string{"gpus"}); err == nil {
			e.cfg.OnInventory(rep)
		} else {
			e.log.Error("inventory after gpu.reset", "err", err)
		}
	}
	var bad []string
	for _, g := range checks {
		if !g.GetHealthy() {
			bad = append(bad, fmt.Sprintf("%s: %s", g.GetUuid(), g.GetReason()))
		}
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("reset, but still unhealthy: %s", strings.Join(bad, "; "))
	}
	return out, nil
}

func joinPIDs(pids []uint32) string {
	s := make([]string, len(pids))
	for i, p := range pids {
		s[i] = fmt.Sprint(p)
	}
	return strings.Join(s, ", ")
}

// instanceReboot restarts the instance the payload names through
// Config.Instances: an instance the host does not run, or one that is not
// running, fails the command with the runtime's reason.
func (e *Executor) instanceReboot(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	id := body.GetInstanceReboot().GetInstanceId()
	if id == "" {
		return nil, errors.New("instance.reboot: no instance id")
	}
	if err := e.cfg.Instances.Reboot(ctx, id); err != nil {
		return nil, err
	}
	e.log.InfoContext(ctx, "rebooted instance", "instance", id)
	return &agentv1.CommandResult{}, nil
}

// agentUpgrade stages the build agent.upgrade's signed release manifest
// names (Config.Upgrade) and keeps the handover for after the outcome is
// sent: the command succeeds once the build is staged; the node's next
// Hello, or its agent section's UpgradeFailed, says how its trial went.
func (e *Executor) agentUpgrade(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	h, err := e.cfg.Upgrade(ctx, body.GetAgentUpgrade())
	if err != nil {
		return nil, fmt.Errorf("agent.upgrade: %w", err)
	}
	e.mu.Lock()
	e.handover = h
	e.mu.Unlock()
	e.log.InfoContext(ctx, "agent.upgrade: build staged; handing over once the outcome is sent", "reason", body.GetAgentUpgrade().GetReason())
	return &agentv1.CommandResult{}, nil
}
