// Package jointoken mints, stores and redeems join tokens: the credential an
// operator hands to a server so that its daemon can join a pool.
//
// A token is "bcjt_<id>.<secret>"; it is shown once, at creation, and only
// SHA-256 of the secret is stored (the secret is 256 random bits, so a slow
// hash adds nothing). A token has a number of uses, an optional expiry, can
// be revoked, carries what it expects of a node's hardware claims
// ([attest.Expect]) and whether a node presenting a known hardware key takes
// back its old node id (reclaim). A token may name its node (NodeID): a
// join with it creates that node or takes it back, as a node or, with role
// ramdisk, as a machine's ramdisk in commissioning (see [Token]).
//
// [Redeem] spends one use with a single conditional UPDATE, so concurrent
// joins can never spend more uses than the token has.
package jointoken

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Prefix starts every join token.
const Prefix = "bcjt_"

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Why a token cannot be redeemed. Each is also an UNAUTHENTICATED
// *fault.Error on field "sealedToken" (errors.Is finds both).
var (
	// ErrMalformed: not shaped like bcjt_<id>.<secret>.
	ErrMalformed = errors.New("malformed join token: expected bcjt_<id>.<secret>")
	// ErrUnknown: no token with that id, or the secret is wrong.
	ErrUnknown = errors.New("unknown join token")
	// ErrExpired: the token's expiry has passed.
	ErrExpired = errors.New("join token expired")
	// ErrExhausted: every use of the token is spent.
	ErrExhausted = errors.New("join token has no uses left")
	// ErrRevoked: the token was revoked.
	ErrRevoked = errors.New("join token revoked")
)

// refused wraps one of the Err values above as the API error.
func refused(err error) error {
	return fault.Wrap(err, fault.Unauthenticated, "sealedToken", "%v", err)
}

// Secret is a freshly minted token. Token is what the operator hands to the
// node; it is never stored.
type Secret struct {
	ID    string
	Token string
	Hash  []byte
}

// Mint makes a token: a 16-character id and a 256-bit secret.
func Mint() Secret {
	m := secret.Mint(Prefix)
	return Secret{ID: m.ID, Token: m.Value, Hash: m.Hash}
}

// Parse splits a token into its id and secret, or returns [ErrMalformed].
func Parse(token string) (id, sec string, err error) {
	id, sec, ok := secret.Parse(Prefix, token)
	if !ok {
		return "", "", ErrMalformed
	}
	return id, sec, nil
}

// Hash is what is stored for a secret.
func Hash(s string) []byte {
	return secret.Hash(s)
}

// Token is a stored join token (never its secret).
type Token struct {
	ID       string
	TenantID string
	PoolID   string
	Name     string
	Uses     int
	UsesLeft int
	Expect   attest.Expect
	Reclaim  bool
	// ReclaimNodeIDs are the nodes a reclaim token may take back, and the
	// only ones: a reclaim is proven by the operator naming the node, not
	// by the hardware's (self-asserted) claims.
	ReclaimNodeIDs []string
	Labels         map[string]string
	CreatedBy      string
	CreatedAt      time.Time
	ExpiresAt      *time.Time
	RevokedAt      *time.Time
	// NodeID, when set, is the node a join with the token creates with this
	// id, or takes back when it exists (whatever hardware it had): the metal
	// workflow names the machine's reserved node, so the ramdisk and the
	// installed system join as it. Empty: a fresh node id (or a reclaim).
	NodeID string
	// Role is what the token makes: [RoleNode] (bcd join; the default) or
	// [RoleRamdisk] (bcd ramdisk: a commissioning node with a restricted
	// certificate; NodeID is required).
	Role string
}

// Roles of a join token (join_tokens.role).
const (
	// RoleNode: a node, `bcd join`.
	RoleNode = "node"
	// RoleRamdisk: a machine's ramdisk in commissioning, `bcd ramdisk`.
	RoleRamdisk = "ramdisk"
)

