package session

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/retry"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// RenewAt is when a certificate is due for renewal: when less than a third
// of its lifetime (NotBefore to NotAfter) is left.
func RenewAt(leaf *x509.Certificate) time.Time {
	return leaf.NotAfter.Add(-leaf.NotAfter.Sub(leaf.NotBefore) / 3)
}

// renewLoop renews the certificate whenever it is due, retrying failures
// with back-off, until ctx ends. It runs independently of sessions, so a
// renewal is neither lost nor repeated across reconnects.
func (r *runner) renewLoop(ctx context.Context) {
	b := retry.Backoff{Min: r.cfg.MinBackoff, Max: r.cfg.MaxBackoff}
	for {
		_, cert, _ := r.current()
		if !retry.Sleep(ctx, time.Until(RenewAt(cert.Leaf))) {
			return
		}
		err := r.renew(ctx)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			_, fresh, _ := r.current()
			if time.Until(RenewAt(fresh.Leaf)) > 0 {
				b.Reset()
				continue
			}
			// A certificate due at once would make us ask again and again.
			d := b.Next()
			r.log.WarnContext(ctx, "renewed certificate is already due for renewal", "expires", fresh.Leaf.NotAfter, "retry_in", d)
			if !retry.Sleep(ctx, d) {
				return
			}
			continue
		}
		d := b.Next()
		if time.Now().After(cert.Leaf.NotAfter) {
			r.log.ErrorContext(ctx, "node certificate expired; renewal needs a valid one, run bcd join again", "err", err, "retry_in", d)
		} else {
			r.log.WarnContext(ctx, "certificate renewal failed", "err", err, "retry_in", d, "expires", cert.Leaf.NotAfter)
		}
		if !retry.Sleep(ctx, d) {
			return
		}
	}
}

// renew asks NodeService.Renew for a certificate for the same key, checks
// it, stores it and switches new connections to it.
func (r *runner) renew(ctx context.Context) error {
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, r.key)
	if err != nil {
		return fmt.Errorf("session: csr: %w", err)
	}
	conn, err := r.dial(r.target())
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := agentv1.NewNodeServiceClient(conn).Renew(cctx, &agentv1.RenewRequest{Csr: csr})
	if err != nil {
		return fmt.Errorf("session: renew: %w", err)
	}
	old, _, _ := r.current()
	bundle, err := pinnedBundle(old.Bundle, resp.GetTrustBundle())
	if err != nil {
		return fmt.Errorf("session: renew: %w", err)
	}
	id := state.Identity{NodeID: old.NodeID, Chain: resp.GetCertificateChain(), Bundle: bundle}
	if len(id.Chain) == 0 {
		return errors.New("session: renew: no certificate in the answer")
	}
	if err := id.Verify(r.key); err != nil {
		return fmt.Errorf("session: renew: %w", err)
	}
	if err := r.cfg.State.SaveIdentity(id); err != nil {
		return err
	}
	if err := r.setIdentity(id); err != nil {
		return err
	}
	_, cert, _ := r.current()
	r.log.InfoContext(ctx, "certificate renewed", "expires", cert.Leaf.NotAfter, "renew_at", RenewAt(cert.Leaf))
	return nil
}

// pinnedBundle is the trust bundle a node keeps after a Renew whose answer
// offered offered: the bundle pinned at join, plus every offered CA that is
// already in it or chains to it (a rotation: the new CA signed by the old).
// An offered CA that does neither is refused, and with it the renewal — so
// whoever answers Renew cannot swap the node's trust and then have it accept
// certificates of a CA of its own.
func pinnedBundle(pinned, offered [][]byte) ([][]byte, error) {
	roots := x509.NewCertPool()
	for _, der := range pinned {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("pinned trust bundle: %w", err)
		}
		roots.AddCert(c)
	}
	out := slices.Clone(pinned)
	for _, der := range offered {
		if slices.ContainsFunc(out, func(p []byte) bool { return bytes.Equal(p, der) }) {
			continue
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("offered trust bundle: %w", err)
		}
		if !c.IsCA {
			return nil, fmt.Errorf("offered trust bundle: %q is not a CA", c.Subject)
		}
		if _, err := c.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
			return nil, fmt.Errorf("offered trust bundle: CA %q does not chain to the bundle pinned at join: %w", c.Subject, err)
		}
		out = append(out, der)
	}
	return out, nil
}
