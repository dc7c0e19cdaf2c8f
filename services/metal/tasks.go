package metal

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// tasksSince returns the machine's tasks created at or after start, newest
// first.
func (p *pass) tasksSince(ctx context.Context, start time.Time) ([]sitetasks.Task, error) {
	all, err := sitetasks.ListByMachine(ctx, p.tx, p.m.ID)
	if err != nil {
		return nil, err
	}
	var out []sitetasks.Task
	for _, t := range all {
		if !t.CreatedAt.Before(start) {
			out = append(out, t)
		}
	}
	return out, nil
}

func latest(ts []sitetasks.Task, kind string) *sitetasks.Task {
	for i := range ts {
		if ts[i].Kind == kind {
			return &ts[i]
		}
	}
	return nil
}

// taskVerdict: done, failure ("" unless it failed).
func taskVerdict(t *sitetasks.Task) (bool, string) {
	switch t.State {
	case sitetasks.Succeeded:
		return true, ""
	case sitetasks.Failed, sitetasks.Expired:
		return false, fmt.Sprintf("%s (%s) %s: %s", t.Kind, t.ID, t.State, t.Error)
	}
	return false, ""
}

// waiting reports err as "wait" when no site agent holds the boot lease.
func waiting(err error) bool { return fault.CodeOf(err) == fault.Unavailable }

