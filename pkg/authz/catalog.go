// Package authz decides whether a principal may take an action on a resource,
// with Cedar policies (github.com/cedar-policy/cedar-go) attached to tenants,
// over the authorization projection: one row per resource giving its type,
// id, tenant, pool and labels.
//
// The Cedar model:
//
//   - principal: Identity::"idn_…", a member of Tenant::"<its tenant>", with
//     attributes tenant (an entity), kind ("user" or "service") and name.
//   - action: Action::"compute:<group>:<verb>", one of [Catalog].
//   - resource: <Type>::"<id>" (Pool, Tenant, Identity, ApiKey, Policy, …),
//     in Tenant::"<its tenant>" (and in Pool::"<pool>" when it has one), with
//     attributes tenant, labels (a record) and, when set, pool.
//   - context: for an action about an identity (identities.revoke, the
//     identity's own create, apiKeys.create and apiKeys.revoke, whose
//     resource carries the key's owner as attribute identity),
//     { targetIdentity: Identity::"idn_…", self: <the target is the
//     principal> }, so `when { context.self }` means "for yourself only".
//     Other actions have an empty context. Minting a key for another
//     identity is also compute:identities:impersonate on that identity
//     (resource Identity::"idn_…"), so compute:api-keys:create alone is a
//     key for oneself.
//   - Tenant::"acme.ml" is in Tenant::"acme", which is in Tenant::"root". So
//     `resource in Tenant::"acme"` covers acme's whole subtree, and so does
//     `principal in Tenant::"acme"`; `principal.tenant == Tenant::"acme"`
//     names acme's own members only.
//
// A decision evaluates the policies attached to the resource's tenant and to
// each of its ancestors: Cedar's rules apply (any matching forbid denies;
// otherwise a matching permit allows; otherwise deny). Break-glass actions
// ([BreakGlass]) by a caller from a strict ancestor of the resource's tenant
// are decided by the policies of the caller's tenant and its ancestors only:
// a descendant cannot forbid its ancestors to inspect and disarm it.
package authz

import (
	"fmt"
	"slices"
)

// Action names one thing a caller may be allowed to do.
type Action string

