package metal

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
)

// commandKey is the idempotency key of the attempt's command (what names
// one command of the attempt).
func (p *pass) commandKey(what string) string {
	return fmt.Sprintf("metal:%s:%s:%d:%d:%s", p.m.ID, p.m.State, p.m.StepStartedAt.UnixMicro(), p.m.StepAttempts, what)
}

// command returns the attempt's command named what, queueing it with
// payload when there is none yet (payload called then).
func (p *pass) command(ctx context.Context, kind, what string, payload func() (any, error)) (*commands.Command, error) {
	key := p.commandKey(what)
	c, err := commands.ByIdempotencyKey(ctx, p.tx, p.m.NodeID, key)
	if err == nil {
		if p.w.cfg.TamperResult != nil {
			p.w.cfg.TamperResult(&c)
		}
		return &c, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return nil, err
	}
	pl, err := payload()
	if err != nil {
		return nil, err
	}
	_, created, err := p.w.cfg.Kinds.Enqueue(ctx, p.tx, commands.Request{NodeID: p.m.NodeID, Kind: kind, Payload: pl,
		IdempotencyKey: key, NotAfter: p.notAfter(), OwnerKind: Kind, OwnerKey: p.m.ID, CreatedBy: "metal", System: true})
	if err != nil {
		return nil, fmt.Errorf("queue %s for %s: %w", kind, p.m.ID, err)
	}
	if created {
		p.q.WakeCommands(p.m.NodeID)
	}
	return nil, nil
}

// verdict checks a finished command: its outcome and its node signature.
func (p *pass) verdict(ctx context.Context, c *commands.Command) (*agentv1.CommandResult, string, error) {
	if c == nil || !c.State.Final() {
		return nil, "", nil
	}
	if c.State != commands.Succeeded {
		return nil, fmt.Sprintf("%s (%s) %s: %s", c.Kind, c.ID, c.State, c.Reason), nil
	}
	if err := commands.VerifyNodeSignature(ctx, p.tx, *c, p.w.cfg.TrustDomain); err != nil {
		if errors.Is(err, errBadSignature()) {
			return nil, fmt.Sprintf("%s (%s): result refused, its node signature does not verify: %v", c.Kind, c.ID, err), nil
		}
		return nil, "", err
	}
	res := &agentv1.CommandResult{}
	if len(c.Result) > 0 {
		if err := protoUnmarshal(c.Result, res); err != nil {
			return nil, fmt.Sprintf("%s (%s): result does not decode: %v", c.Kind, c.ID, err), nil
		}
	}
	return res, "", nil
}
