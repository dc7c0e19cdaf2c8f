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

// PutPolicy validates p.Body and creates or replaces the policy, bumping its
// version.
func PutPolicy(ctx context.Context, q Querier, p Policy) (Policy, error) {
	if _, err := Parse(p.Name, p.Body); err != nil {
		return Policy{}, err
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

// DeletePolicy removes a policy; NOT_FOUND when there is none.
func DeletePolicy(ctx context.Context, q Querier, tenant, name string) error {
	tag, err := q.Exec(ctx, `DELETE FROM policies WHERE tenant_id = $1 AND name = $2`, tenant, name)
	if err != nil {
		return fmt.Errorf("delete policy %s/%s: %w", tenant, name, err)
	}
	if tag.RowsAffected() == 0 {
		return fault.New(fault.NotFound, "name", "policy %q not found in tenant %s", name, tenant)
	}
	return nil
}