// The catalog's actions, one per API verb (later issues add theirs here).
const (
	SystemVersion Action = "compute:system:version"
	SystemHealth  Action = "compute:system:health"
	SystemWhoAmI  Action = "compute:system:whoami"

	TenantsCreate Action = "compute:tenants:create"
	TenantsGet    Action = "compute:tenants:get"
	TenantsList   Action = "compute:tenants:list"

	IdentitiesCreate Action = "compute:identities:create"
	IdentitiesList   Action = "compute:identities:list"
	IdentitiesRevoke Action = "compute:identities:revoke"
	// IdentitiesImpersonate is acting as another identity, decided on that
	// identity: apiKeys.create of a key for anybody but the caller needs
	// it as well as compute:api-keys:create (a key acts as its identity).
	IdentitiesImpersonate Action = "compute:identities:impersonate"

	APIKeysCreate Action = "compute:api-keys:create"
	APIKeysList   Action = "compute:api-keys:list"
	APIKeysRevoke Action = "compute:api-keys:revoke"

	PoliciesPut    Action = "compute:policies:put"
	PoliciesGet    Action = "compute:policies:get"
	PoliciesList   Action = "compute:policies:list"
	PoliciesDelete Action = "compute:policies:delete"

	PoolsCreate Action = "compute:pools:create"
	PoolsGet    Action = "compute:pools:get"
	PoolsList   Action = "compute:pools:list"
	PoolsUpdate Action = "compute:pools:update"

	// Rollouts: a staged change of a pool's settings, each decided on the
	// pool (docs/rollouts.md).
	RolloutsCreate   Action = "compute:rollouts:create"
	RolloutsGet      Action = "compute:rollouts:get"
	RolloutsList     Action = "compute:rollouts:list"
	RolloutsPause    Action = "compute:rollouts:pause"
	RolloutsResume   Action = "compute:rollouts:resume"
	RolloutsCancel   Action = "compute:rollouts:cancel"
	RolloutsRollback Action = "compute:rollouts:rollback"

	AuditList Action = "compute:audit:list"
	// AuditVerify recomputes the audit hash chain (on the root tenant).
	AuditVerify Action = "compute:audit:verify"

	EventsList  Action = "compute:events:list"
	EventsWatch Action = "compute:events:watch"

	WebhooksCreate       Action = "compute:webhooks:create"
	WebhooksGet          Action = "compute:webhooks:get"
	WebhooksList         Action = "compute:webhooks:list"
	WebhooksUpdate       Action = "compute:webhooks:update"
	WebhooksDelete       Action = "compute:webhooks:delete"
	WebhooksRotateSecret Action = "compute:webhooks:rotate-secret"
	WebhooksTest         Action = "compute:webhooks:test"
	WebhooksRedeliver    Action = "compute:webhooks:redeliver"

	NodesGet  Action = "compute:nodes:get"
	NodesList Action = "compute:nodes:list"
	// NodesDrain drains a node or returns it to service.
	NodesDrain Action = "compute:nodes:drain"
	NodesExec  Action = "compute:nodes:exec"
	// NodesRetire drains a node, then revokes it for good.
	NodesRetire Action = "compute:nodes:retire"
	// NodesRepair clears a node's latched NeedsRepair.
	NodesRepair Action = "compute:nodes:repair"
	// NodesUpdate changes a node's labels.
	NodesUpdate Action = "compute:nodes:update"
	// NodesRevoke revokes a node's certificates and so ends its sessions.
	NodesRevoke Action = "compute:nodes:revoke"
	// NodesTunnel opens a port forward to a target the node allows
	// (tunnels.open).
	NodesTunnel Action = "compute:nodes:tunnel"
	// TunnelsList lists a tenant's tunnels; TunnelsClose closes one (on
	// its node).
	TunnelsList  Action = "compute:tunnels:list"
	TunnelsClose Action = "compute:tunnels:close"
	// TunnelsConnect carries a tunnel's bytes: anonymous, the connect
	// token is the credential.
	TunnelsConnect Action = "compute:tunnels:connect"

	CommandsRun  Action = "compute:commands:run"
	CommandsGet  Action = "compute:commands:get"
	CommandsList Action = "compute:commands:list"

	JoinTokensCreate Action = "compute:join-tokens:create"
	JoinTokensList   Action = "compute:join-tokens:list"
	JoinTokensRevoke Action = "compute:join-tokens:revoke"

	ReservationsCreate Action = "compute:reservations:create"
	ReservationsGet    Action = "compute:reservations:get"
	ReservationsList   Action = "compute:reservations:list"
	ReservationsCancel Action = "compute:reservations:cancel"
	// ReservationsRelease ends a reservation and frees its GPUs.
	ReservationsRelease Action = "compute:reservations:release"

	SitesCreate Action = "compute:sites:create"
	SitesGet    Action = "compute:sites:get"
	SitesList   Action = "compute:sites:list"
	SitesDelete Action = "compute:sites:delete"
	// SitesRevokeAgent revokes a site agent's certificates and boot lease.
	SitesRevokeAgent Action = "compute:sites:revoke-agent"
	SiteTokensCreate Action = "compute:site-tokens:create"
	SiteTokensList   Action = "compute:site-tokens:list"
	SiteTokensRevoke Action = "compute:site-tokens:revoke"

	// MetalEnroll registers a bare-metal machine (with its BMC credentials).
	MetalEnroll Action = "compute:metal:enroll"
	MetalGet    Action = "compute:metal:get"
	MetalList   Action = "compute:metal:list"
	// MetalDeploy writes an image to a ready machine.
	MetalDeploy Action = "compute:metal:deploy"
	// MetalRelease wipes a deployed machine back to ready.
	MetalRelease Action = "compute:metal:release"
	// MetalRetry resumes a failed machine at its failed step.
	MetalRetry Action = "compute:metal:retry"
	// MetalRescue boots a machine's ramdisk for a person, without wiping.
	MetalRescue Action = "compute:metal:rescue"
	MetalDelete Action = "compute:metal:delete"

	InstancesCreate Action = "compute:instances:create"
	InstancesGet    Action = "compute:instances:get"
	InstancesList   Action = "compute:instances:list"
	// InstancesStop and InstancesStart set an instance's desired power state.
	InstancesStop  Action = "compute:instances:stop"
	InstancesStart Action = "compute:instances:start"
	// InstancesResize changes an instance's size (claiming or releasing capacity).
	InstancesResize Action = "compute:instances:resize"
	InstancesDelete Action = "compute:instances:delete"
	InstancesReboot Action = "compute:instances:reboot"

	// CapacityGet reads a pool's capacity and quotas.
	CapacityGet Action = "compute:capacity:get"
	// QuotasSet sets or removes a tenant's quota in a pool.
	QuotasSet Action = "compute:quotas:set"
)

