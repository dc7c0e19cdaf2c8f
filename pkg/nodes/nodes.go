// Package nodes stores nodes — the GPU servers (and VPS hosts) joined to a
// pool — and their devices.
//
// A node is inserted "adopting" by joinservice, with shard = shard.Of(id);
// the lifecycle controller adopts it. A node presenting a hardware key that
// is already known takes back its old id when its join token allows it
// ([Reclaim]).
//
// This package is the only writer of the nodes table: every statement that
// inserts, updates or deletes a node is here, one documented function per
// write, and a test fails when one appears anywhere else in the
// repository. Callers pass their transaction (a [Querier]) and keep their
// fences in it; the guards each write needs — a generation that never goes
// backwards, a session epoch that fences a superseded session's late
// writes — are in the statements themselves.
package nodes

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// States of a node.
const (
	StateAdopting = "adopting"
	StateAdopted  = "adopted"
	StateDraining = "draining"
	StateDrained  = "drained"
	StateFailed   = "failed"
	StateRetired  = "retired"
	// StateCommissioning: a machine's ramdisk (bcd ramdisk) joined as the
	// node; it is never adopted, and never placed, until the installed
	// system joins with a token naming the node (it is adopting then).
	StateCommissioning = "commissioning"
)

// States lists every state.
var States = []string{StateAdopting, StateAdopted, StateDraining, StateDrained, StateFailed, StateRetired, StateCommissioning}

// Node is one node.
type Node struct {
	ID                 string
	TenantID           string
	PoolID             string
	State              string
	Shard              int
	Labels             map[string]string
	Hostname           string
	HardwareKey        string
	JoinTokenID        string
	Generation         int64
	ObservedGeneration int64
	BootID             string
	JournalID          string
	SessionEpoch       int64
	GatewayID          string
	// SpecError says why the node's desired state could not be computed;
	// empty when it could.
	SpecError string
	// Sections is the node's last per-section convergence report.
	Sections []SectionStatus
	// Conditions are what the inventory controller last concluded.
	Conditions []Condition
	// Ready is the node's Ready condition, the liveness job's (see
	// [UpdateReadiness]): [ReadyTrue], [ReadyUnknown] or [ReadyLost], why,
	// and since when.
	Ready       string
	ReadyReason string
	ReadySince  time.Time
	LastSeenAt  *time.Time
	CreatedAt   time.Time
	UpdatedAt   time.Time
	// Drain: while draining, when its bookings must be gone; why; who
	// drained it ([DrainByOperator] or [DrainByRemediation]); since when;
	// and whether the drain ends in retirement.
	DrainDeadline  *time.Time
	DrainReason    string
	DrainBy        string
	DrainStartedAt *time.Time
	Retiring       bool
	RetiredAt      *time.Time
	// NeedsRepair is latched by the remediation ladder until
	// nodes.clearRepair: why, and since when.
	NeedsRepair       bool
	NeedsRepairReason string
	NeedsRepairSince  *time.Time
	// AgentVersion is the bcd version its latest session's Hello
	// reported. UpgradeFailed is its agent section's reason while that
	// reports a latched failed upgrade ("UpgradeFailed: …"), since
	// UpgradeFailedSince; "" otherwise.
	AgentVersion       string
	UpgradeFailed      string
	UpgradeFailedSince *time.Time
	// Devices are filled by [Get] and [List].
	Devices []Device
}

// Device is one device of a node (a GPU).
type Device struct {
	ID           string // the GPU's UUID
	Kind         string
	Index        int
	Model        string
	Serial       string
	MemoryBytes  int64
	PCIBusID     string
	MIGEnabled   bool
	Healthy      bool
	HealthReason string
	// MissingSince is set once the device stopped being reported.
	MissingSince *time.Time
	// QuarantinedAt is set while the health job keeps the device out of
	// service (unhealthy or missing); QuarantineReason says why.
	QuarantinedAt    *time.Time
	QuarantineReason string
	// MigSlices are a GPU's MIG slices (devices of kind mig whose parent
	// it is), by start; never listed as devices of their own.
	MigSlices []MigSlice
}