// enqueueTask seals plain (when set) to the site's key and queues task
// kind with payload; with no lease holder it does nothing (the attempt
// waits).
func (p *pass) enqueueTask(ctx context.Context, kind string, payload sitetasks.Payload, plain []byte, notAfter time.Time) error {
	id := sitetasks.NewID()
	var sealed string
	if plain != nil {
		k, err := sitetasks.SealKey(ctx, p.tx, p.m.SiteID)
		if waiting(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if sealed, err = credseal.Seal(k.JWK, plain, credseal.TaskAAD(id, p.m.ID)...); err != nil {
			return fmt.Errorf("seal %s for %s: %w", kind, p.m.ID, err)
		}
	}
	if _, err := sitetasks.Enqueue(ctx, p.tx, sitetasks.Task{ID: id, TenantID: p.m.TenantID, SiteID: p.m.SiteID, MachineID: p.m.ID,
		Kind: kind, Payload: payload, Sealed: sealed, NotAfter: notAfter}); err != nil {
		return fmt.Errorf("queue %s for %s: %w", kind, p.m.ID, err)
	}
	p.q.WakeSiteTasks(p.m.SiteID)
	return nil
}

// bmcTask queues a bmc.* task with the machine's credentials.
func (p *pass) bmcTask(ctx context.Context, kind string, payload sitetasks.Payload, notAfter time.Time) (string, error) {
	// A BMC's credentials go to the BMC they were created for only.
	if meta, err := secrets.Get(ctx, p.tx, p.m.TenantID, p.m.BMCCredentialsRef); err == nil && meta.BoundTo != "" && meta.BoundTo != p.m.BMCAddress {
		return fmt.Sprintf("the BMC's credentials (%s) are bound to another BMC address than %s: they are not sent", meta.ID, p.m.BMCAddress), nil
	}
	plain, err := secrets.Open(ctx, p.tx, p.w.cfg.Keyring, p.m.TenantID, p.m.BMCCredentialsRef)
	if err != nil {
		if fault.CodeOf(err) == fault.Unsupported || fault.CodeOf(err) == fault.NotFound || errors.Is(err, secrets.ErrTampered) ||
			errors.Is(err, secrets.ErrUnknownKey) {
			return "the BMC's credentials: " + err.Error(), nil
		}
		return "", err
	}
	defer clear(plain)
	if _, err := secrets.ParseBMC(plain); err != nil {
		return err.Error(), nil
	}
	payload.BMC = &sitetasks.BMC{Address: p.m.BMCAddress, CAPEM: p.m.BMCCAPEM, CertificateSHA256: p.m.BMCCertificateSHA256,
		Insecure: p.m.BMCInsecure, TrustOnFirstUse: p.m.TrustOnFirstUse()}
	return "", p.enqueueTask(ctx, kind, payload, plain, notAfter)
}

// isBMC says kind is a bmc.* task.
func isBMC(kind string) bool {
	return kind == sitetasks.KindBMCInspect || kind == sitetasks.KindBMCPower || kind == sitetasks.KindBMCBoot
}

// checkCertificate looks at the certificates the BMC presented to the
// attempt's tasks (ts, newest first): trusting on first use, it pins the
// oldest; with a certificate pinned, one that differs fails the machine at
// once (true), whatever the task's outcome: a changed certificate is not
// retried.
func (p *pass) checkCertificate(ctx context.Context, ts []sitetasks.Task) (bool, error) {
	if p.m.BMCInsecure || (p.m.BMCCAPEM != "" && p.m.BMCCertificateSHA256 == "") {
		return false, nil
	}
	for i := len(ts) - 1; i >= 0; i-- {
		t := ts[i]
		if !isBMC(t.Kind) || t.Result == nil || t.Result.BMCCertificateSHA256 == "" {
			continue
		}
		seen := t.Result.BMCCertificateSHA256
		if p.m.BMCCertificateSHA256 == "" {
			m, pinned, err := machines.PinCertificate(ctx, p.tx, p.m.ID, seen)
			if err != nil {
				return false, err
			}
			p.m = m
			if pinned {
				p.w.cfg.Logger.Info("metal: BMC certificate pinned on first use", "machine", m.ID, "bmc", m.BMCAddress,
					"sha256", seen, "task", t.ID)
			}
			continue
		}
		if seen != p.m.BMCCertificateSHA256 {
			return true, p.fail(ctx, fmt.Sprintf("the BMC's certificate changed: %s (%s) saw sha256 %s, pinned %s; "+
				"if it was replaced on purpose, delete the machine and enroll it again with bmc.certificateSha256 or bmc.caPem",
				t.Kind, t.ID, seen, p.m.BMCCertificateSHA256))
		}
	}
	return false, nil
}

// reseal seals again the machine's tasks that wait for the holder's new key.
func (p *pass) reseal(ctx context.Context) error {
	ts, err := sitetasks.NeedingReseal(ctx, p.tx, p.m.SiteID)
	if err != nil {
		return err
	}
	for _, t := range ts {
		if t.MachineID != p.m.ID {
			continue
		}
		k, err := sitetasks.SealKey(ctx, p.tx, p.m.SiteID)
		if waiting(err) {
			return nil
		}
		if err != nil {
			return err
		}
		var plain []byte
		switch t.Kind {
		case sitetasks.KindPXEArm:
			// A boot token cannot be read back: expire the task's token by
			// failing the attempt's wait (the step's deadline) — mint anew.
			tok, err := p.ramdiskToken(ctx)
			if err != nil {
				return err
			}
			plain = []byte(tok)
		default:
			if plain, err = secrets.Open(ctx, p.tx, p.w.cfg.Keyring, p.m.TenantID, p.m.BMCCredentialsRef); err != nil {
				return err
			}
		}
		sealed, err := credseal.Seal(k.JWK, plain, credseal.TaskAAD(t.ID, p.m.ID)...)
		clear(plain)
		if err != nil {
			return err
		}
		if _, err := sitetasks.Reseal(ctx, p.tx, t.ID, sealed); err != nil {
			return err
		}
		p.q.WakeSiteTasks(p.m.SiteID)
	}
	return nil
}

// powerAction is cycle for a machine that is on, on otherwise.
func (p *pass) powerAction(ts []sitetasks.Task) string {
	state := ""
	if t := latest(ts, sitetasks.KindBMCBoot); t != nil && t.Result != nil {
		state = t.Result.PowerState
	}
	if strings.EqualFold(state, "On") {
		return "cycle"
	}
	return "on"
}

// sequence runs the site tasks of a boot one after another: each is
// queued once the one before it succeeded. It returns true once all did.
func (p *pass) sequence(ctx context.Context, ts []sitetasks.Task, steps []seqStep) (bool, string, error) {
	for _, s := range steps {
		t := latest(ts, s.kind)
		if t == nil {
			failure, err := s.queue(ctx)
			return false, failure, err
		}
		done, failure := taskVerdict(t)
		if !done {
			return false, failure, nil
		}
	}
	return true, "", nil
}

type seqStep struct {
	kind  string
	queue func(ctx context.Context) (string, error)
}
