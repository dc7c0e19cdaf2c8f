package metal

import (
	"context"
	"fmt"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

func wipeMethod(s string) agentv1.WipeMethod {
	switch s {
	case "discard":
		return agentv1.WipeMethod_WIPE_METHOD_DISCARD
	case "secure-erase":
		return agentv1.WipeMethod_WIPE_METHOD_SECURE_ERASE
	}
	return agentv1.WipeMethod_WIPE_METHOD_ZERO
}

func (p *pass) wipe(ctx context.Context, ts []sitetasks.Task, start time.Time) (string, error) {
	disks, failure, err := p.disksOr(ctx, "diag.nvml reported no disks to wipe")
	if err != nil || len(disks) == 0 {
		return failure, err
	}
	paths := make([]string, len(disks))
	for i, d := range disks {
		paths[i] = d.GetPath()
	}
	method := wipeMethod(p.w.cfg.Metal.WipeMethod)
	c, err := p.command(ctx, commands.KindDiskWipe, "wipe", func() (any, error) {
		return &agentv1.DiskWipe{Disks: paths, Method: method, Reason: fmt.Sprintf("metal %s of %s", p.m.Purpose, p.m.ID)}, nil
	})
	if err != nil {
		return "", err
	}
	res, failure, err := p.verdict(ctx, c)
	if err != nil || failure != "" || res == nil {
		return failure, err
	}
	wiped := map[string]bool{}
	for _, d := range res.GetDiskWipe().GetDisks() {
		if d.GetVerified() {
			wiped[d.GetPath()] = true
		}
	}
	for _, path := range paths {
		if !wiped[path] {
			return fmt.Sprintf("disk.wipe (%s) did not report %s wiped and verified", c.ID, path), nil
		}
	}
	// Ready: the boot server forgets it and it powers off (fire and forget:
	// a lost pxe.disarm or power-off does not unmake the wipe).
	notAfter := p.now.Add(10 * time.Minute)
	if err := p.enqueueTask(ctx, sitetasks.KindPXEDisarm, sitetasks.Payload{MACs: p.m.MACs}, nil, notAfter); err != nil {
		return "", err
	}
	if failure, err := p.bmcTask(ctx, sitetasks.KindBMCPower, sitetasks.Payload{PowerAction: "off"}, notAfter); err != nil || failure != "" {
		p.w.cfg.Logger.Warn("metal: could not power off a ready machine", "machine", p.m.ID, "reason", failure, "error", err)
		if err != nil {
			return "", err
		}
	}
	_ = ts
	_ = start
	return "", p.move(ctx, machines.StateReady, machines.Change{Boot: machines.BootNone},
		fmt.Sprintf("wiped %d disks (%s, %s), verified", len(paths), p.w.cfg.Metal.WipeMethod, c.ID))
}
