package site

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/retry"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// renewAt is when a certificate is due for renewal: when less than a third
// of its lifetime is left (as for nodes).
func renewAt(leaf *x509.Certificate) time.Time {
	return leaf.NotAfter.Add(-leaf.NotAfter.Sub(leaf.NotBefore) / 3)
}

// renewLoop renews the certificate whenever it is due (a third of its
// lifetime left), retrying failures with back-off, until ctx
// ends.
func (r *runner) renewLoop(ctx context.Context) {
	b := retry.Backoff{Min: r.cfg.MinBackoff, Max: r.cfg.MaxBackoff}
	for {
		_, cert, _ := r.current()
		if !retry.Sleep(ctx, time.Until(renewAt(cert.Leaf))) {
			return
		}
		err := r.renew(ctx)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			if _, fresh, _ := r.current(); time.Until(renewAt(fresh.Leaf)) > 0 {
				b.Reset()
				continue
			}
			err = errors.New("the renewed certificate is already due for renewal")
		}
		d := b.Next()
		r.log.WarnContext(ctx, "site certificate renewal failed", "err", err, "retry_in", d, "expires", cert.Leaf.NotAfter)
		if !retry.Sleep(ctx, d) {
			return
		}
	}
}

// renew asks NodeService.Renew for a certificate for the same key, checks
// that it is this agent's, stores it and switches new connections to it.
// The trust bundle pinned at enrollment is kept: whoever answers Renew
// cannot change whom the agent trusts.
func (r *runner) renew(ctx context.Context) error {
	csr, err := r.cfg.State.CSR()
	if err != nil {
		return err
	}
	conn, err := r.dial()
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := agentv1.NewNodeServiceClient(conn).Renew(cctx, &agentv1.RenewRequest{Csr: csr})
	if err != nil {
		return fmt.Errorf("site: renew: %w", err)
	}
	old, _, _ := r.current()
	stored := state.Identity{NodeID: old.AgentID, Chain: resp.GetCertificateChain(), Bundle: old.Stored.Bundle}
	if len(stored.Chain) == 0 {
		return errors.New("site: renew: no certificate in the answer")
	}
	id, err := identityOf(stored, r.key)
	if err != nil {
		return fmt.Errorf("site: renew: %w", err)
	}
	if id.SiteID != old.SiteID || id.TrustDomain != old.TrustDomain {
		return fmt.Errorf("site: renew: the certificate is for site %s of %s, not %s of %s", id.SiteID, id.TrustDomain, old.SiteID, old.TrustDomain)
	}
	if err := r.cfg.State.SaveIdentity(stored); err != nil {
		return err
	}
	return r.setIdentity(id)
}