// MaxNodeIDLen bounds Token.NodeID.
const MaxNodeIDLen = 64

const cols = `id, tenant_id, pool_id, name, uses, uses_left, expect, reclaim, reclaim_node_ids, labels, created_by, created_at, expires_at, revoked_at,
	coalesce(node_id, ''), role`

func scan(r pgx.Row) (Token, error) {
	var t Token
	err := r.Scan(&t.ID, &t.TenantID, &t.PoolID, &t.Name, &t.Uses, &t.UsesLeft, &t.Expect, &t.Reclaim, &t.ReclaimNodeIDs, &t.Labels,
		&t.CreatedBy, &t.CreatedAt, &t.ExpiresAt, &t.RevokedAt, &t.NodeID, &t.Role)
	return t, err
}

// checkNamed validates t's Role and NodeID: INVALID_INPUT on "role" or
// "nodeId".
func checkNamed(t Token) error {
	switch t.Role {
	case RoleNode, RoleRamdisk:
	default:
		return fault.New(fault.InvalidInput, "role", "expected %q or %q, got %q", RoleNode, RoleRamdisk, t.Role)
	}
	switch {
	case t.Role == RoleRamdisk && t.NodeID == "":
		return fault.New(fault.InvalidInput, "nodeId", "a ramdisk token names the node it joins as")
	case len(t.NodeID) > MaxNodeIDLen:
		return fault.New(fault.InvalidInput, "nodeId", "at most %d bytes, got %d", MaxNodeIDLen, len(t.NodeID))
	case t.NodeID != "" && !strings.HasPrefix(t.NodeID, "node_"):
		return fault.New(fault.InvalidInput, "nodeId", "%q is not a node id (node_…)", t.NodeID)
	case t.NodeID != "" && t.Reclaim:
		return fault.New(fault.InvalidInput, "reclaim", "a token naming its node (nodeId) takes that node back; it does not reclaim others")
	}
	return nil
}

// Create stores t (with all its uses left) under the secret's hash. t.ID is
// the minted [Secret]'s id. t.Role empty means [RoleNode]; a ramdisk token
// must name its node (t.NodeID, "node_…"), and a named token does not
// reclaim: INVALID_INPUT on "role", "nodeId" or "reclaim" otherwise.
func Create(ctx context.Context, q Querier, t Token, hash []byte) (Token, error) {
	if t.Role == "" {
		t.Role = RoleNode
	}
	if err := checkNamed(t); err != nil {
		return Token{}, err
	}
	if t.Labels == nil {
		t.Labels = map[string]string{}
	}
	if t.ReclaimNodeIDs == nil {
		t.ReclaimNodeIDs = []string{}
	}
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO join_tokens (id, tenant_id, pool_id, name, secret_hash, uses, uses_left, expect, reclaim, reclaim_node_ids, labels, created_by, expires_at,
		                         node_id, role)
		VALUES ($1, $2, $3, $4, $5, $6, $6, $7, $8, $9, $10, $11, $12, nullif($13, ''), $14) RETURNING `+cols,
		t.ID, t.TenantID, t.PoolID, t.Name, hash, t.Uses, t.Expect, t.Reclaim, t.ReclaimNodeIDs, t.Labels, t.CreatedBy, t.ExpiresAt,
		t.NodeID, t.Role))
	if err != nil {
		return Token{}, fmt.Errorf("insert join token: %w", err)
	}
	return out, nil
}

// Get reads one token of tenant; NOT_FOUND on "id" otherwise.
func Get(ctx context.Context, q Querier, tenant, id string) (Token, error) {
	t, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM join_tokens WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Token{}, fault.New(fault.NotFound, "id", "join token %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Token{}, fmt.Errorf("read join token %s: %w", id, err)
	}
	return t, nil
}

// List returns up to limit tokens of tenant (of one pool when pool is not
// empty) with ids after after, in id order.
func List(ctx context.Context, q Querier, tenant, pool, after string, limit int) ([]Token, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM join_tokens
		WHERE tenant_id = $1 AND ($2 = '' OR pool_id = $2) AND id > $3 ORDER BY id LIMIT $4`, tenant, pool, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list join tokens: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Token, error) { return scan(r) })
}

