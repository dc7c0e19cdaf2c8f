package metal

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// ramdiskToken mints the machine's one-time ramdisk boot token and records
// it on the machine.
func (p *pass) ramdiskToken(ctx context.Context) (string, error) {
	return p.token(ctx, jointoken.RoleRamdisk, RamdiskTokenTTL, machines.BootRamdisk)
}

func (p *pass) token(ctx context.Context, role string, ttl time.Duration, boot machines.Boot) (string, error) {
	s := jointoken.Mint()
	exp := p.now.Add(ttl)
	if _, err := jointoken.Create(ctx, p.tx, jointoken.Token{ID: s.ID, TenantID: p.m.TenantID, PoolID: p.m.PoolID,
		Name: "metal " + p.m.Name, Uses: 1, NodeID: p.m.NodeID, Role: role, ExpiresAt: &exp, CreatedBy: "metal"}, s.Hash); err != nil {
		return "", fmt.Errorf("mint the %s token of %s: %w", role, p.m.ID, err)
	}
	m, err := machines.SetBoot(ctx, p.tx, p.m.ID, p.m.State, boot, s.ID)
	if err != nil {
		return "", err
	}
	p.m = m
	return s.Token, nil
}

func (p *pass) ramdiskImages() (*sitetasks.Image, *sitetasks.Image) {
	r := p.w.cfg.Metal.Ramdisk
	or := func(a, b string) string {
		if a != "" {
			return a
		}
		return b
	}
	return &sitetasks.Image{URL: or(r.KernelURL, DefaultKernelURL), SHA256: or(r.KernelSHA256, DefaultImageSHA256)},
		&sitetasks.Image{URL: or(r.InitrdURL, DefaultInitrdURL), SHA256: or(r.InitrdSHA256, DefaultImageSHA256)}
}

// bootRamdisk boots the machine into bcd ramdisk; true once its ramdisk
// holds a session opened since start.
func (p *pass) bootRamdisk(ctx context.Context, ts []sitetasks.Task, start time.Time) (bool, string, error) {
	kernel, initrd := p.ramdiskImages()
	done, failure, err := p.sequence(ctx, ts, []seqStep{
		{sitetasks.KindPXEArm, func(ctx context.Context) (string, error) {
			if _, err := sitetasks.SealKey(ctx, p.tx, p.m.SiteID); waiting(err) {
				return "", nil
			}
			tok, err := p.ramdiskToken(ctx)
			if err != nil {
				return "", err
			}
			return "", p.enqueueTask(ctx, sitetasks.KindPXEArm, sitetasks.Payload{MACs: p.m.MACs, Decision: "ramdisk",
				Kernel: kernel, Initrd: initrd}, []byte(tok), p.notAfter())
		}},
		{sitetasks.KindBMCBoot, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCBoot, sitetasks.Payload{BootTarget: "pxe"}, p.notAfter())
		}},
		{sitetasks.KindBMCPower, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCPower, sitetasks.Payload{PowerAction: p.powerAction(ts)}, p.notAfter())
		}},
	})
	if err != nil || !done {
		return false, failure, err
	}
	return p.sessionSince(ctx, start, nodes.StateCommissioning)
}

// sessionSince reports whether the machine's node is in one of states with
// a session seen since start.
func (p *pass) sessionSince(ctx context.Context, start time.Time, states ...string) (bool, string, error) {
	n, err := nodes.Get(ctx, p.tx, p.m.TenantID, p.m.NodeID)
	if fault.CodeOf(err) == fault.NotFound {
		return false, "", nil
	}
	if err != nil {
		return false, "", err
	}
	ok := slices.Contains(states, n.State) && n.GatewayID != "" && n.LastSeenAt != nil && !n.LastSeenAt.Before(start)
	return ok, "", nil
}