// MigSlice is a MIG slice of a GPU as the node last reported it.
type MigSlice struct {
	ID            string // the slice's UUID (MIG-…)
	Profile       string
	Start         int
	MemoryBytes   int64
	ComputeSlices int
	GPUInstanceID int
	// MissingSince is set once the slice stopped being reported.
	MissingSince *time.Time
	// ReservationID is the reservation with an active booking of it.
	ReservationID string
}

// Who drained a node (nodes.drain_by).
const (
	DrainByOperator    = "operator"
	DrainByRemediation = "remediation"
)

// SectionStatus is one section's convergence as the node last reported it.
type SectionStatus struct {
	Section    string `json:"section"`
	State      string `json:"state"`
	Reason     string `json:"reason"`
	Generation int64  `json:"generation"`
}

// Condition is one node condition (nodes.conditions, written by the
// inventory controller, and Drifted by fleet.drift).
type Condition struct {
	Type   string    `json:"type"`
	Status bool      `json:"status"`
	Reason string    `json:"reason,omitempty"`
	Since  time.Time `json:"since"`
	// Reasons lists each reason of a condition that can have several
	// (Drifted); Reason then joins them.
	Reasons []string `json:"reasons,omitempty"`
}

// Schedulable reports whether placement may book the node's devices: it is
// adopted and has applied desired state.
func (n Node) Schedulable() bool { return n.State == StateAdopted && n.ObservedGeneration >= 1 }

const cols = `id, tenant_id, pool_id, state, shard, labels, hostname, hardware_key, coalesce(join_token_id, ''),
	generation, observed_generation, boot_id, journal_id, session_epoch, gateway_id, coalesce(spec_error, ''), last_seen_at, created_at, updated_at,
	CASE WHEN jsonb_typeof(section_status) = 'array' THEN section_status ELSE '[]' END, conditions,
	ready, ready_reason, ready_since,
	drain_deadline, drain_reason, drain_by, drain_started_at, retiring, retired_at,
	needs_repair, needs_repair_reason, needs_repair_since,
	agent_version, upgrade_failed, upgrade_failed_at`

func scan(r pgx.Row) (Node, error) {
	var n Node
	err := r.Scan(&n.ID, &n.TenantID, &n.PoolID, &n.State, &n.Shard, &n.Labels, &n.Hostname, &n.HardwareKey, &n.JoinTokenID,
		&n.Generation, &n.ObservedGeneration, &n.BootID, &n.JournalID, &n.SessionEpoch, &n.GatewayID, &n.SpecError, &n.LastSeenAt,
		&n.CreatedAt, &n.UpdatedAt, &n.Sections, &n.Conditions, &n.Ready, &n.ReadyReason, &n.ReadySince,
		&n.DrainDeadline, &n.DrainReason, &n.DrainBy, &n.DrainStartedAt, &n.Retiring, &n.RetiredAt,
		&n.NeedsRepair, &n.NeedsRepairReason, &n.NeedsRepairSince,
		&n.AgentVersion, &n.UpgradeFailed, &n.UpgradeFailedSince)
	return n, err
}

// ErrHardwareTaken is wrapped by [Create]'s CONFLICT when a node of the
// same tenant with the same hardware key exists.
var ErrHardwareTaken = errors.New("a node with this hardware key exists")

