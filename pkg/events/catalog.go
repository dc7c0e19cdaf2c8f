package events

import (
	"cmp"
	"slices"
	"sync"

	"google.golang.org/protobuf/proto"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// Type is one event type: its name, what it means, what its subject is and
// the shape of its payload.
type Type struct {
	// Name is the dotted name, e.g. "pool.created": the last token of the
	// JetStream subject, what webhooks and watchers subscribe to.
	Name string
	// Doc says when the event is written and what it means.
	Doc string
	// Subject is the kind of resource whose id the event's subject
	// (outbox.Event.Resource) is: "node", "reservation", "command", "pool",
	// "tenant", "identity", "apiKey", "joinToken", "policy", "webhook", "site", "machine", "instance"; ""
	// when the event is about no one resource.
	Subject string
	// Payload, when set, is the payload's message: the payload is that
	// message in proto3 JSON. Nil when the payload is a plain JSON object,
	// described by Fields.
	Payload proto.Message
	// Fields describe the payload's JSON fields when Payload is nil.
	Fields []Field
}

// Field is one field of a plain JSON payload.
type Field struct {
	// Name is the JSON name.
	Name string
	// Type is the JSON type: "string", "integer", "number", "boolean",
	// "object" or "array".
	Type string
	// Doc says what it holds.
	Doc string
}

// Catalog returns every event type, sorted by name. The slice and its
// payload messages are the caller's.
func Catalog() []Type {
	ts := catalog()
	slices.SortFunc(ts, func(a, b Type) int { return cmp.Compare(a.Name, b.Name) })
	return ts
}

// byName indexes the catalog once; every write looks its type up. It is
// never changed after it is built.
var byName = sync.OnceValue(func() map[string]Type {
	m := map[string]Type{}
	for _, t := range catalog() {
		m[t.Name] = t
	}
	return m
})

// Lookup returns the event type named name, and whether there is one.
func Lookup(name string) (Type, bool) {
	t, ok := byName()[name]
	return t, ok
}

// commandFields are the payload of every command.<state>.
func commandFields() []Field {
	return []Field{
		{"commandId", "string", "The command."},
		{"nodeId", "string", "The node it is for."},
		{"seq", "integer", "Its place in the node's command sequence."},
		{"kind", "string", "Its kind (see [command kinds](command-kinds.md))."},
		{"state", "string", "Its new state: pending, in_flight, succeeded, failed, expired or cancelled."},
		{"reason", "string", "Why it is in that state, when the control plane or the daemon said (e.g. BUSY, EXPIRED, timeout, journal-lost)."},
		{"attempts", "integer", "How many times it was sent."},
	}
}

// convergenceFields are the payload of the gateway's node.converged and
// node.convergence_failed.
func convergenceFields() []Field {
	return []Field{
		{"nodeId", "string", "The node."},
		{"generation", "integer", "The node's current desired-state generation."},
		{"observedGeneration", "integer", "The highest generation the node has reported observing."},
		{"sections", "array", "The report's sections, each {section, state, reason, generation}: state is a SectionState name, e.g. SECTION_STATE_FAILED."},
	}
}

// joinFields are the payload of node.joined and node.reclaimed.
func joinFields() []Field {
	return []Field{
		{"nodeId", "string", "The node."},
		{"poolId", "string", "The pool it joined."},
		{"joinTokenId", "string", "The join token it redeemed."},
		{"state", "string", "The node's state: adopting."},
	}
}

// readyFields are the payload of the liveness job's node.ready,
// node.not_ready and node.lost.
func readyFields() []Field {
	return []Field{
		{"nodeId", "string", "The node."},
		{"poolId", "string", "Its pool."},
		{"from", "string", "Its Ready condition before: True, Unknown or Lost."},
		{"to", "string", "Its Ready condition now."},
		{"reason", "string", "Why (empty for True), e.g. \"no heartbeat through any gateway for more than 40s\"."},
		{"lastSeenAt", "string", "When a gateway last heard from it (RFC 3339); absent if never."},
	}
}

// gpuFields are the payload of gpu.quarantined and gpu.recovered.
func gpuFields() []Field {
	return []Field{
		{"nodeId", "string", "The node."},
		{"poolId", "string", "Its pool."},
		{"deviceId", "string", "The GPU (UUID)."},
		{"reason", "string", "Why it was quarantined (unhealthy with the health reason, or missing), or how it recovered."},
	}
}

// remediationFields are the payload of remediation.*.
func remediationFields() []Field {
	return []Field{
		{"nodeId", "string", "The node."},
		{"poolId", "string", "Its pool."},
		{"remediationId", "string", "The step (rem_…)."},
		{"step", "string", "gpu.reset or node.reboot."},
		{"commandId", "string", "The step's command, once sent."},
		{"gpuUuids", "array", "The GPUs the step is for."},
		{"reason", "string", "Why it started, or how it ended."},
	}
}

// brakeFields are the payload of fleet.eviction_paused and
// fleet.eviction_resumed.
func brakeFields() []Field {
	return []Field{
		{"scope", "string", "The circuit breaker: pool:<poolId> or gateway:<gatewayId>/tenant:<tenantId>."},
		{"notReady", "integer", "How many of the scope's nodes (retired ones aside) are not ready (Ready Unknown or Lost)."},
		{"total", "integer", "How many nodes the scope has."},
		{"threshold", "number", "nodes.unhealthyThreshold: the fraction not ready above which the scope is paused."},
	}
}

// reservationFields are the payload of services/capacity's reservation.*
// events: the reservation's id, then more.
func reservationFields(more ...Field) []Field {
	return append([]Field{{"reservationId", "string", "The reservation."}}, more...)
}

// catalog builds the catalog afresh: there is no registry to change, and no
// caller shares another's messages or slices.
//
// Some types are built at run time rather than written as literals, so the
// source walk of catalog_test.go cannot see them; they are enumerated here:
// command.<state> (pkg/commands, one per commands.State), node.converged
// and node.convergence_failed (services/gateway), node.joined and
// node.reclaimed (services/joinservice), reservation.created and
// reservation.placed (services/api), and the reservation.* types of
// services/capacity, whose writer takes the type as an argument.
func catalog() []Type {
	return []Type{
		// API keys.
		{
			Name:    "apiKey.created",
			Subject: "apiKey",
			Payload: &computev1.ApiKeysServiceCreateResponse{},
			Doc: "An API key was created (apiKeys.create). The payload is the stored response, so `secret` is never set. " +
				"`better-compute bootstrap` writes it too, in tenant root, for the root administrator's new key, with the payload " +
				"`{id, identityId, tenantId}` instead.",
		},
		{
			Name:    "apiKey.expiring",
			Subject: "apiKey",
			Fields: []Field{
				{Name: "id", Type: "string", Doc: "The key's id."},
				{Name: "identityId", Type: "string", Doc: "The identity it authenticates."},
				{Name: "name", Type: "string", Doc: "The key's name."},
				{Name: "expiresAt", Type: "string", Doc: "When it stops authenticating (RFC 3339)."},
			},
			Doc: "An API key expires within `iam.keyExpiryWarning` (7 days): written once per key by the iam role's `iam.keys` job, " +
				"so whoever holds it can rotate it in time.",
		},
		{
			Name:    "apiKey.revoked",
			Subject: "apiKey",
			Payload: &computev1.ApiKeysServiceRevokeResponse{},
			Doc:     "An API key was revoked (apiKeys.revoke): it no longer authenticates.",
		},

		// Commands: one type per state, written by pkg/commands on every
		// state change, and two by the commands API.
		{
			Name:    "command.requested",
			Subject: "command",
			Payload: &computev1.CommandsServiceRunResponse{},
			Doc:     "A command was queued through the API (commands.run); `command.pending` is written in the same transaction.",
		},
		{
			Name:    "command.cancel_requested",
			Subject: "command",
			Payload: &computev1.CommandsServiceCancelResponse{},
			Doc: "A command's cancellation was asked for (commands.cancel). A pending command is cancelled at once " +
				"(`command.cancelled`); an in-flight one is sent Cancel until the daemon settles it.",
		},
		{
			Name:    "command.pending",
			Subject: "command",
			Fields:  commandFields(),
			Doc: "A command was queued, or went back to pending to be sent again: the daemon answered BUSY (reason `BUSY`, sent " +
				"again after a back-off) or lost its journal while the command, which is retry-safe, was in flight (reason " +
				"`journal-lost`).",
		},
		{
			Name:    "command.in_flight",
			Subject: "command",
			Fields:  commandFields(),
			Doc:     "The node's gateway claimed the command to send it to the daemon (`attempts` counts this send).",
		},
		{
			Name:    "command.succeeded",
			Subject: "command",
			Fields:  commandFields(),
			Doc: "The command succeeded: the daemon said so, or the command is self-terminating and the node came back with a new " +
				"boot id (reason `the node reconnected with a new boot id`). The result is on the command (commands.get).",
		},
		{
			Name:    "command.failed",
			Subject: "command",
			Fields:  commandFields(),
			Doc: "The command failed: the daemon reported a failure (its reason) or rejected it (the reject code, e.g. " +
				"`UNSUPPORTED`, `BAD_SIGNATURE`), it was in flight past its deadline plus its kind's timeout (reason `timeout`), " +
				"or the daemon lost its journal while a command that is not retry-safe was in flight (reason `journal-lost`).",
		},
		{
			Name:    "command.expired",
			Subject: "command",
			Fields:  commandFields(),
			Doc:     "The command's deadline passed before it ran: the sweeper found it pending past it, or the daemon rejected it as expired (reason `EXPIRED`).",
		},
		{
			Name:    "command.cancelled",
			Subject: "command",
			Fields:  commandFields(),
			Doc: "The command was cancelled: while pending (commands.cancel), by the daemon after a Cancel, or when the daemon " +
				"lost its journal after a cancellation was asked for.",
		},

		// Identities.
		{
			Name:    "identity.created",
			Subject: "identity",
			Payload: &computev1.IdentitiesServiceCreateResponse{},
			Doc:     "An identity (a user or a service) was created (identities.create).",
		},
		{
			Name:    "identity.revoked",
			Subject: "identity",
			Payload: &computev1.IdentitiesServiceRevokeResponse{},
			Doc:     "An identity was revoked (identities.revoke).",
		},

		// Join tokens.
		{
			Name:    "joinToken.created",
			Subject: "joinToken",
			Payload: &computev1.JoinTokensServiceCreateResponse{},
			Doc:     "A join token was created (joinTokens.create). The payload is the stored response, so `token` is never set.",
		},
		{
			Name:    "joinToken.revoked",
			Subject: "joinToken",
			Payload: &computev1.JoinTokensServiceRevokeResponse{},
			Doc:     "A join token was revoked (joinTokens.revoke): it can no longer be redeemed.",
		},

		// Nodes.
		{
			Name:    "node.joined",
			Subject: "node",
			Fields:  joinFields(),
			Doc:     "New hardware redeemed a join token and became a node, adopting, with its first certificate (joinservice).",
		},
		{
			Name:    "node.reclaimed",
			Subject: "node",
			Fields:  joinFields(),
			Doc: "Hardware that had joined before joined again with a token of its tenant that allows reclaim: it got its node " +
				"back, in the token's pool, adopting again, and the old installation's certificates were revoked (joinservice).",
		},
		{
			Name:    "node.hardware_conflict",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node that just joined."},
				{"tenantId", "string", "Its tenant."},
				{"otherNodeIds", "array", "Nodes of other tenants with the same hardware key (at most 10)."},
				{"otherTenantIds", "array", "Their tenants, in the same order."},
			},
			Doc: "Hardware joined a tenant while another tenant already has a node with the same hardware key: the same " +
				"machine claimed twice (hardware claims are self-asserted). The join went ahead — keys are unique per " +
				"tenant, so no tenant can block another's — and this event, in the root tenant, tells the operator (joinservice).",
		},
		{
			Name:    "node.updated",
			Subject: "node",
			Payload: &computev1.NodesServiceUpdateResponse{},
			Doc:     "A node's labels were replaced (nodes.update); its desired state is recomputed.",
		},
		{
			Name:    "tunnel.opened",
			Subject: "node",
			Payload: &computev1.Tunnel{},
			Doc: "A caller opened a tunnel to a target on the node (tunnels.open): who, which target, why and until when. " +
				"The node's daemon connects only when its tunnels allowlist allows the target (docs/tunnels.md).",
		},
		{
			Name:    "tunnel.closed",
			Subject: "node",
			Payload: &computev1.Tunnel{},
			Doc: "A tunnel closed, at both ends: closeReason says why (closed, tunnels.close, expired, revoked, node_retired, " +
				"session_ended, refused, token_expired, unroutable, api_stopped, error); bytesIn and bytesOut are what flowed " +
				"caller to target and back.",
		},
		{
			Name:    "node.revoked",
			Subject: "node",
			Payload: &computev1.NodesServiceRevokeResponse{},
			Doc: "Every certificate of a node was revoked (nodes.revoke): its gateway closes its session within a liveness " +
				"interval and it can neither open another nor renew.",
		},
		{
			Name:    "node.spec.changed",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"generation", "integer", "The new desired-state generation."},
			},
			Doc: "A node's desired state (its NodeSpec) changed and its generation went up (the nodespec controller); the " +
				"gateway sends it to the node.",
		},
		{
			Name:    "node.not_ready",
			Subject: "node",
			Fields:  readyFields(),
			Doc: "No gateway has heard from a node for `nodes.notReadyAfter` (40 s by default): its Ready condition went from " +
				"True to Unknown (the liveness job). See [nodes](nodes.md#liveness).",
		},
		{
			Name:    "node.lost",
			Subject: "node",
			Fields:  readyFields(),
			Doc: "No gateway has heard from a node for `nodes.lostAfter` (2 min by default): its Ready condition became Lost " +
				"(from Unknown, or from True when the job had not run in between). The placer stops booking it and applies " +
				"`capacity.lostNode` to its bookings (the liveness job).",
		},
		{
			Name:    "node.ready",
			Subject: "node",
			Fields:  readyFields(),
			Doc:     "A node that was Unknown or Lost was heard from again: its Ready condition is True (the liveness job).",
		},
		{
			Name:    "node.converged",
			Subject: "node",
			Fields:  convergenceFields(),
			Doc:     "A node reported observing its current desired-state generation with no failed section (the gateway).",
		},
		{
			Name:    "node.convergence_failed",
			Subject: "node",
			Fields:  convergenceFields(),
			Doc:     "A node reported a section of its desired state failed to apply (the gateway); every report with a failed section writes one.",
		},
		{
			Name:    "node.upgrade_failed",
			Subject: "node",
			Fields: []Field{
				{Name: "nodeId", Type: "string", Doc: "The node."},
				{Name: "agentVersion", Type: "string", Doc: "The bcd version it runs (rolled back to)."},
				{Name: "reason", Type: "string", Doc: "Its agent section's reason: \"UpgradeFailed: …\" with the version and why."},
			},
			Doc: "A node's agent section reported a failed upgrade that bcd rolled back and latched (the gateway): its UpgradeFailed condition holds until nodes.clearUpgrade and its next report without it.",
		},

		// Drain and retire (the drain job, services/lifecycle).
		{
			Name:    "node.drain_requested",
			Subject: "node",
			Payload: &computev1.NodesServiceDrainResponse{},
			Doc:     "An operator drained a node (nodes.drain); the payload is the node, draining. See node.draining.",
		},
		{
			Name:    "node.retire_requested",
			Subject: "node",
			Payload: &computev1.NodesServiceRetireResponse{},
			Doc:     "An operator retired a node (nodes.retire); the payload is the node, draining towards retired.",
		},
		{
			Name:    "node.undrained",
			Subject: "node",
			Payload: &computev1.NodesServiceUndrainResponse{},
			Doc:     "A draining or drained node was returned to service (nodes.undrain): it is adopted and bookable again.",
		},
		{
			Name:    "node.draining",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"poolId", "string", "Its pool."},
				{"deadline", "string", "When its bookings must be gone (RFC 3339)."},
				{"reason", "string", "Why it is drained."},
				{"by", "string", "Who drained it: operator (nodes.drain, nodes.retire) or remediation (the remediation ladder)."},
				{"retiring", "boolean", "Whether the drain ends in retirement."},
			},
			Doc: "A node started draining, or its drain moved (the drain job): it takes no new bookings; at the deadline, or " +
				"as soon as it has no active booking, it is drained. Commands and desired state keep flowing to it.",
		},
		{
			Name:    "reservation.node_draining",
			Subject: "reservation",
			Fields: reservationFields(
				Field{"nodeId", "string", "The draining node."},
				Field{"deadline", "string", "When the reservation's bookings on it must be gone (RFC 3339)."},
				Field{"reason", "string", "Why the node is drained."}),
			Doc: "A node holding one of the reservation's bookings started draining (the drain job): at the deadline its " +
				"bookings are handled by capacity.lostNode (replace re-places them, fail ends the reservation, wait keeps them).",
		},
		{
			Name:    "reservation.device_draining",
			Subject: "reservation",
			Fields: reservationFields(
				Field{"nodeId", "string", "The node of the GPU."},
				Field{"gpuUuid", "string", "The GPU (GPU-…) whose MIG layout waits."},
				Field{"reason", "string", "Why the GPU is drained."}),
			Doc: "A new MIG layout for a GPU the reservation has booked waits for the booking to end (capacity.mig): the GPU " +
				"keeps its current layout and the rest of the node is not touched; the layout applies once the booking is gone.",
		},
		{
			Name:    "reservation.device_drained",
			Subject: "reservation",
			Fields: reservationFields(
				Field{"nodeId", "string", "The node of the GPU."},
				Field{"gpuUuid", "string", "The GPU (GPU-…) whose MIG layout change waited."},
				Field{"deviceId", "string", "The booked device the change removes: the GPU, or one of its MIG slices (MIG-…)."},
				Field{"action", "string", "What was done under capacity.lostNode: replaced (booked again elsewhere in the pool) or failed (the reservation ended)."},
				Field{"reason", "string", "Why: the layout change, and for failed why no replacement was found."}),
			Doc: "A GPU's MIG layout change removes a device the reservation has booked and capacity.lostNode is replace or " +
				"fail (the placer): the booking moved to a free GPU or slice of the same profile in the pool, or the reservation " +
				"failed; the change then applies. Under wait the booking is kept and the change waits (reservation.device_draining).",
		},
		{
			Name:    "node.drained",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"poolId", "string", "Its pool."},
				{"reason", "string", "deadline (it passed) or no_bookings (none was left)."},
			},
			Doc: "A draining node's deadline passed or its last booking ended (the drain job): it is drained, and the placer " +
				"applies capacity.lostNode to the bookings it still holds.",
		},
		{
			Name:    "node.retired",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"poolId", "string", "Its pool."},
				{"revokedCertificates", "integer", "How many of its certificates were revoked."},
			},
			Doc: "A retiring node was drained and its bookings handled (the drain job): its certificates are revoked, its " +
				"gateway closes its session within a liveness interval, it cannot reconnect, and its hardware may join again " +
				"only with a join token created after this, naming it in reclaimNodeIds.",
		},

		// GPU health, quarantine and remediation (the health job,
		// services/lifecycle).
		{
			Name:    "gpu.quarantined",
			Subject: "node",
			Fields:  gpuFields(),
			Doc: "A GPU was unhealthy or missing and is quarantined: it is not bookable until the health job sees it healthy " +
				"and present again (the health job). Its reservations get `reservation.device_unhealthy`.",
		},
		{
			Name:    "node.drifted",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"poolId", "string", "Its pool."},
				{"reasons", "array", "Why it drifted, each a sentence: a section not converged for longer than fleet.stuckAfter, an inventory value that differs from the pool's baseline, a section the daemon reports drifted."},
				{"since", "string", "Since when it has been Drifted (RFC 3339)."},
			},
			Doc: "A node's Drifted condition was raised, or its reasons changed while it holds (fleet.drift). " +
				"See [lifecycle](lifecycle.md#drift).",
		},
		{
			Name:    "node.drift_cleared",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"poolId", "string", "Its pool."},
				{"previousReasons", "array", "The reasons it had."},
			},
			Doc: "No reason of a node's Drifted condition holds any more (fleet.drift); also when a Drifted node is retired.",
		},
		{
			Name:    "gpu.recovered",
			Subject: "node",
			Fields:  gpuFields(),
			Doc:     "A quarantined GPU is healthy and present again, or a remediation step brought it back: it is bookable again (the health job).",
		},
		{
			Name:    "reservation.device_unhealthy",
			Subject: "reservation",
			Fields: reservationFields(
				Field{"nodeId", "string", "The node of the GPU."},
				Field{"deviceId", "string", "The quarantined GPU (UUID)."},
				Field{"reason", "string", "Why it was quarantined."},
				Field{"action", "string", "What was done under capacity.lostNode: replaced (a healthy GPU took its place), failed (the reservation ended) or kept (wait)."}),
			Doc: "A GPU booked by a live reservation was quarantined (the health job). Under capacity.lostNode replace a " +
				"healthy GPU is booked instead and the node stops exposing the quarantined one; under fail the reservation " +
				"fails; under wait it keeps the GPU.",
		},
		{
			Name:    "remediation.started",
			Subject: "node",
			Fields:  remediationFields(),
			Doc: "A step of a node's remediation ladder started: gpu.reset of its quarantined GPUs, then node.reboot once " +
				"the node is drained (the health job). Also a MIG step: gpu.reset of unbooked GPUs whose MIG mode change waits " +
				"for a reset, or node.reboot when the pool's MIG resetPolicy is node-reboot (reason \"MIG mode change waits for a reset: …\").",
		},
		{
			Name:    "remediation.succeeded",
			Subject: "node",
			Fields:  remediationFields(),
			Doc: "A remediation step's command succeeded and the node's next report showed its GPUs healthy: their quarantine is lifted " +
				"(the health job). A MIG step succeeds when the node reports its GPUs no longer waiting for a reset (laid out).",
		},
		{
			Name:    "remediation.failed",
			Subject: "node",
			Fields:  remediationFields(),
			Doc: "A remediation step's command failed or expired, or the GPUs were still unhealthy after it (the health job): " +
				"the ladder goes on to the next step, or the node needs repair. A MIG step ends there (a GPU still waiting starts " +
				"another while the node's remediation budget lasts).",
		},
		{
			Name:    "node.needs_repair",
			Subject: "node",
			Fields: []Field{
				{"nodeId", "string", "The node."},
				{"poolId", "string", "Its pool."},
				{"reason", "string", "Why: the steps tried, or the remediation budget spent."},
				{"failed", "boolean", "Whether the node was moved to state failed (the ladder gave up)."},
			},
			Doc: "A node's NeedsRepair condition latched: the remediation ladder gave up (the node is failed), or the node " +
				"spent health.maxRemediationsPerNode ladders in 7 days. Nothing is tried on it until nodes.clearRepair.",
		},
		{
			Name:    "node.repair_cleared",
			Subject: "node",
			Payload: &computev1.NodesServiceClearRepairResponse{},
			Doc: "A node's NeedsRepair was cleared and its remediation budget reset (nodes.clearRepair); a failed node is " +
				"adopting again, so its acceptance checks run again.",
		},

		// Eviction brakes (the liveness job, services/lifecycle).
		{
			Name:    "fleet.eviction_paused",
			Subject: "",
			Fields:  brakeFields(),
			Doc: "More than `nodes.unhealthyThreshold` (55 % by default) of a pool's nodes, or of one tenant's nodes one gateway last " +
				"held, are not ready (the liveness job): the placer's replace and fail and the remediation ladder stop acting on " +
				"that scope's lost nodes until it recovers. Tenant: the pool's, or for a gateway the scope's tenant " +
				"(scope `gateway:<id>/tenant:<tenant>`). See [lifecycle](lifecycle.md#eviction-brakes).",
		},
		{
			Name:    "fleet.eviction_resumed",
			Subject: "",
			Fields:  brakeFields(),
			Doc: "A paused scope has at most `nodes.unhealthyThreshold` of its nodes not ready again (the liveness job): " +
				"actions on its lost nodes resume, at `nodes.evictionRate`.",
		},

		// Policies.
		{
			Name:    "policy.put",
			Subject: "policy",
			Payload: &computev1.PoliciesServicePutResponse{},
			Doc:     "A tenant's policy was created or replaced (policies.put). Its subject is `<tenantId>/<name>`.",
		},
		{
			Name:    "policy.deleted",
			Subject: "policy",
			Fields: []Field{
				{"tenantId", "string", "The policy's tenant."},
				{"name", "string", "The policy's name."},
			},
			Doc: "A tenant's policy was deleted (policies.delete). Its subject is `<tenantId>/<name>`.",
		},

		// Pools.
		{
			Name:    "pool.created",
			Subject: "pool",
			Payload: &computev1.PoolsServiceCreateResponse{},
			Doc:     "A pool was created (pools.create).",
		},
		{
			Name:    "pool.updated",
			Subject: "pool",
			Payload: &computev1.PoolsServiceUpdateResponse{},
			Doc:     "A pool was changed (pools.update); a changed site, health, runtime or agent section gives every node of the pool a new desired state.",
		},

		// Rollouts (docs/rollouts.md).
		{
			Name:    "rollout.created",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"mask", "array", "The sections it changes."},
			},
			Doc: "A rollout of a change of a pool's settings was made (rollouts.create); the rollout job plans and starts it.",
		},
		{
			Name:    "rollout.started",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"nodes", "integer", "Its nodes."},
				{"batches", "integer", "Its batches."},
			},
			Doc: "The rollout job cut the rollout's nodes into batches, spread across gateways (and rack and zone labels), and started it.",
		},
		{
			Name:    "rollout.batch_released",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"batch", "integer", "The batch (0-based)."},
				{"nodes", "array", "The nodes released."},
			},
			Doc: "Nodes of a batch got the rollout's content (a batch is released in parts while the disruption budget is spent).",
		},
		{
			Name:    "rollout.batch_succeeded",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"batch", "integer", "The batch (0-based)."},
			},
			Doc: "Every released node of a batch converged healthy and the bake passed.",
		},
		{
			Name:    "rollout.node_skipped",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"nodeId", "string", "The node."},
				{"reason", "string", "Why it is unhealthy."},
			},
			Doc: "A node was unhealthy when its batch came: it keeps the old content and does not count.",
		},
		{
			Name:    "rollout.node_failed",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"nodeId", "string", "The node."},
				{"reason", "string", "Why it is unhealthy."},
			},
			Doc: "A node turned unhealthy after its change: it counts towards the failure threshold.",
		},
		{
			Name:    "rollout.paused",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"reason", "string", "Why."},
				{"nodes", "array", "The failed nodes, when the threshold paused it."},
			},
			Doc: "The rollout stopped releasing batches: rollouts.pause, or its failure threshold reached (nodes names the failed nodes).",
		},
		{
			Name:    "rollout.resumed",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
			},
			Doc: "A paused rollout continues (rollouts.resume); the failures so far are acknowledged.",
		},
		{
			Name:    "rollout.succeeded",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"healthy", "integer", "Nodes that ended healthy."},
				{"skipped", "integer", "Nodes skipped."},
			},
			Doc: "Every batch is done: the change is now the pool's settings.",
		},
		{
			Name:    "rollout.failed",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"healthy", "integer", "Nodes that ended healthy."},
				{"required", "integer", "The success threshold."},
			},
			Doc: "Every batch is done but fewer nodes than the success threshold ended healthy; the pool's settings are unchanged and the nodes return to them.",
		},
		{
			Name:    "rollout.cancelled",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"nodes", "array", "The nodes that return."},
			},
			Doc: "The rollout was cancelled (rollouts.cancel): the nodes it changed return to the pool's settings.",
		},
		{
			Name:    "rollout.rolled_back",
			Subject: "rollout",
			Fields: []Field{
				{"rolloutId", "string", "The rollout."},
				{"poolId", "string", "Its pool."},
				{"nodes", "array", "The nodes that return."},
			},
			Doc: "The rollout was rolled back (rollouts.rollback): every node it touched gets its previous content at once.",
		},

		// Capacity.
		{
			Name:    "quota.set",
			Subject: "pool",
			Payload: &computev1.CapacityServiceSetQuotaResponse{},
			Doc:     "A tenant's GPU quota in a pool was set or removed (capacity.setQuota); `quota` is unset when it was removed.",
		},
		{
			Name:    "reservation.created",
			Subject: "reservation",
			Payload: &computev1.ReservationsServiceCreateResponse{},
			Doc:     "A reservation that starts later was created (reservations.create); it is pending until the placer places it (`reservation.placed`).",
		},
		{
			Name:    "reservation.placed",
			Subject: "reservation",
			Payload: &computev1.ReservationsServiceCreateResponse{},
			Doc: "A reservation's GPUs were booked on nodes. reservations.create writes it when the reservation starts now and " +
				"fits, with the stored response as its payload; the placer writes it when it places a pending reservation later, " +
				"with the payload `{reservationId}` only.",
		},
		{
			Name:    "reservation.bound",
			Subject: "reservation",
			Fields:  reservationFields(),
			Doc:     "Every node booked for a placed reservation has observed a desired state that exposes its GPUs: the reservation is usable (capacity.bind).",
		},
		{
			Name:    "reservation.replaced",
			Subject: "reservation",
			Fields: reservationFields(
				Field{"lostNodeId", "string", "The lost node whose GPUs were re-placed."}),
			Doc: "A node booked for a live reservation was lost and, under capacity.lostNode replace, its GPUs were booked on " +
				"other nodes (the placer).",
		},
		{
			Name:    "reservation.released",
			Subject: "reservation",
			Payload: &computev1.ReservationsServiceReleaseResponse{},
			Doc:     "A reservation was released (reservations.release); its bookings ended.",
		},
		{
			Name:    "reservation.expired",
			Subject: "reservation",
			Fields:  reservationFields(),
			Doc:     "A live reservation's end time passed; its bookings ended (the placer).",
		},
		{
			Name:    "reservation.failed",
			Subject: "reservation",
			Fields: reservationFields(
				Field{"reason", "string", "Why, e.g. the lost node and why its GPUs could not be re-placed."}),
			Doc: "A live reservation failed because a booked node was lost: capacity.lostNode is fail, or it is replace and " +
				"the GPUs could not be re-placed (the placer). Its bookings ended.",
		},

		// Instances.
		{
			Name:    "instance.created",
			Subject: "instance",
			Payload: &computev1.InstancesServiceCreateResponse{},
			Doc:     "An instance was created (instances.create) and waits to be placed (a provider pool's, once built).",
		},
		{
			Name:    "instance.placed",
			Subject: "instance",
			Payload: &computev1.InstancesServiceCreateResponse{},
			Doc: "An instance was created (instances.create) and its vCPUs, memory, disk and GPUs claimed on a host of a " +
				"hosted pool; the host's desired state now includes it.",
		},
		{
			Name:    "instance.stopped",
			Subject: "instance",
			Payload: &computev1.InstancesServiceStopResponse{},
			Doc:     "An instance's desired power state was set to stopped (instances.stop); it keeps its capacity.",
		},
		{
			Name:    "instance.started",
			Subject: "instance",
			Payload: &computev1.InstancesServiceStartResponse{},
			Doc:     "An instance's desired power state was set to running (instances.start).",
		},
		{
			Name:    "instance.resized",
			Subject: "instance",
			Payload: &computev1.InstancesServiceResizeResponse{},
			Doc:     "An instance was given a new size (instances.resize); the difference was claimed on or released from its host.",
		},
		{
			Name:    "instance.deleted",
			Subject: "instance",
			Payload: &computev1.InstancesServiceDeleteResponse{},
			Doc:     "An instance was deleted (instances.delete); its capacity was released and its host removes it.",
		},
		{
			Name:    "instanceQuota.set",
			Subject: "pool",
			Payload: &computev1.InstancesServiceSetQuotaResponse{},
			Doc:     "A tenant's instance quota in a hosted pool was set or removed (instances.setQuota); `quota` is unset when it was removed.",
		},

		// Sites.
		{
			Name:    "site.created",
			Subject: "site",
			Payload: &computev1.SitesServiceCreateResponse{},
			Doc:     "A site was created (sites.create).",
		},
		{
			Name:    "site.deleted",
			Subject: "site",
			Payload: &computev1.SitesServiceDeleteResponse{},
			Doc:     "A site was deleted with its tokens and agents (sites.delete); the payload is the site as it was.",
		},
		{
			Name:    "siteToken.created",
			Subject: "site",
			Payload: &computev1.SitesServiceCreateTokenResponse{},
			Doc:     "A site token was minted (sites.createToken). The payload is the stored response, so `token` is never set.",
		},
		{
			Name:    "siteToken.revoked",
			Subject: "site",
			Payload: &computev1.SitesServiceRevokeTokenResponse{},
			Doc:     "A site token was revoked (sites.revokeToken).",
		},
		{
			Name:    "site.agent_enrolled",
			Subject: "site",
			Fields: []Field{
				{"siteId", "string", "The site."},
				{"agentId", "string", "The new site agent (sag_…)."},
				{"siteTokenId", "string", "The site token it redeemed."},
				{"hostname", "string", "The agent's host name."},
			},
			Doc: "A `bcd site` redeemed a site token and became a site agent of the site, with its first certificate (joinservice).",
		},
		{
			Name:    "site.agent_revoked",
			Subject: "site",
			Payload: &computev1.SitesServiceRevokeAgentResponse{},
			Doc:     "A site agent was revoked (sites.revokeAgent): its certificates stop working and its boot lease ends.",
		},

		// Bare-metal machines.
		{
			Name:    "machine.enrolled",
			Subject: "machine",
			Payload: &computev1.MetalServiceEnrollResponse{},
			Doc: "A machine was enrolled (metal.enroll) and commissioning starts. The payload names neither the " +
				"credentials nor their secret: `bmcCredentialsRef` is left out of every machine.* event (metal.get shows it).",
		},
		{
			Name:    "machine.deploy_requested",
			Subject: "machine",
			Payload: &computev1.MetalServiceDeployResponse{},
			Doc:     "A deploy of an image to a ready machine was asked for (metal.deploy). The payload never holds the cloud-init user data, only its size.",
		},
		{
			Name:    "machine.release_requested",
			Subject: "machine",
			Payload: &computev1.MetalServiceReleaseResponse{},
			Doc:     "A machine is to be wiped back to ready (metal.release).",
		},
		{
			Name:    "machine.retried",
			Subject: "machine",
			Payload: &computev1.MetalServiceRetryResponse{},
			Doc:     "A failed machine resumes at the step it failed in (metal.retry).",
		},
		{
			Name:    "machine.rescue_requested",
			Subject: "machine",
			Payload: &computev1.MetalServiceRescueResponse{},
			Doc:     "A machine is to boot its ramdisk and stay there for a person (metal.rescue).",
		},
		{
			Name:    "machine.deleted",
			Subject: "machine",
			Payload: &computev1.MetalServiceDeleteResponse{},
			Doc:     "A machine was deleted (metal.delete), with its credentials when no other machine used them; the payload is the machine as it was.",
		},
		{
			Name:    "machine.state_changed",
			Subject: "machine",
			Fields: []Field{
				{"machineId", "string", "The machine."},
				{"from", "string", "The state it left."},
				{"to", "string", "The state it entered."},
				{"purpose", "string", "Why it is in the flow: commission, deploy, release or rescue."},
				{"reason", "string", "What moved it (the step's outcome)."},
			},
			Doc: "The metal workflow moved a machine to its next step.",
		},
		{
			Name:    "machine.failed",
			Subject: "machine",
			Fields: []Field{
				{"machineId", "string", "The machine."},
				{"failedStep", "string", "The step it failed in (metal.retry resumes there)."},
				{"purpose", "string", "Why it was in the flow."},
				{"attempts", "integer", "The attempts the step had."},
				{"reason", "string", "Why the last attempt failed."},
			},
			Doc: "A step of the metal workflow failed past its attempts; the machine is failed until metal.retry, metal.release or metal.rescue.",
		},

		// Tenants.
		{
			Name:    "tenant.created",
			Subject: "tenant",
			Payload: &computev1.TenantsServiceCreateResponse{},
			Doc:     "A child tenant was created (tenants.create). The event belongs to the parent tenant; its subject is the new tenant.",
		},

		// Webhooks.
		{
			Name:    "webhook.created",
			Subject: "webhook",
			Payload: &computev1.WebhooksServiceCreateResponse{},
			Doc:     "A webhook was registered (webhooks.create). The payload is the stored response, so `secret` is never set.",
		},
		{
			Name:    "webhook.updated",
			Subject: "webhook",
			Payload: &computev1.WebhooksServiceUpdateResponse{},
			Doc:     "A webhook was changed (webhooks.update), including being enabled or disabled by request.",
		},
		{
			Name:    "webhook.deleted",
			Subject: "webhook",
			Payload: &computev1.WebhooksServiceDeleteResponse{},
			Doc:     "A webhook was deleted with its pending deliveries (webhooks.delete); the payload is the webhook as it was.",
		},
		{
			Name:    "webhook.secret_rotated",
			Subject: "webhook",
			Payload: &computev1.WebhooksServiceRotateSecretResponse{},
			Doc: "A webhook's signing secret was rotated (webhooks.rotateSecret); the old one signs beside the new one until " +
				"`webhook.previousSecretExpireTime`. `secret` is never set in the event.",
		},
		{
			Name:    "webhook.test",
			Subject: "webhook",
			Fields: []Field{
				{"webhookId", "string", "The webhook tested."},
				{"message", "string", "A note saying it is a test (\"a test event from webhooks.test\")."},
			},
			Doc: "A test of a webhook (webhooks.test): delivered to that webhook only, whatever event types it subscribes to.",
		},
		{
			Name:    "webhook.tested",
			Subject: "webhook",
			Payload: &computev1.WebhooksServiceTestResponse{},
			Doc: "A webhook was tested (webhooks.test): a `webhook.test` event and its one delivery, to that webhook, were " +
				"written; the payload is the delivery.",
		},
		{
			Name:    "webhook.redelivered",
			Subject: "webhook",
			Payload: &computev1.WebhooksServiceRedeliverResponse{},
			Doc:     "A delivery was made pending again, to be sent now whatever its state (webhooks.redeliver); the payload is the delivery. Its subject is the delivery's webhook.",
		},
		{
			Name:    "webhook.disabled",
			Subject: "webhook",
			Fields: []Field{
				{"webhookId", "string", "The webhook."},
				{"reason", "string", "gone (the endpoint answered 410) or failing (every attempt failed for 5 days)."},
				{"lastStatusCode", "integer", "The last attempt's HTTP status code; 0 when none answered."},
				{"lastError", "string", "The last attempt's error."},
			},
			Doc: "Delivery disabled a webhook: its endpoint answered 410 Gone, or every attempt failed for 5 days. Its " +
				"deliveries stay pending until it is enabled again (webhooks.update) or they expire.",
		},
	}
}