// catalog is every action, in a stable order.
var catalog = []Action{
	SystemVersion, SystemHealth, SystemWhoAmI,
	TenantsCreate, TenantsGet, TenantsList,
	IdentitiesCreate, IdentitiesList, IdentitiesRevoke, IdentitiesImpersonate,
	APIKeysCreate, APIKeysList, APIKeysRevoke,
	PoliciesPut, PoliciesGet, PoliciesList, PoliciesDelete,
	PoolsCreate, PoolsGet, PoolsList, PoolsUpdate,
	RolloutsCreate, RolloutsGet, RolloutsList, RolloutsPause, RolloutsResume, RolloutsCancel, RolloutsRollback,
	AuditList, AuditVerify,
	EventsList, EventsWatch,
	WebhooksCreate, WebhooksGet, WebhooksList, WebhooksUpdate, WebhooksDelete,
	WebhooksRotateSecret, WebhooksTest, WebhooksRedeliver,
	NodesGet, NodesList, NodesDrain, NodesExec, NodesUpdate, NodesRevoke, NodesRetire, NodesRepair,
	NodesTunnel, TunnelsList, TunnelsClose, TunnelsConnect,
	CommandsRun, CommandsGet, CommandsList,
	JoinTokensCreate, JoinTokensList, JoinTokensRevoke,
	ReservationsCreate, ReservationsGet, ReservationsList, ReservationsCancel,
	ReservationsRelease, CapacityGet, QuotasSet,
	SitesCreate, SitesGet, SitesList, SitesDelete, SitesRevokeAgent,
	SiteTokensCreate, SiteTokensList, SiteTokensRevoke,
	MetalEnroll, MetalGet, MetalList, MetalDeploy, MetalRelease, MetalRetry, MetalRescue, MetalDelete,
	InstancesCreate, InstancesGet, InstancesList, InstancesStop, InstancesStart, InstancesResize, InstancesDelete, InstancesReboot,
}

// breakGlass are the actions a descendant tenant's policies cannot forbid to
// its ancestors: each only reads or takes away (policies, identities, keys),
// so an ancestor can always see into a descendant and remove what it put
// there, and none of them grants anything new.
var breakGlass = []Action{
	TenantsGet, TenantsList,
	PoliciesGet, PoliciesList, PoliciesDelete,
	IdentitiesList, IdentitiesRevoke,
	APIKeysList, APIKeysRevoke,
	AuditList,
}

// BreakGlass reports whether a is a break-glass action: for a caller whose
// home tenant is a strict ancestor of the resource's, only the policies of
// the caller's tenant and its ancestors decide it.
func BreakGlass(a Action) bool { return slices.Contains(breakGlass, a) }

// BreakGlassActions returns the break-glass actions, in a stable order.
func BreakGlassActions() []Action { return slices.Clone(breakGlass) }

// Catalog returns every action, in a stable order.
func Catalog() []Action { return slices.Clone(catalog) }

// Known reports whether a is in the catalog.
func Known(a Action) bool { return slices.Contains(catalog, a) }

// CheckKnown returns an error naming every action in as that is missing from
// the catalog.
func CheckKnown(as ...Action) error {
	var missing []Action
	for _, a := range as {
		if !Known(a) {
			missing = append(missing, a)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("actions missing from the catalog: %v", missing)
	}
	return nil
}
