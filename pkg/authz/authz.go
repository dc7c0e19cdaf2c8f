package authz

import (
	"context"
	"fmt"
	"sync"

	"github.com/cedar-policy/cedar-go"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Resource types of the projection (the Cedar entity types).
const (
	TypeTenant   = "Tenant"
	TypeIdentity = "Identity"
	TypeAPIKey   = "ApiKey"
	TypePolicy   = "Policy"
	TypePool     = "Pool"
	// TypeNode is a node; its projection row carries its pool and labels.
	TypeNode = "Node"
	// TypeJoinToken is a join token, in its pool.
	TypeJoinToken = "JoinToken"
	TypeAudit     = "AuditLog"
	// TypeWebhook is a webhook endpoint.
	TypeWebhook = "Webhook"
)

// Resource is what a decision knows about the resource acted on: a row of
// the authorization projection.
type Resource struct {
	// Type is the Cedar entity type, e.g. "Pool".
	Type string
	// ID is the resource's id.
	ID string
	// TenantID is the tenant the resource belongs to.
	TenantID string
	// PoolID is the pool it lives in, if any.
	PoolID string
	// Labels are its labels.
	Labels map[string]string
}

// UID returns the resource's Cedar entity UID as text, e.g. Pool::"pool_x".
func (r Resource) UID() string {
	return cedar.NewEntityUID(cedar.EntityType(r.Type), cedar.String(r.ID)).String()
}

// TenantResource is the resource of an action on a tenant's collection (a
// list, or a create before the new resource has an id): the tenant itself.
func TenantResource(tenant string) Resource {
	return Resource{Type: TypeTenant, ID: tenant, TenantID: tenant}
}

// Authorizer makes decisions. It caches parsed policies by (tenant, name,
// version); every decision reads the current versions, so a put or delete
// takes effect at once in every process.
type Authorizer struct {
	db Querier
	mu sync.Mutex
	// parsed policies by "tenant/name".
	parsed map[string]parsedPolicy
}

type parsedPolicy struct {
	version int64
	list    cedar.PolicyList
}

// New returns an Authorizer reading policies through db.
func New(db Querier) *Authorizer {
	return &Authorizer{db: db, parsed: map[string]parsedPolicy{}}
}

// Decision is the outcome of one authorization.
type Decision struct {
	Allowed bool
	// Reasons are the ids ("tenant/name") of the policies that decided.
	Reasons []string
}

// Authorize decides whether p may take action on res, reading policies
// through q (or the Authorizer's db when q is nil). A denial is ACCESS_DENIED.
func (a *Authorizer) Authorize(ctx context.Context, q Querier, p iam.Principal, action Action, res Resource) error {
	d, err := a.Decide(ctx, q, p, action, res)
	if err != nil {
		return err
	}
	if !d.Allowed {
		return fault.New(fault.AccessDenied, "", "%s may not %s on %s", p.IdentityID, action, res.UID())
	}
	return nil
}

// Decide evaluates the policies attached to res's tenant and its ancestors.
func (a *Authorizer) Decide(ctx context.Context, q Querier, p iam.Principal, action Action, res Resource) (Decision, error) {
	if q == nil {
		q = a.db
	}
	ps, err := a.policySet(ctx, q, iam.Ancestors(res.TenantID))
	if err != nil {
		return Decision{}, err
	}
	req := cedar.Request{
		Principal: principalUID(p),
		Action:    cedar.NewEntityUID("Action", cedar.String(action)),
		Resource:  cedar.NewEntityUID(cedar.EntityType(res.Type), cedar.String(res.ID)),
		Context:   cedar.NewRecord(nil),
	}
	ok, diag := cedar.Authorize(ps, entities(p, res), req)
	d := Decision{Allowed: ok == cedar.Allow}
	for _, r := range diag.Reasons {
		d.Reasons = append(d.Reasons, string(r.PolicyID))
	}
	return d, nil
}

func principalUID(p iam.Principal) cedar.EntityUID {
	return cedar.NewEntityUID(TypeIdentity, cedar.String(p.IdentityID))
}

func tenantUID(t string) cedar.EntityUID { return cedar.NewEntityUID(TypeTenant, cedar.String(t)) }

// entities builds the entity map of one request: the principal, the resource
// and the tenants above both.
func entities(p iam.Principal, res Resource) cedar.EntityMap {
	em := cedar.EntityMap{}
	addTenants := func(t string) {
		for _, x := range iam.Ancestors(t) {
			uid := tenantUID(x)
			if _, ok := em[uid]; ok {
				return
			}
			var parents []cedar.EntityUID
			if par := iam.Parent(x); par != "" {
				parents = append(parents, tenantUID(par))
			}
			em[uid] = cedar.Entity{UID: uid, Parents: cedar.NewEntityUIDSet(parents...), Attributes: cedar.NewRecord(nil)}
		}
	}
	addTenants(p.TenantID)
	addTenants(res.TenantID)

	pu := principalUID(p)
	em[pu] = cedar.Entity{
		UID:     pu,
		Parents: cedar.NewEntityUIDSet(tenantUID(p.TenantID)),
		Attributes: cedar.NewRecord(cedar.RecordMap{
			"tenant": tenantUID(p.TenantID),
			"kind":   cedar.String(p.Kind),
			"name":   cedar.String(p.Name),
		}),
	}

	labels := cedar.RecordMap{}
	for k, v := range res.Labels {
		labels[cedar.String(k)] = cedar.String(v)
	}
	ru := cedar.NewEntityUID(cedar.EntityType(res.Type), cedar.String(res.ID))
	attrs := cedar.RecordMap{"labels": cedar.NewRecord(labels)}
	var parents []cedar.EntityUID
	if res.Type == TypeTenant {
		// A tenant's place in the tree is already in the map.
		if par := iam.Parent(res.ID); par != "" {
			attrs["tenant"] = tenantUID(par)
			parents = append(parents, tenantUID(par))
		}
	} else {
		attrs["tenant"] = tenantUID(res.TenantID)
		parents = append(parents, tenantUID(res.TenantID))
	}
	if res.PoolID != "" {
		pool := cedar.NewEntityUID(TypePool, cedar.String(res.PoolID))
		attrs["pool"] = pool
		parents = append(parents, pool)
		if _, ok := em[pool]; !ok {
			em[pool] = cedar.Entity{UID: pool, Parents: cedar.NewEntityUIDSet(tenantUID(res.TenantID)), Attributes: cedar.NewRecord(nil)}
		}
	}
	em[ru] = cedar.Entity{UID: ru, Parents: cedar.NewEntityUIDSet(parents...), Attributes: cedar.NewRecord(attrs)}
	return em
}

// policySet reads the policies attached to tenants and parses the ones not
// already cached at their current version.
func (a *Authorizer) policySet(ctx context.Context, q Querier, tenants []string) (*cedar.PolicySet, error) {
	rows, err := q.Query(ctx, `SELECT tenant_id, name, version, body FROM policies WHERE tenant_id = ANY($1)`, tenants)
	if err != nil {
		return nil, fmt.Errorf("read policies: %w", err)
	}
	type row struct {
		tenant, name, body string
		version            int64
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		err := r.Scan(&x.tenant, &x.name, &x.version, &x.body)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("read policies: %w", err)
	}
	ps := cedar.NewPolicySet()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, x := range got {
		key := x.tenant + "/" + x.name
		pp, ok := a.parsed[key]
		if !ok || pp.version != x.version {
			list, err := Parse(key, x.body)
			if err != nil {
				// Stored policies were validated on put; one that no longer
				// parses (after a cedar-go upgrade) takes part in nothing.
				continue
			}
			pp = parsedPolicy{version: x.version, list: list}
			a.parsed[key] = pp
		}
		for i, pol := range pp.list {
			ps.Add(cedar.PolicyID(fmt.Sprintf("%s#%d", key, i)), pol)
		}
	}
	return ps, nil
}
