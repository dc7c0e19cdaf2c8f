package sites

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// TokenPrefix starts every site token.
const TokenPrefix = "bcst_"

// Site token limits.
const (
	// MaxTokenUses bounds a token's uses: a site has a handful of agents.
	MaxTokenUses = 100
	// DefaultTokenTTL is a token's lifetime when create names none.
	DefaultTokenTTL = 24 * time.Hour
	// MaxTokenTTL bounds a token's lifetime.
	MaxTokenTTL = 30 * 24 * time.Hour
	// TokenRetention is how long an expired or revoked token is kept.
	TokenRetention = 30 * 24 * time.Hour
)

// Why a site token cannot be redeemed. Each is also an UNAUTHENTICATED
// *fault.Error on field "sealedToken" (errors.Is finds both).
var (
	ErrTokenMalformed = errors.New("malformed site token: expected bcst_<id>.<secret>")
	ErrTokenUnknown   = errors.New("unknown site token")
	ErrTokenExpired   = errors.New("site token expired")
	ErrTokenExhausted = errors.New("site token has no uses left")
	ErrTokenRevoked   = errors.New("site token revoked")
)

func refused(err error) error {
	return fault.Wrap(err, fault.Unauthenticated, "sealedToken", "%v", err)
}

// Token is a stored site token (never its secret).
type Token struct {
	ID        string
	TenantID  string
	SiteID    string
	Name      string
	Uses      int
	UsesLeft  int
	CreatedBy string
	CreatedAt time.Time
	ExpiresAt time.Time
	RevokedAt *time.Time
}

// MintedToken is a freshly minted token: Token is shown once and never
// stored.
type MintedToken struct {
	ID    string
	Token string
	Hash  []byte
}

// MintToken makes a token: a 16-character id and a 256-bit secret.
func MintToken() MintedToken {
	m := secret.Mint(TokenPrefix)
	return MintedToken{ID: m.ID, Token: m.Value, Hash: m.Hash}
}

// IsToken reports whether s is shaped like a site token (the join path
// tells site tokens from join tokens by it).
func IsToken(s string) bool {
	_, _, ok := secret.Parse(TokenPrefix, s)
	return ok
}

const tokenCols = `id, tenant_id, site_id, name, uses, uses_left, created_by, created_at, expires_at, revoked_at`

func scanToken(r pgx.Row) (Token, error) {
	var t Token
	err := r.Scan(&t.ID, &t.TenantID, &t.SiteID, &t.Name, &t.Uses, &t.UsesLeft, &t.CreatedBy, &t.CreatedAt, &t.ExpiresAt, &t.RevokedAt)
	return t, err
}

func tokenNotFound(tenant, id string) error {
	return fault.New(fault.NotFound, "tokenId", "site token %q not found in tenant %s", id, tenant)
}

// CreateToken stores t (with all its uses left) under the minted secret's
// hash. t.ID is the [MintedToken]'s id.
func CreateToken(ctx context.Context, q Querier, t Token, hash []byte) (Token, error) {
	out, err := scanToken(q.QueryRow(ctx, `
		INSERT INTO site_tokens (id, tenant_id, site_id, name, secret_hash, uses, uses_left, created_by, expires_at)
		VALUES ($1, $2, $3, $4, $5, $6, $6, $7, $8) RETURNING `+tokenCols,
		t.ID, t.TenantID, t.SiteID, t.Name, hash, t.Uses, t.CreatedBy, t.ExpiresAt))
	if err != nil {
		return Token{}, fmt.Errorf("insert site token: %w", err)
	}
	return out, nil
}

// ListTokens returns up to limit tokens of one site of tenant with ids
// after after, in id order.
func ListTokens(ctx context.Context, q Querier, tenant, site, after string, limit int) ([]Token, error) {
	rows, err := q.Query(ctx, `SELECT `+tokenCols+` FROM site_tokens
		WHERE tenant_id = $1 AND site_id = $2 AND id > $3 ORDER BY id LIMIT $4`, tenant, site, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list site tokens: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Token, error) { return scanToken(r) })
}

// RevokeToken marks a token of one site revoked (keeping the first
// revocation time); NOT_FOUND on "tokenId" otherwise.
func RevokeToken(ctx context.Context, q Querier, tenant, site, id string) (Token, error) {
	t, err := scanToken(q.QueryRow(ctx, `UPDATE site_tokens SET revoked_at = coalesce(revoked_at, now())
		WHERE tenant_id = $1 AND site_id = $2 AND id = $3 RETURNING `+tokenCols, tenant, site, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Token{}, tokenNotFound(tenant, id)
	}
	if err != nil {
		return Token{}, fmt.Errorf("revoke site token %s: %w", id, err)
	}
	return t, nil
}

// RedeemToken spends one use of token in q (the caller's transaction, so a
// failed enrollment gives it back). A token that cannot be redeemed is an
// UNAUTHENTICATED error on "sealedToken" wrapping one of the ErrToken
// values; the use is spent by one conditional UPDATE, by database time, so
// concurrent redemptions never overspend.
func RedeemToken(ctx context.Context, q Querier, token string) (Token, error) {
	id, sec, ok := secret.Parse(TokenPrefix, token)
	if !ok {
		return Token{}, refused(ErrTokenMalformed)
	}
	var (
		t       Token
		hash    []byte
		expired bool
	)
	err := q.QueryRow(ctx, `SELECT `+tokenCols+`, secret_hash, expires_at <= now() FROM site_tokens WHERE id = $1`, id).Scan(
		&t.ID, &t.TenantID, &t.SiteID, &t.Name, &t.Uses, &t.UsesLeft, &t.CreatedBy, &t.CreatedAt, &t.ExpiresAt, &t.RevokedAt, &hash, &expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return Token{}, refused(ErrTokenUnknown)
	}
	if err != nil {
		return Token{}, fmt.Errorf("read site token %s: %w", id, err)
	}
	if subtle.ConstantTimeCompare(secret.Hash(sec), hash) != 1 {
		return Token{}, refused(ErrTokenUnknown)
	}
	switch {
	case t.RevokedAt != nil:
		return Token{}, refused(ErrTokenRevoked)
	case expired:
		return Token{}, refused(ErrTokenExpired)
	}
	spent, err := scanToken(q.QueryRow(ctx, `
		UPDATE site_tokens SET uses_left = uses_left - 1
		WHERE id = $1 AND uses_left > 0 AND revoked_at IS NULL AND expires_at > now()
		RETURNING `+tokenCols, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Token{}, refused(ErrTokenExhausted)
	}
	if err != nil {
		return Token{}, fmt.Errorf("spend site token %s: %w", id, err)
	}
	return spent, nil
}

// PruneTokens deletes tokens that expired or were revoked more than
// TokenRetention ago, at most limit of them, and returns how many.
func PruneTokens(ctx context.Context, q Querier, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM site_tokens WHERE id IN (
		SELECT id FROM site_tokens WHERE coalesce(revoked_at, expires_at) < now() - make_interval(secs => $1) LIMIT $2)`,
		TokenRetention.Seconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("prune site tokens: %w", err)
	}
	return tag.RowsAffected(), nil
}