// Create inserts n in shard shard.Of(n.ID), adopting (or n.State when it
// is [StateCommissioning]: a ramdisk's join). A hardware key already in use
// in n's tenant is CONFLICT on "claims" wrapping [ErrHardwareTaken];
// hardware keys are unique per tenant (see [OthersWithHardwareKey]).
func Create(ctx context.Context, q Querier, n Node) (Node, error) {
	if n.Labels == nil {
		n.Labels = map[string]string{}
	}
	state, err := joinState(n.State)
	if err != nil {
		return Node{}, err
	}
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO nodes (id, tenant_id, pool_id, state, shard, labels, hostname, hardware_key, join_token_id)
		VALUES ($1, $2, $3, $9, $4, $5, $6, $7, nullif($8, '')) RETURNING `+cols,
		n.ID, n.TenantID, n.PoolID, shard.Of(n.ID), n.Labels, n.Hostname, n.HardwareKey, n.JoinTokenID, state))
	if isHardwareTaken(err) {
		return Node{}, fault.Wrap(ErrHardwareTaken, fault.Conflict, "claims", "this hardware has already joined; join with a token that allows reclaim to take its node back")
	}
	if err != nil {
		return Node{}, fmt.Errorf("insert node: %w", err)
	}
	return out, nil
}

// joinState is the state a join leaves a node in: adopting, or
// commissioning when asked.
func joinState(s string) (string, error) {
	switch s {
	case "", StateAdopting:
		return StateAdopting, nil
	case StateCommissioning:
		return StateCommissioning, nil
	}
	return "", fmt.Errorf("a join leaves a node adopting or commissioning, not %q", s)
}

func isHardwareTaken(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == "nodes_tenant_hardware_key"
}

// Lock reads node id locked for update, and whether it exists.
func Lock(ctx context.Context, q Querier, id string) (Node, bool, error) {
	n, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM nodes WHERE id = $1 FOR UPDATE`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, false, nil
	}
	if err != nil {
		return Node{}, false, fmt.Errorf("read node %s: %w", id, err)
	}
	return n, true, nil
}

// TakeBack hands node n.ID to a join with a token naming it, whatever
// hardware it had: it takes n's pool, labels, hostname, hardware key, join
// token and state (adopting, or [StateCommissioning] for a ramdisk), and
// forgets its session, boot and any drain, like [Reclaim]. A hardware key
// that is another node's of the tenant is CONFLICT on "claims" wrapping
// [ErrHardwareTaken].
func TakeBack(ctx context.Context, q Querier, n Node) (Node, error) {
	if n.Labels == nil {
		n.Labels = map[string]string{}
	}
	state, err := joinState(n.State)
	if err != nil {
		return Node{}, err
	}
	out, err := scan(q.QueryRow(ctx, `
		UPDATE nodes SET pool_id = $2, hostname = $3, join_token_id = nullif($4, ''), labels = $5, hardware_key = $6, state = $7,
			boot_id = '', journal_id = '', gateway_id = '', updated_at = now(),
			drain_deadline = NULL, drain_reason = '', drain_by = '', drain_started_at = NULL, retiring = false
		WHERE id = $1 RETURNING `+cols, n.ID, n.PoolID, n.Hostname, n.JoinTokenID, n.Labels, n.HardwareKey, state))
	if isHardwareTaken(err) {
		return Node{}, fault.Wrap(ErrHardwareTaken, fault.Conflict, "claims", "this hardware is another node of the tenant; retire that node before node %s takes it", n.ID)
	}
	if err != nil {
		return Node{}, fmt.Errorf("take back node %s: %w", n.ID, err)
	}
	return out, nil
}

// ByHardwareKey returns tenant's node with hardware key key, locked for
// update, and whether there is one.
func ByHardwareKey(ctx context.Context, q Querier, tenant, key string) (Node, bool, error) {
	n, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM nodes WHERE tenant_id = $1 AND hardware_key = $2 FOR UPDATE`, tenant, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, false, nil
	}
	if err != nil {
		return Node{}, false, fmt.Errorf("read node by hardware key: %w", err)
	}
	return n, true, nil
}

// OthersWithHardwareKey returns the nodes of tenants other than tenant with
// hardware key key: the same hardware claimed in two tenants, which
// joinservice reports (node.hardware_conflict) instead of refusing, so that
// one tenant cannot block another's join by claiming its hardware first.
func OthersWithHardwareKey(ctx context.Context, q Querier, tenant, key string) ([]Node, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM nodes WHERE hardware_key = $1 AND tenant_id <> $2 ORDER BY id LIMIT 10`, key, tenant)
	if err != nil {
		return nil, fmt.Errorf("read nodes by hardware key: %w", err)
	}
	defer rows.Close()
	var out []Node
	for rows.Next() {
		n, err := scan(rows)
		if err != nil {
			return nil, fmt.Errorf("read nodes by hardware key: %w", err)
		}
		out = append(out, n)
	}
	return out, rows.Err()
}

