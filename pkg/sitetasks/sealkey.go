package sitetasks

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// SiteKey is the key a site's secrets are sealed to: the public JWK of the
// current session of the agent holding the boot lease.
type SiteKey struct {
	AgentID string
	Epoch   int64
	// JWK is the public key (credseal.Seal's argument); KID its id.
	JWK, KID string
	// ExpiresAt is when the holder's lease lapses unless renewed.
	ExpiresAt time.Time
}

// SealKey returns the key to seal site's secrets to. UNAVAILABLE "siteId"
// when no agent holds the lease, or its session said no key; NOT_FOUND
// "siteId" for an unknown site.
func SealKey(ctx context.Context, q Querier, site string) (SiteKey, error) {
	var k SiteKey
	var holder *string
	var expires *time.Time
	err := q.QueryRow(ctx, `
		SELECT s.boot_holder, s.boot_epoch, s.boot_expires_at, coalesce(a.seal_key, '')
		  FROM sites s LEFT JOIN site_agents a ON a.id = s.boot_holder AND a.revoked_at IS NULL
		 WHERE s.id = $1`, site).Scan(&holder, &k.Epoch, &expires, &k.JWK)
	if errors.Is(err, pgx.ErrNoRows) {
		return SiteKey{}, fault.New(fault.NotFound, "siteId", "site %q not found", site)
	}
	if err != nil {
		return SiteKey{}, fmt.Errorf("read seal key of %s: %w", site, err)
	}
	if holder == nil || expires == nil || !expires.After(time.Now()) || k.JWK == "" {
		return SiteKey{}, fault.New(fault.Unavailable, "siteId", "no site agent of %s holds the boot lease with a seal key", site)
	}
	k.AgentID, k.ExpiresAt = *holder, *expires
	if k.KID, err = credseal.KeyID(k.JWK); err != nil {
		return SiteKey{}, fmt.Errorf("seal key of %s: %w", site, err)
	}
	return k, nil
}

// SetSealKey stores agent's current session's public JWK ("" for none),
// replacing its previous session's. INVALID_INPUT "sealKey" for a JWK
// credseal cannot seal to.
func SetSealKey(ctx context.Context, q Querier, agent, jwk string) error {
	if jwk != "" {
		if _, err := credseal.KeyID(jwk); err != nil {
			return fault.Wrap(err, fault.InvalidInput, "sealKey", "sealKey: not a P-256 public JWK")
		}
	}
	if _, err := q.Exec(ctx, `UPDATE site_agents SET seal_key = $2 WHERE id = $1`, agent, jwk); err != nil {
		return fmt.Errorf("store seal key of %s: %w", agent, err)
	}
	return nil
}
