package authz

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/cedar-policy/cedar-go"
	xast "github.com/cedar-policy/cedar-go/x/exp/ast"
	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Policy is a named Cedar document attached to a tenant.
type Policy struct {
	TenantID  string
	Name      string
	Body      string
	Version   int64
	CreatedAt time.Time
	UpdatedAt time.Time
}

var position = regexp.MustCompile(`at <input>:(\d+):(\d+)`)

var policyName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$`)

// ValidPolicyName reports whether name is lowercase letters, digits and inner
// hyphens, at most 64 characters.
func ValidPolicyName(name string) bool { return policyName.MatchString(name) }

// Parse parses a Cedar document of one or more policies. A syntax error is
// INVALID_INPUT on field "body" with the parser's line and column.
func Parse(name, body string) (cedar.PolicyList, error) {
	list, err := cedar.NewPolicyListFromBytes("", []byte(body))
	if err != nil {
		msg := strings.TrimPrefix(err.Error(), "parser error: ")
		msg = position.ReplaceAllString(msg, "line $1, column $2:")
		return nil, fault.Wrap(err, fault.InvalidInput, "body", "invalid Cedar policy %s: %s", name, msg)
	}
	if len(list) == 0 {
		return nil, fault.New(fault.InvalidInput, "body", "policy %s has no statements", name)
	}
	for _, p := range list {
		if err := knownActions(name, p.AST().Action); err != nil {
			return nil, err
		}
	}
	return list, nil
}

// knownActions refuses a policy whose scope names an action that is not in
// the catalog: a typo would otherwise make a policy that never matches.
func knownActions(name string, scope xast.IsActionScopeNode) error {
	var uids []cedar.EntityUID
	switch s := scope.(type) {
	case xast.ScopeTypeEq:
		uids = append(uids, s.Entity)
	case xast.ScopeTypeIn:
		uids = append(uids, s.Entity)
	case xast.ScopeTypeInSet:
		uids = append(uids, s.Entities...)
	}
	for _, u := range uids {
		if u.Type != "Action" || !Known(Action(u.ID)) {
			return fault.New(fault.InvalidInput, "body", "policy %s names %s, which is not an action in the catalog (e.g. Action::%q)", name, u, string(NodesExec))
		}
	}
	return nil
}

// Bounds of a tenant's policies, so that no tenant can make every decision on
// it (and on its descendants) slow: see docs/security.md, "Policy evaluation
// cost".
const (
	// MaxPolicyBytes bounds the Cedar text of one policy: more is
	// INVALID_INPUT on "body".
	MaxPolicyBytes = 16 << 10
	// MaxPoliciesPerTenant bounds the policies attached to one tenant: a put
	// of a new name beyond it is QUOTA_EXCEEDED on "name" (replacing an
	// existing policy is always allowed).
	MaxPoliciesPerTenant = 100
)

// CheckPolicySize refuses a body over [MaxPolicyBytes].
func CheckPolicySize(body string) error {
	if len(body) > MaxPolicyBytes {
		return fault.New(fault.InvalidInput, "body", "a policy is at most %d bytes of Cedar; this one is %d", MaxPolicyBytes, len(body))
	}
	return nil
}

// PutPolicy validates p.Body and creates or replaces the policy, bumping its
// version and its tenant's policy version. Run it in a transaction that wakes the
// policy caches (reconcile.Queue.WakePolicies).
func PutPolicy(ctx context.Context, q Querier, p Policy) (Policy, error) {
	if err := CheckPolicySize(p.Body); err != nil {
		return Policy{}, err
	}
	if _, err := Parse(p.Name, p.Body); err != nil {
		return Policy{}, err
	}
	// Bumping the tenant's version first locks its row until the commit, so
	// concurrent puts to one tenant count one after the other.
	if err := bumpPolicyVersion(ctx, q, p.TenantID); err != nil {
		return Policy{}, err
	}
	var n int
	var exists bool
	if err := q.QueryRow(ctx, `SELECT count(*), coalesce(bool_or(name = $2), false) FROM policies WHERE tenant_id = $1`,
		p.TenantID, p.Name).Scan(&n, &exists); err != nil {
		return Policy{}, fmt.Errorf("count policies of %s: %w", p.TenantID, err)
	}
	if !exists && n >= MaxPoliciesPerTenant {
		return Policy{}, fault.New(fault.QuotaExceeded, "name", "tenant %s has %d policies, the most a tenant may have; delete one or merge them", p.TenantID, n)
	}
	err := q.QueryRow(ctx, `
		INSERT INTO policies (tenant_id, name, body) VALUES ($1, $2, $3)
		ON CONFLICT (tenant_id, name) DO UPDATE
		SET body = excluded.body, version = policies.version + 1, updated_at = now()
		RETURNING version, created_at, updated_at`, p.TenantID, p.Name, p.Body).Scan(&p.Version, &p.CreatedAt, &p.UpdatedAt)
	if err != nil {
		return Policy{}, fmt.Errorf("put policy %s/%s: %w", p.TenantID, p.Name, err)
	}
	return p, nil
}

const policyCols = `tenant_id, name, body, version, created_at, updated_at`

func scanPolicy(r pgx.Row) (Policy, error) {
	var p Policy
	err := r.Scan(&p.TenantID, &p.Name, &p.Body, &p.Version, &p.CreatedAt, &p.UpdatedAt)
	return p, err
}

// GetPolicy reads one policy; NOT_FOUND otherwise.
func GetPolicy(ctx context.Context, q Querier, tenant, name string) (Policy, error) {
	p, err := scanPolicy(q.QueryRow(ctx, `SELECT `+policyCols+` FROM policies WHERE tenant_id = $1 AND name = $2`, tenant, name))
	if errors.Is(err, pgx.ErrNoRows) {
		return Policy{}, fault.New(fault.NotFound, "name", "policy %q not found in tenant %s", name, tenant)
	}
	if err != nil {
		return Policy{}, fmt.Errorf("read policy %s/%s: %w", tenant, name, err)
	}
	return p, nil
}

// ListPolicies returns up to limit policies of tenant named after after.
func ListPolicies(ctx context.Context, q Querier, tenant, after string, limit int) ([]Policy, error) {
	rows, err := q.Query(ctx, `SELECT `+policyCols+` FROM policies
		WHERE tenant_id = $1 AND name > $2 ORDER BY name LIMIT $3`, tenant, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list policies: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Policy, error) { return scanPolicy(r) })
}

// DeletePolicy removes a policy, bumping its tenant's policy version;
// NOT_FOUND when there is none. Like [PutPolicy], invalidate after the commit.
func DeletePolicy(ctx context.Context, q Querier, tenant, name string) error {
	tag, err := q.Exec(ctx, `DELETE FROM policies WHERE tenant_id = $1 AND name = $2`, tenant, name)
	if err != nil {
		return fmt.Errorf("delete policy %s/%s: %w", tenant, name, err)
	}
	if tag.RowsAffected() == 0 {
		return fault.New(fault.NotFound, "name", "policy %q not found in tenant %s", name, tenant)
	}
	return bumpPolicyVersion(ctx, q, tenant)
}

// bumpPolicyVersion marks a change of tenant's policies, which every
// authorizer's cache sees at its next version check.
func bumpPolicyVersion(ctx context.Context, q Querier, tenant string) error {
	tag, err := q.Exec(ctx, `UPDATE tenants SET policy_version = policy_version + 1 WHERE id = $1`, tenant)
	if err != nil {
		return fmt.Errorf("bump policy version of %s: %w", tenant, err)
	}
	if tag.RowsAffected() == 0 {
		return fault.New(fault.NotFound, "tenantId", "tenant %q not found", tenant)
	}
	return nil
}