// Reclaim hands node id back to re-joining hardware: it moves to pool with
// labels, becomes adopting again, and forgets its session, boot and any
// drain (a retired node's retired_at stays, for the record).
func Reclaim(ctx context.Context, q Querier, id, pool, hostname, tokenID string, labels map[string]string) (Node, error) {
	if labels == nil {
		labels = map[string]string{}
	}
	n, err := scan(q.QueryRow(ctx, `
		UPDATE nodes SET pool_id = $2, hostname = $3, join_token_id = $4, labels = $5, state = 'adopting',
			boot_id = '', journal_id = '', gateway_id = '', updated_at = now(),
			drain_deadline = NULL, drain_reason = '', drain_by = '', drain_started_at = NULL, retiring = false
		WHERE id = $1 RETURNING `+cols, id, pool, hostname, tokenID, labels))
	if err != nil {
		return Node{}, fmt.Errorf("reclaim node %s: %w", id, err)
	}
	return n, nil
}

// Lookup reads a node by id alone (no tenant), for joinservice and the
// gateway; NOT_FOUND otherwise.
func Lookup(ctx context.Context, q Querier, id string) (Node, error) {
	n, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM nodes WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, fault.New(fault.NotFound, "id", "node %q not found", id)
	}
	if err != nil {
		return Node{}, fmt.Errorf("read node %s: %w", id, err)
	}
	return n, nil
}

