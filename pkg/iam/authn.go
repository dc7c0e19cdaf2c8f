package iam

import (
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// DefaultAuthTTL is how long a successful authentication is cached: a
// revoked key or identity stops working within it.
const DefaultAuthTTL = 30 * time.Second

// AuthConfig configures an [Authenticator].
type AuthConfig struct {
	// DB looks keys up. Required.
	DB Querier
	// TTL bounds how long an authentication is cached; 0 means
	// [DefaultAuthTTL].
	TTL time.Duration
	// Now is the clock; nil means time.Now. Expiry and the cache both use it.
	Now func() time.Time
	// MaxEntries bounds the cache; 0 means 100,000. A full cache is emptied.
	MaxEntries int
}

// Authenticator turns API keys into principals, caching each success for at
// most TTL (and never past the key's expiry). Failures are not cached.
type Authenticator struct {
	db    Querier
	ttl   time.Duration
	now   func() time.Time
	max   int
	mu    sync.Mutex
	cache map[[32]byte]cached
}

type cached struct {
	p     Principal
	until time.Time
}

// NewAuthenticator returns an authenticator.
func NewAuthenticator(cfg AuthConfig) *Authenticator {
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	return &Authenticator{
		db:    cfg.DB,
		ttl:   cmp.Or(cfg.TTL, DefaultAuthTTL),
		now:   now,
		max:   cmp.Or(cfg.MaxEntries, 100_000),
		cache: map[[32]byte]cached{},
	}
}

// Authenticate checks token (bck_<id>.<secret>) and returns its principal.
// Every failure is UNAUTHENTICATED on field "authorization": malformed,
// unknown, wrong secret, revoked, expired, or an identity that was revoked.
func (a *Authenticator) Authenticate(ctx context.Context, token string) (Principal, error) {
	id, secret, err := ParseKey(token)
	if err != nil {
		return Principal{}, fault.Wrap(err, fault.Unauthenticated, "authorization", "%v", err)
	}
	ck := sha256.Sum256([]byte(token))
	now := a.now()
	a.mu.Lock()
	c, ok := a.cache[ck]
	if ok && now.Before(c.until) {
		a.mu.Unlock()
		return c.p, nil
	}
	delete(a.cache, ck)
	a.mu.Unlock()

	var (
		p            Principal
		hash         []byte
		expires      *time.Time
		keyRevoked   *time.Time
		identRevoked *time.Time
	)
	err = a.db.QueryRow(ctx, `
		SELECT k.secret_hash, k.expires_at, k.revoked_at, i.id, i.tenant_id, i.kind, i.name, i.revoked_at
		FROM api_keys k JOIN identities i ON i.id = k.identity_id
		WHERE k.id = $1`, id).Scan(&hash, &expires, &keyRevoked, &p.IdentityID, &p.TenantID, &p.Kind, &p.Name, &identRevoked)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && !secretMatches(secret, hash)) {
		return Principal{}, fault.New(fault.Unauthenticated, "authorization", "invalid API key")
	}
	if err != nil {
		return Principal{}, fault.Wrap(fmt.Errorf("look up api key: %w", err), fault.Unavailable, "", "cannot check the credential now; retry")
	}
	switch {
	case keyRevoked != nil:
		return Principal{}, fault.New(fault.Unauthenticated, "authorization", "API key %s was revoked", id)
	case identRevoked != nil:
		return Principal{}, fault.New(fault.Unauthenticated, "authorization", "identity %s was revoked", p.IdentityID)
	case expires != nil && !now.Before(*expires):
		return Principal{}, fault.New(fault.Unauthenticated, "authorization", "API key %s expired at %s", id, expires.UTC().Format(time.RFC3339))
	}
	p.KeyID = id
	until := now.Add(a.ttl)
	if expires != nil && expires.Before(until) {
		until = *expires
	}
	a.mu.Lock()
	if len(a.cache) >= a.max {
		clear(a.cache)
	}
	a.cache[ck] = cached{p: p, until: until}
	a.mu.Unlock()
	return p, nil
}

// Recheck is [Authenticate] without the cache: it looks token up now (and
// caches the answer), for a long-lived stream that learnt its key or
// identity may have been revoked.
func (a *Authenticator) Recheck(ctx context.Context, token string) (Principal, error) {
	ck := sha256.Sum256([]byte(token))
	a.mu.Lock()
	delete(a.cache, ck)
	a.mu.Unlock()
	return a.Authenticate(ctx, token)
}

// TTL is how long an authentication is cached.
func (a *Authenticator) TTL() time.Duration { return a.ttl }