// Revoke marks a token of tenant revoked (keeping the first revocation
// time); NOT_FOUND on "id" otherwise.
func Revoke(ctx context.Context, q Querier, tenant, id string) (Token, error) {
	t, err := scan(q.QueryRow(ctx, `UPDATE join_tokens SET revoked_at = coalesce(revoked_at, now())
		WHERE tenant_id = $1 AND id = $2 RETURNING `+cols, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Token{}, fault.New(fault.NotFound, "id", "join token %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Token{}, fmt.Errorf("revoke join token %s: %w", id, err)
	}
	return t, nil
}

// Redeem spends one use of token, in q (the caller's transaction, so that a
// join that fails later gives the use back). Before spending, check (when
// not nil) sees the stored token and may refuse, e.g. because the node's
// claims fail the token's expectations; nothing is spent then.
//
// A token that cannot be redeemed is an UNAUTHENTICATED error on
// "sealedToken" wrapping [ErrMalformed], [ErrUnknown], [ErrRevoked],
// [ErrExpired] or [ErrExhausted]. The use is spent by one conditional
// UPDATE (uses_left > 0, not revoked, not expired, by database time), so
// concurrent redemptions never overspend.
func Redeem(ctx context.Context, q Querier, token string, check func(Token) error) (Token, error) {
	id, secret, err := Parse(token)
	if err != nil {
		return Token{}, refused(err)
	}
	t, hash, expired, err := state(ctx, q, id)
	if err != nil {
		return Token{}, err
	}
	if subtle.ConstantTimeCompare(Hash(secret), hash) != 1 {
		return Token{}, refused(ErrUnknown)
	}
	if err := usable(t, expired); err != nil {
		return Token{}, err
	}
	if check != nil {
		if err := check(t); err != nil {
			return Token{}, err
		}
	}
	spent, err := scan(q.QueryRow(ctx, `
		UPDATE join_tokens SET uses_left = uses_left - 1
		WHERE id = $1 AND uses_left > 0 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())
		RETURNING `+cols, id))
	if errors.Is(err, pgx.ErrNoRows) {
		// Spent, revoked or expired since it was read: say which.
		t, _, expired, err := state(ctx, q, id)
		if err != nil {
			return Token{}, err
		}
		if err := usable(t, expired); err != nil {
			return Token{}, err
		}
		return Token{}, refused(ErrExhausted)
	}
	if err != nil {
		return Token{}, fmt.Errorf("spend join token %s: %w", id, err)
	}
	return spent, nil
}

// state reads token id with its secret hash and whether it has expired by
// database time.
func state(ctx context.Context, q Querier, id string) (t Token, hash []byte, expired bool, err error) {
	err = q.QueryRow(ctx, `SELECT `+cols+`, secret_hash, coalesce(expires_at <= now(), false) FROM join_tokens WHERE id = $1`, id).Scan(
		&t.ID, &t.TenantID, &t.PoolID, &t.Name, &t.Uses, &t.UsesLeft, &t.Expect, &t.Reclaim, &t.ReclaimNodeIDs, &t.Labels,
		&t.CreatedBy, &t.CreatedAt, &t.ExpiresAt, &t.RevokedAt, &t.NodeID, &t.Role, &hash, &expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return Token{}, nil, false, refused(ErrUnknown)
	}
	if err != nil {
		return Token{}, nil, false, fmt.Errorf("read join token %s: %w", id, err)
	}
	return t, hash, expired, nil
}

// usable says why t cannot be spent now, if it cannot.
func usable(t Token, expired bool) error {
	switch {
	case t.RevokedAt != nil:
		return refused(ErrRevoked)
	case expired:
		return refused(ErrExpired)
	case t.UsesLeft <= 0:
		return refused(ErrExhausted)
	}
	return nil
}