// NotInTenant returns the ids among ids that name no node of tenant (a
// node of another tenant, or none), in the order given.
func NotInTenant(ctx context.Context, q Querier, tenant string, ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `
		SELECT w.id FROM unnest($2::text[]) WITH ORDINALITY AS w(id, n)
		WHERE NOT EXISTS (SELECT 1 FROM nodes WHERE nodes.id = w.id AND nodes.tenant_id = $1)
		ORDER BY w.n`, tenant, ids)
	if err != nil {
		return nil, fmt.Errorf("check nodes of tenant %s: %w", tenant, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Get reads one node of tenant with its devices; NOT_FOUND on "id"
// otherwise.
func Get(ctx context.Context, q Querier, tenant, id string) (Node, error) {
	n, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM nodes WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, fault.New(fault.NotFound, "id", "node %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Node{}, fmt.Errorf("read node %s: %w", id, err)
	}
	ns := []Node{n}
	if err := withDevices(ctx, q, ns); err != nil {
		return Node{}, err
	}
	return ns[0], nil
}

// Filter selects nodes of a tenant.
type Filter struct {
	// TenantID is required.
	TenantID string
	// PoolID, State: only nodes with this pool or state, when set.
	PoolID string
	State  string
	// Labels: only nodes carrying every one of these labels.
	Labels map[string]string
	// Condition: only nodes with this condition, when set (see
	// [ParseCondition]); a bad one is INVALID_INPUT on "condition".
	Condition string
}

// List returns up to limit nodes matching f with ids after after, in id
// order, with their devices.
func List(ctx context.Context, q Querier, f Filter, after string, limit int) ([]Node, error) {
	labels := f.Labels
	if labels == nil {
		labels = map[string]string{}
	}
	var cond string
	var arg any
	if f.Condition != "" {
		c, err := ParseCondition(f.Condition)
		if err != nil {
			return nil, err
		}
		cond, arg = c.sql("$7")
	} else {
		cond = "($7::text IS NULL)"
	}
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM nodes
		WHERE tenant_id = $1 AND ($2 = '' OR pool_id = $2) AND ($3 = '' OR state = $3) AND labels @> $4
		AND id > $5 AND `+cond+` ORDER BY id LIMIT $6`, f.TenantID, f.PoolID, f.State, labels, after, limit, arg)
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	ns, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Node, error) { return scan(r) })
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	if err := withDevices(ctx, q, ns); err != nil {
		return nil, err
	}
	return ns, nil
}

// withDevices fills the devices of ns with one query.
func withDevices(ctx context.Context, q Querier, ns []Node) error {
	if len(ns) == 0 {
		return nil
	}
	ids := make([]string, len(ns))
	at := make(map[string]int, len(ns))
	for i, n := range ns {
		ids[i], at[n.ID] = n.ID, i
	}
	rows, err := q.Query(ctx, `SELECT d.node_id, d.id, d.kind, d.index, d.model, d.serial, d.memory_bytes, d.pci_bus_id, d.mig_enabled,
		d.healthy, d.health_reason, d.missing_since, d.quarantined_at, d.quarantine_reason,
		d.parent_id, d.profile, d.mig_start, d.compute_slices, d.gpu_instance_id,
		coalesce((SELECT b.reservation_id FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active AND d.kind = 'mig'), '')
		FROM devices d WHERE d.node_id = ANY($1) ORDER BY d.node_id, d.index, d.mig_start, d.id`, ids)
	if err != nil {
		return fmt.Errorf("list devices: %w", err)
	}
	defer rows.Close()
	type parent struct{ node, id string }
	sliceOf := map[parent][]MigSlice{}
	for rows.Next() {
		var node, parentID, rsv string
		var d Device
		var s MigSlice
		if err := rows.Scan(&node, &d.ID, &d.Kind, &d.Index, &d.Model, &d.Serial, &d.MemoryBytes, &d.PCIBusID,
			&d.MIGEnabled, &d.Healthy, &d.HealthReason, &d.MissingSince, &d.QuarantinedAt, &d.QuarantineReason,
			&parentID, &s.Profile, &s.Start, &s.ComputeSlices, &s.GPUInstanceID, &rsv); err != nil {
			return fmt.Errorf("list devices: %w", err)
		}
		if d.Kind == KindMig {
			s.ID, s.MemoryBytes, s.MissingSince, s.ReservationID = d.ID, d.MemoryBytes, d.MissingSince, rsv
			sliceOf[parent{node, parentID}] = append(sliceOf[parent{node, parentID}], s)
			continue
		}
		ns[at[node]].Devices = append(ns[at[node]].Devices, d)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("list devices: %w", err)
	}
	for i := range ns {
		for j := range ns[i].Devices {
			ns[i].Devices[j].MigSlices = sliceOf[parent{ns[i].ID, ns[i].Devices[j].ID}]
		}
	}
	return nil
}

// Spec is a node's desired state as stored.
type Spec struct {
	// JSON is the proto3 JSON of bettercompute.agent.v1.NodeSpec; "{}"
	// before the first computation.
	JSON               []byte
	Generation         int64
	ObservedGeneration int64
	// Error says why the latest computation failed; empty when it did not.
	Error string
}

// GetSpec reads the desired state of node id of tenant; NOT_FOUND on "id"
// otherwise.
func GetSpec(ctx context.Context, q Querier, tenant, id string) (Spec, error) {
	var s Spec
	err := q.QueryRow(ctx, `SELECT spec::text, generation, observed_generation, coalesce(spec_error, '')
		FROM nodes WHERE tenant_id = $1 AND id = $2`, tenant, id).Scan(&s.JSON, &s.Generation, &s.ObservedGeneration, &s.Error)
	if errors.Is(err, pgx.ErrNoRows) {
		return Spec{}, fault.New(fault.NotFound, "id", "node %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Spec{}, fmt.Errorf("read spec of node %s: %w", id, err)
	}
	return s, nil
}
