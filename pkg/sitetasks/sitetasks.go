// Package sitetasks stores site tasks (table site_tasks, migration 00024):
// how the control plane asks the site agent holding a site's boot lease to
// act on a machine — read its BMC's inventory (bmc.inspect), power it
// (bmc.power), set a one-time boot (bmc.boot), make the boot server answer
// its MACs (pxe.arm) or forget them (pxe.disarm).
//
// It is the pattern of node commands (pkg/commands) without a node session:
//
//   - A producer (the metal workflow) reads the holder's key with [SealKey],
//     seals the task's secret to it (proto/credseal, with
//     credseal.TaskAAD(id, machine) as additional data), and queues the
//     task with [Enqueue] in its own transaction; its transaction wakes the
//     site's gateway after commit (reconcile.Queue.WakeSiteTasks).
//   - The gateway holding the lease holder's session [Claim]s the site's
//     due tasks (in flight, attempts + 1, under the holder's lease epoch and
//     session, checked with sites.CheckFence in the same transaction) on a
//     poke and on every liveness tick, and sends them; it stores each
//     [Complete] or [Fail] only from that agent, under that epoch and
//     attempt, while the agent still holds the lease. Both enqueue the
//     producer's reconcile job ("metal", keyed by machine) in the same
//     transaction.
//   - A task in flight whose holder, epoch or session is no longer the
//     site's current one is claimed again by the current holder (a new
//     attempt). A task whose secret is sealed to a key that is no longer the
//     holder's is not sent: it is marked NeedsReseal and the producer's job
//     is woken to seal it again ([Reseal]).
//   - [Expire] ends tasks past their not_after; [Prune] deletes finished
//     tasks after [Retention].
//
// Payloads never hold a secret: Task.Sealed, a JWE only the holder's
// session can open, does.
package sitetasks

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/secret"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

// Kinds.
const (
	KindBMCInspect = "bmc.inspect"
	KindBMCPower   = "bmc.power"
	KindBMCBoot    = "bmc.boot"
	KindPXEArm     = "pxe.arm"
	KindPXEDisarm  = "pxe.disarm"
)

// ReconcileKind is the metal workflow's work-queue kind (keyed by machine
// id): the API enqueues it on every metal mutation, and it is woken
// whenever a task of the machine finishes, expires or needs resealing.
const ReconcileKind = "metal"

// State is a task's state.
type State string

// States.
const (
	Pending   State = "pending"
	InFlight  State = "in_flight"
	Succeeded State = "succeeded"
	Failed    State = "failed"
	Expired   State = "expired"
)

// Limits.
const (
	// Retention is how long finished tasks are kept.
	Retention = 7 * 24 * time.Hour
	// MaxOpenPerSite bounds a site's pending and in-flight tasks.
	MaxOpenPerSite = 10_000
	// MaxClaim bounds one claim.
	MaxClaim = 64
	// MaxNotAfter bounds how far away a task's deadline may be.
	MaxNotAfter = 24 * time.Hour
	// MaxMACs bounds a pxe task's MACs.
	MaxMACs = 64
	// MaxArgs bounds pxe.arm's kernel arguments.
	MaxArgs = 64
	// MaxError bounds a stored error.
	MaxError = 4096
	// MaxIDLen bounds ids (machine, site, agent).
	MaxIDLen = 64
	// MaxURLLen bounds a BMC address or image URL.
	MaxURLLen = 2048
	// MaxCAPEM bounds a pinned BMC CA.
	MaxCAPEM = 64 << 10
	// MaxListed bounds [ListByMachine].
	MaxListed = 1000
)

// ErrStale is wrapped by a result refused because the task is no longer
// in flight under the caller's claim (another attempt, another holder, an
// older epoch, or it already finished).
var ErrStale = errors.New("stale site task result")

// BMC says how to reach a machine's BMC; its credentials are sealed.
type BMC struct {
	// Address is the Redfish endpoint, https://host[:port].
	Address string `json:"address"`
	// CAPEM pins the BMC's CA; CertificateSHA256 pins its certificate
	// (lowercase hex SHA-256 of the DER); TrustOnFirstUse accepts any, to
	// be pinned from the result; Insecure skips verification instead.
	CAPEM             string `json:"caPem,omitempty"`
	CertificateSHA256 string `json:"certificateSha256,omitempty"`
	TrustOnFirstUse   bool   `json:"trustOnFirstUse,omitempty"`
	Insecure          bool   `json:"insecure,omitempty"`
}

// Image is a content-addressed boot file.
type Image struct {
	URL    string `json:"url"`
	SHA256 string `json:"sha256"`
}

