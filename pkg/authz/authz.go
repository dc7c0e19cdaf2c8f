package authz

import (
	"container/list"
	"context"
	"sync"

	"github.com/cedar-policy/cedar-go"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"

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
	// TypeSite is a site; its tokens and agents are acted on through it.
	TypeSite = "Site"
	// TypeMachine is a bare-metal machine; its projection row carries the
	// pool its node joins and its labels, plus its site's id under
	// [SiteLabel] (resource.labels["bc:site"] in a policy).
	TypeMachine = "Machine"
	// TypeInstance is a VPS instance (the resource compute-instance), in
	// its pool.
	TypeInstance = "Instance"
)

// SiteLabel is the projection label that holds a machine's site: a key no
// request can set (label keys never hold ':'), so a policy can trust it.
const SiteLabel = "bc:site"

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
	// Identity is the identity the action is about, when it is about one
	// other than the resource: an API key's owner (for apiKeys.create, the
	// identity the new key is for), in TenantID. An Identity resource is its
	// own target and leaves it empty. See [Resource.Target].
	Identity string
}

// Target returns the id of the identity the action on r is about: r itself
// when it is an Identity, else r.Identity ("" when none).
func (r Resource) Target() string {
	if r.Type == TypeIdentity {
		return r.ID
	}
	return r.Identity
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

// Authorizer makes decisions. It caches each tenant's compiled policies at
// its policy version, and the policy set of each tenant chain composed of
// them, in a cache bounded by [Options]. A decision uses the cache once it
// knows the versions are current: it reads them (one indexed statement)
// unless it listens on a connected bus ([Authorizer.Listen]) and checked
// them less than [Options.Recheck] ago, and a change message
// (wake.Policies) makes it read them at once. So a put or delete takes
// effect in this process as soon as it calls [Authorizer.Invalidate] after
// the commit, and in every other as soon as the message arrives (within
// Recheck if it is lost; at the next decision without a bus).
type Authorizer struct {
	db   Querier
	opts Options

	mu        sync.Mutex
	tenants   map[string]*tenantEntry
	tenantLRU *list.List
	bytes     int
	chains    map[string]*chainEntry
	chainLRU  *list.List
	// epoch grows with every invalidation, so a read that raced one is not
	// trusted for Recheck.
	epoch  uint64
	parses int64
	reads  int64

	nc         *nats.Conn
	sub        *nats.Subscription
	reconnects uint64
	dropped    int
}

// New returns an Authorizer reading policies through db, with the default
// [Options].
func New(db Querier) *Authorizer { return NewWithOptions(db, Options{}) }

// NewWithOptions returns an Authorizer reading policies through db.
func NewWithOptions(db Querier, opts Options) *Authorizer {
	return &Authorizer{
		db: db, opts: opts.withDefaults(),
		tenants: map[string]*tenantEntry{}, tenantLRU: list.New(),
		chains: map[string]*chainEntry{}, chainLRU: list.New(),
	}
}

// Decision is the outcome of one authorization.
type Decision struct {
	Allowed bool
	// Reasons are the ids ("tenant/name") of the policies that decided.
	Reasons []string
}

// Authorize decides whether p may take action on res, reading policies
// through q (or the Authorizer's db when q is nil). A decision through a q of
// its own (a transaction) reads the versions through it every time and
// caches nothing it read. A denial is ACCESS_DENIED.
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

// Decide evaluates the policies attached to res's tenant and its ancestors
// ([DecidingTenants]).
func (a *Authorizer) Decide(ctx context.Context, q Querier, p iam.Principal, action Action, res Resource) (Decision, error) {
	shared := q == nil
	if shared {
		q = a.db
	}
	ps, err := a.policySet(ctx, q, DecidingTenants(p, action, res), shared)
	if err != nil {
		return Decision{}, err
	}
	req := cedar.Request{
		Principal: principalUID(p),
		Action:    cedar.NewEntityUID("Action", cedar.String(action)),
		Resource:  cedar.NewEntityUID(cedar.EntityType(res.Type), cedar.String(res.ID)),
		Context:   requestContext(p, res),
	}
	ok, diag := cedar.Authorize(ps, entities(p, res), req)
	d := Decision{Allowed: ok == cedar.Allow}
	for _, r := range diag.Reasons {
		d.Reasons = append(d.Reasons, string(r.PolicyID))
	}
	return d, nil
}

// DecidingTenants returns the tenants whose policies decide p's action on
// res: res's tenant and its ancestors; but for a break-glass action
// ([BreakGlass]) by a caller whose home tenant is a strict ancestor of res's,
// only the caller's tenant and its ancestors, so a descendant's policies
// cannot lock its ancestors out.
func DecidingTenants(p iam.Principal, action Action, res Resource) []string {
	if BreakGlass(action) && p.TenantID != res.TenantID && iam.Covers(p.TenantID, res.TenantID) {
		return iam.Ancestors(p.TenantID)
	}
	return iam.Ancestors(res.TenantID)
}

// requestContext is the Cedar context of a request: for an action about an
// identity, { targetIdentity: Identity::"…", self: <target is the caller> };
// otherwise empty.
func requestContext(p iam.Principal, res Resource) cedar.Record {
	target := res.Target()
	if target == "" {
		return cedar.NewRecord(nil)
	}
	return cedar.NewRecord(cedar.RecordMap{
		"targetIdentity": identityUID(target),
		"self":           cedar.Boolean(target == p.IdentityID),
	})
}

func identityUID(id string) cedar.EntityUID {
	return cedar.NewEntityUID(TypeIdentity, cedar.String(id))
}

func principalUID(p iam.Principal) cedar.EntityUID { return identityUID(p.IdentityID) }

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
	if prev, ok := em[ru]; ok {
		// The resource is the principal (an identity acting on itself): one
		// entity with both sets of attributes.
		for k, v := range prev.Attributes.All() {
			attrs[k] = v
		}
	}
	if target := res.Target(); target != "" && target != res.ID {
		tu := identityUID(target)
		attrs["identity"] = tu
		if _, ok := em[tu]; !ok {
			em[tu] = cedar.Entity{UID: tu, Parents: cedar.NewEntityUIDSet(tenantUID(res.TenantID)),
				Attributes: cedar.NewRecord(cedar.RecordMap{"tenant": tenantUID(res.TenantID)})}
		}
	}
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
