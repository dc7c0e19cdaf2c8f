package metal

import (
	"context"
	"errors"
	"fmt"

	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

func (p *pass) inspect(ctx context.Context, ts []sitetasks.Task) (string, error) {
	t := latest(ts, sitetasks.KindBMCInspect)
	if t == nil {
		return p.bmcTask(ctx, sitetasks.KindBMCInspect, sitetasks.Payload{}, p.notAfter())
	}
	done, failure := taskVerdict(t)
	if !done {
		return failure, nil
	}
	if t.Result == nil || t.Result.Inventory == nil {
		return "bmc.inspect returned no inventory", nil
	}
	inv := t.Result.Inventory
	var macs []string
	for _, n := range inv.NICs {
		if n.MAC != "" && len(macs) < machines.MaxMACs {
			macs = append(macs, n.MAC)
		}
	}
	if len(macs) == 0 {
		return "bmc.inspect found no NIC with a MAC address: the machine cannot PXE-boot", nil
	}
	b, err := jsonMarshal(inv)
	if err != nil {
		return "", err
	}
	m, err := machines.SetInventory(ctx, p.tx, p.m.ID, p.m.State, b, macs)
	if errors.Is(err, machines.ErrMACTaken) {
		// Another record of the same hardware, or a spoofed inventory:
		// not a thing a new attempt fixes.
		return "", p.fail(ctx, "bmc.inspect: "+err.Error()+": is this server enrolled twice?")
	}
	if err != nil {
		return "", err
	}
	p.m = m
	return "", p.move(ctx, machines.StateBootingRamdisk, machines.Change{},
		fmt.Sprintf("inspected: %s %s, %d NICs, %d disks", inv.Manufacturer, inv.Model, len(inv.NICs), len(inv.Disks)))
}