// Payload is a task's parameters: exactly the field of its kind is set.
// bmc.* kinds seal the BMC credentials (credseal.BMCCredentials as JSON);
// pxe.arm with decision "ramdisk" seals the machine's boot token.
type Payload struct {
	// BMC is for bmc.inspect, bmc.power and bmc.boot.
	BMC *BMC `json:"bmc,omitempty"`
	// PowerAction is bmc.power's: on, off, cycle, graceful-off.
	PowerAction string `json:"powerAction,omitempty"`
	// BootTarget is bmc.boot's: pxe, disk.
	BootTarget string `json:"bootTarget,omitempty"`
	// MACs are pxe.arm's and pxe.disarm's (lower case, colon separated).
	MACs []string `json:"macs,omitempty"`
	// Decision is pxe.arm's: ramdisk or local.
	Decision string `json:"decision,omitempty"`
	// Kernel, Initrd and Args are pxe.arm's for decision ramdisk.
	Kernel *Image   `json:"kernel,omitempty"`
	Initrd *Image   `json:"initrd,omitempty"`
	Args   []string `json:"args,omitempty"`
}

// Inventory is bmc.inspect's result.
type Inventory struct {
	Manufacturer string `json:"manufacturer"`
	Model        string `json:"model"`
	SerialNumber string `json:"serialNumber"`
	UUID         string `json:"uuid"`
	PowerState   string `json:"powerState"`
	CPUCount     int    `json:"cpuCount"`
	CPUModel     string `json:"cpuModel"`
	CPUCores     int    `json:"cpuCores"`
	MemoryMiB    int64  `json:"memoryMiB"`
	NICs         []NIC  `json:"nics"`
	Disks        []Disk `json:"disks"`
}

// NIC is an Ethernet interface of an Inventory.
type NIC struct {
	ID        string `json:"id"`
	MAC       string `json:"mac"`
	SpeedMbps int    `json:"speedMbps"`
}

// Disk is a drive of an Inventory.
type Disk struct {
	ID            string `json:"id"`
	Model         string `json:"model"`
	SerialNumber  string `json:"serialNumber"`
	CapacityBytes int64  `json:"capacityBytes"`
	MediaType     string `json:"mediaType"`
}

// Result is what a task returned: Inventory for bmc.inspect, PowerState
// for bmc.power and bmc.boot, nothing for pxe.*. BMCCertificateSHA256 is
// the certificate the BMC presented (bmc.* kinds), kept for a failure too.
type Result struct {
	Inventory            *Inventory `json:"inventory,omitempty"`
	PowerState           string     `json:"powerState,omitempty"`
	BMCCertificateSHA256 string     `json:"bmcCertificateSha256,omitempty"`
}

// Task is a stored site task.
type Task struct {
	ID        string
	TenantID  string
	SiteID    string
	MachineID string
	Kind      string
	Payload   Payload
	// Sealed is the JWE of the task's secret ("" for none); SealKID the
	// key it is sealed to (read from the JWE by Enqueue and Reseal).
	Sealed  string
	SealKID string
	// NeedsReseal says the holder's key is no longer SealKID: the task
	// waits for [Reseal].
	NeedsReseal bool
	State       State
	Attempts    int
	NotAfter    time.Time
	// LeaseEpoch, AgentID and SessionKID are the last claim's.
	LeaseEpoch   int64
	AgentID      string
	SessionKID   string
	Result       *Result
	Error        string
	CreatedAt    time.Time
	DispatchedAt *time.Time
	FinishedAt   *time.Time
}

// NewID returns a new task id, "stk_…": a producer that binds a sealed
// secret to the task (credseal.TaskAAD) picks the id before it seals.
func NewID() string { return "stk_" + secret.Random(12) }

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

const columns = `id, tenant_id, site_id, machine_id, kind, payload, sealed, seal_kid, needs_reseal, state, attempts, not_after,
	lease_epoch, agent_id, session_kid, result, error, created_at, dispatched_at, finished_at`

