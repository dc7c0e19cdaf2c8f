package metal

import (
	"context"
	"fmt"
	"strings"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/machines"
)

func (p *pass) diagnose(ctx context.Context, _ time.Time) (string, error) {
	c, err := p.command(ctx, commands.KindDiagNVML, "diag", func() (any, error) { return &agentv1.DiagNvml{}, nil })
	if err != nil {
		return "", err
	}
	res, failure, err := p.verdict(ctx, c)
	if err != nil || failure != "" || res == nil {
		return failure, err
	}
	if bad := diagFailure(res.GetDiagNvml()); bad != "" {
		return bad, nil
	}
	return "", p.move(ctx, machines.StateWiping, machines.Change{},
		fmt.Sprintf("diagnosed (%s): %d GPUs and %d disks healthy", c.ID, len(res.GetDiagNvml().GetGpus()), len(res.GetDiagNvml().GetDisks())))
}

func diagFailure(d *agentv1.DiagNvmlResult) string {
	var bad []string
	for _, g := range d.GetGpus() {
		if !g.GetHealthy() {
			bad = append(bad, fmt.Sprintf("GPU %s: %s", g.GetUuid(), g.GetReason()))
		}
	}
	for _, k := range d.GetDisks() {
		if !k.GetHealthy() {
			bad = append(bad, fmt.Sprintf("disk %s: %s", k.GetPath(), k.GetReason()))
		}
	}
	if len(bad) > 0 {
		return "diag.nvml found faults: " + strings.Join(bad, "; ")
	}
	return ""
}

// disks returns the disks of the node's latest diag.nvml whose signature
// verifies, or nil.
// disksOr returns the machine's disks as its latest verified diag.nvml
// reported them; with none known yet it asks for them (one diag.nvml under
// the step's "disks" key) and returns no disks with the step's failure, if
// any: a diag.nvml that succeeded without a disk fails the step with
// noDisks.
func (p *pass) disksOr(ctx context.Context, noDisks string) ([]*agentv1.DiskCheck, string, error) {
	disks, err := p.disks(ctx)
	if err != nil || len(disks) > 0 {
		return disks, "", err
	}
	c, err := p.command(ctx, commands.KindDiagNVML, "disks", func() (any, error) { return &agentv1.DiagNvml{}, nil })
	if err != nil {
		return nil, "", err
	}
	_, failure, err := p.verdict(ctx, c)
	if failure == "" && err == nil && c != nil && c.State == commands.Succeeded {
		failure = noDisks
	}
	return nil, failure, err
}

func (p *pass) disks(ctx context.Context) ([]*agentv1.DiskCheck, error) {
	cs, err := commands.LatestSucceeded(ctx, p.tx, p.m.NodeID, commands.KindDiagNVML, 5)
	if err != nil {
		return nil, err
	}
	for i := range cs {
		res, failure, err := p.verdict(ctx, &cs[i])
		if err != nil {
			return nil, err
		}
		if failure == "" && res != nil && len(res.GetDiagNvml().GetDisks()) > 0 {
			return res.GetDiagNvml().GetDisks(), nil
		}
	}
	return nil, nil
}
