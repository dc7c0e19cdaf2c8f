// Package iam is Better Compute's identity layer: the tenant tree, identities
// (users and service accounts), API keys and the authentication of a key into
// a [Principal], cached for a bounded time.
//
// Tenant ids are paths. The root tenant is "root"; its children have plain
// names ("acme"); a child of acme is "acme.ml". A tenant's ancestors follow
// from its id, so whether a caller may act in a tenant at all ([Covers]) is
// known without a query.
//
// API keys are "bck_<id>.<secret>". The secret is shown once, at creation;
// only its SHA-256 is stored (the secret is 256 random bits, so a slow hash
// adds nothing).
package iam

import (
	"context"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// RootTenant is the id of the tenant every other tenant descends from.
const RootTenant = "root"

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Principal is an authenticated caller.
type Principal struct {
	// IdentityID is the identity's id (idn_…).
	IdentityID string
	// TenantID is the tenant the identity belongs to.
	TenantID string
	// Kind is "user" or "service".
	Kind string
	// Name is the identity's name, unique in its tenant.
	Name string
	// KeyID is the id of the API key that authenticated the call.
	KeyID string
}

// Covers reports whether p may act in tenant at all: p is in the root tenant,
// in tenant itself, or in one of its ancestors. It is the tenant pre-check,
// made before any database access; policies decide the rest.
func (p Principal) Covers(tenant string) bool {
	return Covers(p.TenantID, tenant)
}

// Covers reports whether tenant is outer or lies under it.
func Covers(outer, tenant string) bool {
	return outer == RootTenant || tenant == outer || strings.HasPrefix(tenant, outer+".")
}

// Parent returns the id of tenant's parent, "" for the root tenant.
func Parent(tenant string) string {
	if tenant == RootTenant {
		return ""
	}
	if i := strings.LastIndexByte(tenant, '.'); i >= 0 {
		return tenant[:i]
	}
	return RootTenant
}

// Ancestors returns tenant and every ancestor up to root, nearest first:
// "acme.ml" → ["acme.ml", "acme", "root"].
func Ancestors(tenant string) []string {
	out := []string{tenant}
	for t := Parent(tenant); t != ""; t = Parent(t) {
		out = append(out, t)
	}
	return out
}

// Below lists tenant and its ancestors strictly below owner, tenant first
// (a descendant's chain up to a shared pool's tenant); nil when owner is
// not a strict ancestor of tenant.
func Below(tenant, owner string) []string {
	anc := Ancestors(tenant)
	if i := slices.Index(anc, owner); i > 0 {
		return anc[:i]
	}
	return nil
}

var segment = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`)

// ValidTenantID reports whether id is a well-formed tenant id: root, or
// dot-separated segments of lowercase letters, digits and inner hyphens (at
// most 40 characters each, 8 levels, and never "root" below the top).
func ValidTenantID(id string) bool {
	if id == RootTenant {
		return true
	}
	parts := strings.Split(id, ".")
	if len(parts) > 8 || len(id) > 200 {
		return false
	}
	for _, p := range parts {
		if !segment.MatchString(p) || p == RootTenant {
			return false
		}
	}
	return true
}

// ChildOf reports whether id names a direct child of parent.
func ChildOf(id, parent string) bool {
	return id != RootTenant && Parent(id) == parent
}

type principalKey struct{}

// WithPrincipal returns ctx carrying the authenticated caller.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// PrincipalFrom returns the caller [WithPrincipal] put in ctx.
func PrincipalFrom(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(Principal)
	return p, ok
}