func scan(r pgx.Row) (Task, error) {
	var t Task
	var payload []byte
	var result []byte
	err := r.Scan(&t.ID, &t.TenantID, &t.SiteID, &t.MachineID, &t.Kind, &payload, &t.Sealed, &t.SealKID, &t.NeedsReseal,
		&t.State, &t.Attempts, &t.NotAfter, &t.LeaseEpoch, &t.AgentID, &t.SessionKID, &result, &t.Error, &t.CreatedAt,
		&t.DispatchedAt, &t.FinishedAt)
	if err != nil {
		return Task{}, err
	}
	if err := json.Unmarshal(payload, &t.Payload); err != nil {
		return Task{}, fmt.Errorf("site task %s: payload: %w", t.ID, err)
	}
	if len(result) > 0 && string(result) != "null" {
		t.Result = &Result{}
		if err := json.Unmarshal(result, t.Result); err != nil {
			return Task{}, fmt.Errorf("site task %s: result: %w", t.ID, err)
		}
	}
	return t, nil
}

func collect(rows pgx.Rows, err error) ([]Task, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Task, error) { return scan(r) })
}

// Enqueue writes t as a pending task in tx and returns it; call
// reconcile.Queue.WakeSiteTasks with its site in the transaction. An empty t.ID gets [NewID]
// (but a sealed secret is bound to its id: pick it first).
//
// Faults: INVALID_INPUT on the field at fault (payload.*, sealed,
// notAfter, …); UNSUPPORTED "kind"; NOT_FOUND "siteId" for an unknown site
// of the tenant; RATE_LIMITED "siteId" with MaxOpenPerSite open tasks.
func Enqueue(ctx context.Context, tx pgx.Tx, t Task) (Task, error) {
	if err := validate(&t); err != nil {
		return Task{}, err
	}
	if t.ID == "" {
		t.ID = NewID()
	}
	if err := tx.QueryRow(ctx, `SELECT 1 FROM sites WHERE id = $1 AND tenant_id = $2`, t.SiteID, t.TenantID).Scan(new(int)); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return Task{}, fault.New(fault.NotFound, "siteId", "site %q not found in tenant %s", t.SiteID, t.TenantID)
		}
		return Task{}, fmt.Errorf("enqueue site task: %w", err)
	}
	// A soft bound (concurrent enqueues may overshoot it by a few): it
	// keeps a runaway producer from filling the table.
	var open int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM site_tasks WHERE site_id = $1 AND state IN ('pending', 'in_flight')`,
		t.SiteID).Scan(&open); err != nil {
		return Task{}, fmt.Errorf("enqueue site task: %w", err)
	}
	if open >= MaxOpenPerSite {
		return Task{}, fault.New(fault.RateLimited, "siteId", "site %s has %d open tasks, at most %d", t.SiteID, open, MaxOpenPerSite)
	}
	payload, err := json.Marshal(t.Payload)
	if err != nil {
		return Task{}, fmt.Errorf("enqueue site task: %w", err)
	}
	out, err := scan(tx.QueryRow(ctx, `
		INSERT INTO site_tasks (id, tenant_id, site_id, machine_id, kind, payload, sealed, seal_kid, not_after)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING `+columns,
		t.ID, t.TenantID, t.SiteID, t.MachineID, t.Kind, payload, t.Sealed, t.SealKID, t.NotAfter))
	if err != nil {
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "23505" {
			return Task{}, fault.New(fault.Conflict, "id", "site task %s exists", t.ID)
		}
		return Task{}, fmt.Errorf("enqueue site task: %w", err)
	}
	return out, nil
}

// Reseal replaces a pending task's sealed secret (sealed again to the
// holder's current key, with the same additional data) and clears
// NeedsReseal; call reconcile.Queue.WakeSiteTasks in the transaction. NOT_FOUND "id" unless the
// task is pending; INVALID_INPUT "sealed" for a bad JWE.
func Reseal(ctx context.Context, q Querier, id, sealed string) (Task, error) {
	kid, err := credseal.SealedKeyID(sealed)
	if err != nil {
		return Task{}, fault.Wrap(err, fault.InvalidInput, "sealed", "sealed: not a JWE of proto/credseal")
	}
	t, err := scan(q.QueryRow(ctx, `UPDATE site_tasks SET sealed = $2, seal_kid = $3, needs_reseal = false
		WHERE id = $1 AND state = 'pending' AND sealed <> '' RETURNING `+columns, id, sealed, kid))
	if errors.Is(err, pgx.ErrNoRows) {
		return Task{}, fault.New(fault.NotFound, "id", "no pending sealed site task %q", id)
	}
	if err != nil {
		return Task{}, fmt.Errorf("reseal site task %s: %w", id, err)
	}
	return t, nil
}

// Holder is a site session claiming and finishing tasks: the agent, the
// lease epoch it holds and its session's seal key id.
type Holder struct {
	SiteID, AgentID string
	Epoch           int64
	SessionKID      string
}

// Claim marks the site's due tasks in flight for h (attempts + 1, its
// agent, epoch and session) and returns them, oldest first, at most
// MaxClaim: pending tasks and in-flight ones claimed by another agent,
// epoch or session, whose not_after has not passed. Only while h holds the
// site's boot lease at h.Epoch (sites.CheckFence, in the same transaction:
// CONFLICT "bootEpoch" otherwise) and h.SessionKID is its agent's current
// seal key (a superseded session claims nothing). Due tasks sealed to
// another key are not claimed: they are set pending with NeedsReseal and
// their machines' ReconcileKind job is enqueued in q.
func Claim(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, h Holder) ([]Task, error) {
	if err := sites.CheckFence(ctx, tx, h.SiteID, h.AgentID, h.Epoch); err != nil {
		return nil, err
	}
	var key string
	if err := tx.QueryRow(ctx, `SELECT seal_key FROM site_agents WHERE id = $1`, h.AgentID).Scan(&key); err != nil {
		return nil, fmt.Errorf("claim site tasks: %w", err)
	}
	if kid, _ := credseal.KeyID(key); kid != h.SessionKID {
		return nil, nil
	}
	// The partial index site_tasks_due keeps this scan to the site's
	// unfinished tasks.
	rows, err := tx.Query(ctx, `
		WITH due AS (
			SELECT id FROM site_tasks
			 WHERE site_id = $1 AND not_after > now() AND NOT needs_reseal
			   AND (state = 'pending' OR (state = 'in_flight' AND (agent_id <> $2 OR lease_epoch <> $3 OR session_kid <> $4)))
			 ORDER BY created_at, id LIMIT $5 FOR UPDATE SKIP LOCKED)
		UPDATE site_tasks t SET
		    needs_reseal = t.sealed <> '' AND t.seal_kid <> $4,
		    state = CASE WHEN t.sealed <> '' AND t.seal_kid <> $4 THEN 'pending' ELSE 'in_flight' END,
		    attempts = CASE WHEN t.sealed <> '' AND t.seal_kid <> $4 THEN t.attempts ELSE t.attempts + 1 END,
		    agent_id = CASE WHEN t.sealed <> '' AND t.seal_kid <> $4 THEN t.agent_id ELSE $2 END,
		    lease_epoch = CASE WHEN t.sealed <> '' AND t.seal_kid <> $4 THEN t.lease_epoch ELSE $3 END,
		    session_kid = CASE WHEN t.sealed <> '' AND t.seal_kid <> $4 THEN t.session_kid ELSE $4 END,
		    dispatched_at = CASE WHEN t.sealed <> '' AND t.seal_kid <> $4 THEN t.dispatched_at ELSE now() END
		  FROM due WHERE t.id = due.id
		RETURNING `+prefixed("t"), h.SiteID, h.AgentID, h.Epoch, h.SessionKID, MaxClaim)
	all, err := collect(rows, err)
	if err != nil {
		return nil, fmt.Errorf("claim site tasks of %s: %w", h.SiteID, err)
	}
	var out []Task
	for _, t := range all {
		if t.NeedsReseal {
			if err := q.Enqueue(ctx, ReconcileKind, t.MachineID); err != nil {
				return nil, err
			}
			continue
		}
		out = append(out, t)
	}
	sortByCreated(out)
	return out, nil
}

func prefixed(alias string) string {
	parts := strings.Split(columns, ",")
	for i, p := range parts {
		parts[i] = alias + "." + strings.TrimSpace(p)
	}
	return strings.Join(parts, ", ")
}

func sortByCreated(ts []Task) {
	slices.SortFunc(ts, func(a, b Task) int { return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID)) })
}

// Outcome is a result as the holder reported it.
type Outcome struct {
	ID      string
	Attempt int
	// Result is a success's (nil for kinds without one); Error a failure's.
	Result *Result
	Error  string
}

// Complete stores a success, Fail a failure: only while the task is in
// flight under h's claim at o.Attempt and h still holds the site's boot
// lease at h.Epoch (CONFLICT "bootEpoch" wrapping sites.ErrFenced
// otherwise; CONFLICT "attempt" wrapping ErrStale when the task is not in
// flight under that claim). The machine's ReconcileKind job is enqueued in
// q.
func Complete(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, h Holder, o Outcome) (Task, error) {
	return finish(ctx, tx, q, h, o, Succeeded)
}

// Fail stores a failure; see [Complete].
func Fail(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, h Holder, o Outcome) (Task, error) {
	if o.Error == "" {
		o.Error = "failed"
	}
	if o.Result != nil && o.Result.BMCCertificateSHA256 != "" {
		o.Result = &Result{BMCCertificateSHA256: o.Result.BMCCertificateSHA256}
	} else {
		o.Result = nil
	}
	return finish(ctx, tx, q, h, o, Failed)
}

func finish(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, h Holder, o Outcome, st State) (Task, error) {
	if err := sites.CheckFence(ctx, tx, h.SiteID, h.AgentID, h.Epoch); err != nil {
		return Task{}, err
	}
	if len(o.Error) > MaxError {
		o.Error = o.Error[:MaxError]
	}
	var result any
	if o.Result != nil {
		b, err := json.Marshal(o.Result)
		if err != nil {
			return Task{}, fmt.Errorf("finish site task %s: %w", o.ID, err)
		}
		result = b
	}
	t, err := scan(tx.QueryRow(ctx, `
		UPDATE site_tasks SET state = $7, result = $8, error = $9, finished_at = now()
		 WHERE id = $1 AND site_id = $2 AND state = 'in_flight' AND agent_id = $3 AND lease_epoch = $4
		   AND session_kid = $5 AND attempts = $6
		RETURNING `+columns, o.ID, h.SiteID, h.AgentID, h.Epoch, h.SessionKID, o.Attempt, string(st), result, o.Error))
	if errors.Is(err, pgx.ErrNoRows) {
		return Task{}, fault.Wrap(ErrStale, fault.Conflict, "attempt",
			"site task %s is not in flight at attempt %d under %s's claim at epoch %d", o.ID, o.Attempt, h.AgentID, h.Epoch)
	}
	if err != nil {
		return Task{}, fmt.Errorf("finish site task %s: %w", o.ID, err)
	}
	if err := q.Enqueue(ctx, ReconcileKind, t.MachineID); err != nil {
		return Task{}, err
	}
	return t, nil
}

// Expire marks expired the pending and in-flight tasks past their
// not_after — of site, or of every site when site is "" — at most limit,
// and enqueues their machines' ReconcileKind job in q. It returns how many
// expired.
func Expire(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, site string, limit int) (int, error) {
	rows, err := tx.Query(ctx, `
		WITH due AS (
			SELECT id FROM site_tasks WHERE state IN ('pending', 'in_flight') AND not_after <= now() AND ($1 = '' OR site_id = $1)
			 ORDER BY not_after LIMIT $2 FOR UPDATE SKIP LOCKED)
		UPDATE site_tasks t SET state = 'expired', error = 'not done by its deadline (notAfter)', finished_at = now()
		  FROM due WHERE t.id = due.id RETURNING t.machine_id`, site, limit)
	if err != nil {
		return 0, fmt.Errorf("expire site tasks: %w", err)
	}
	machines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("expire site tasks: %w", err)
	}
	for _, m := range machines {
		if err := q.Enqueue(ctx, ReconcileKind, m); err != nil {
			return 0, err
		}
	}
	return len(machines), nil
}

// Prune deletes at most limit tasks that finished before before (callers
// pass now − Retention).
func Prune(ctx context.Context, q Querier, before time.Time, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM site_tasks WHERE id IN (
		SELECT id FROM site_tasks WHERE finished_at < $1 ORDER BY finished_at LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune site tasks: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Get reads one task; NOT_FOUND "id" otherwise.
func Get(ctx context.Context, q Querier, id string) (Task, error) {
	t, err := scan(q.QueryRow(ctx, `SELECT `+columns+` FROM site_tasks WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Task{}, fault.New(fault.NotFound, "id", "site task %q not found", id)
	}
	if err != nil {
		return Task{}, fmt.Errorf("read site task %s: %w", id, err)
	}
	return t, nil
}

// ListByMachine returns a machine's tasks, newest first, at most
// MaxListed.
func ListByMachine(ctx context.Context, q Querier, machineID string) ([]Task, error) {
	ts, err := collect(q.Query(ctx, `SELECT `+columns+` FROM site_tasks WHERE machine_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2`,
		machineID, MaxListed))
	if err != nil {
		return nil, fmt.Errorf("list site tasks of %s: %w", machineID, err)
	}
	return ts, nil
}

// NeedingReseal returns a site's pending tasks waiting for [Reseal],
// oldest first, at most MaxClaim.
func NeedingReseal(ctx context.Context, q Querier, site string) ([]Task, error) {
	return collect(q.Query(ctx, `SELECT `+columns+` FROM site_tasks WHERE site_id = $1 AND state = 'pending' AND needs_reseal
		ORDER BY created_at, id LIMIT $2`, site, MaxClaim))
}
