// Package machines stores bare-metal machines (table machines, migration
// 00023): a server of a site, taken from its first PXE boot to a node by
// the metal workflow.
//
// A machine's state is its step in the flow ([State], the table of legal
// changes in [Transitions]). Every write of the state is guarded by the
// state the writer read ([SetState] takes the states it may leave from, in
// the same UPDATE), so two writers cannot both move the machine or skip a
// step: the second gets CONFLICT on "state". Each step counts its attempts
// and has a deadline; both start over when the state changes.
//
// The BMC's credentials are not here: BMCCredentialsRef names a secret
// (pkg/secrets).
package machines

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Limits on what a machine holds.
const (
	// MaxNameLen bounds a machine's name.
	MaxNameLen = 63
	// MaxBMCAddressLen bounds its BMC's address.
	MaxBMCAddressLen = 256
	// MaxCloudInitBytes bounds the cloud-init user data of a deploy.
	MaxCloudInitBytes = 64 << 10
	// MaxImageURLLen bounds an image's URL.
	MaxImageURLLen = 2048
	// MaxImageBytes bounds an image's size (16 TiB).
	MaxImageBytes = 16 << 40
	// MaxReasonLen bounds a failure's reason; longer ones are cut.
	MaxReasonLen = 1024
	// MaxMACs bounds the MAC addresses kept of its inventory.
	MaxMACs = 64
)

// Image is what metal.deploy writes to the machine's disk.
type Image struct {
	// URL is where the site agent fetches it (https).
	URL string `json:"url"`
	// SHA256 is its digest, 64 lower-case hex digits, checked before it is
	// served and after it is written.
	SHA256 string `json:"sha256"`
	// SizeBytes is its size.
	SizeBytes int64 `json:"sizeBytes"`
}

// Machine is a stored machine.
type Machine struct {
	ID       string
	TenantID string
	SiteID   string
	PoolID   string
	Name     string
	Labels   map[string]string
	// BMCAddress is the BMC's Redfish base URL, https://host[:port].
	BMCAddress string
	// BMCCredentialsRef is the secret ("sec_…") holding its credentials.
	BMCCredentialsRef string
	// How its BMC's certificate is verified: BMCCAPEM pins a CA;
	// BMCCertificateSHA256 pins the certificate itself (given at
	// enrollment, or trusted on first use: [PinCertificate]); BMCInsecure
	// skips verification (an explicit opt-in, excluding both).
	BMCCAPEM             string
	BMCCertificateSHA256 string
	BMCInsecure          bool
	State                State
	Purpose              Purpose
	// StepAttempts counts the tries of the current step; StepStartedAt is
	// when the machine entered it; StepDeadline, when set, is when the
	// current try times out.
	StepAttempts  int
	StepStartedAt time.Time
	StepDeadline  *time.Time
	// FailedStep and FailedReason say where and why it failed (state
	// failed); empty otherwise.
	FailedStep   State
	FailedReason string
	// Inventory is what Redfish inspection found ({} before).
	Inventory json.RawMessage
	// MACs are its NICs' addresses, lower case.
	MACs []string
	Boot Boot
	// JoinTokenID is the single-use join token the flow minted last ("" when
	// none).
	JoinTokenID string
	// NodeID is the node it joins as, reserved at enrollment.
	NodeID string
	// Image and CloudInit are metal.deploy's.
	Image     *Image
	CloudInit string
	// Generation grows with every change of what the site's boot server
	// must do for it.
	Generation int64
	CreatedAt  time.Time
	UpdatedAt  time.Time
}

// NewID returns a new machine id, "mach_…".
func NewID() string { return "mach_" + secret.Random(10) }

const cols = `id, tenant_id, site_id, pool_id, name, labels, bmc_address, bmc_credentials_ref, state, purpose,
	step_attempts, step_started_at, step_deadline, failed_step, failed_reason, inventory, macs, boot,
	coalesce(join_token_id, ''), node_id, image, cloud_init, generation, created_at, updated_at,
	bmc_ca_pem, bmc_certificate_sha256, bmc_insecure`

func scan(r pgx.Row) (Machine, error) {
	var m Machine
	var state, purpose, failedStep, boot string
	err := r.Scan(&m.ID, &m.TenantID, &m.SiteID, &m.PoolID, &m.Name, &m.Labels, &m.BMCAddress, &m.BMCCredentialsRef,
		&state, &purpose, &m.StepAttempts, &m.StepStartedAt, &m.StepDeadline, &failedStep, &m.FailedReason,
		&m.Inventory, &m.MACs, &boot, &m.JoinTokenID, &m.NodeID, &m.Image, &m.CloudInit, &m.Generation,
		&m.CreatedAt, &m.UpdatedAt, &m.BMCCAPEM, &m.BMCCertificateSHA256, &m.BMCInsecure)
	m.State, m.Purpose, m.FailedStep, m.Boot = State(state), Purpose(purpose), State(failedStep), Boot(boot)
	return m, err
}

func notFound(tenant, id string) error {
	if tenant == "" {
		return fault.New(fault.NotFound, "machineId", "machine %q not found", id)
	}
	return fault.New(fault.NotFound, "machineId", "machine %q not found in tenant %s", id, tenant)
}

// Create stores m in state enrolled with purpose commission (its State,
// Purpose, Generation and step fields are ignored). ID, TenantID, SiteID,
// PoolID, Name, BMCAddress, BMCCredentialsRef and NodeID are required. A
// name already used in the tenant is CONFLICT on "name", a BMC address
// already enrolled at the site CONFLICT on "bmc.address"; a credentials
// reference that no longer exists is NOT_FOUND on "bmc.credentialsRef".
func Create(ctx context.Context, q Querier, m Machine) (Machine, error) {
	if m.Labels == nil {
		m.Labels = map[string]string{}
	}
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO machines (id, tenant_id, site_id, pool_id, name, labels, bmc_address, bmc_credentials_ref, node_id,
		    bmc_ca_pem, bmc_certificate_sha256, bmc_insecure)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
		RETURNING `+cols, m.ID, m.TenantID, m.SiteID, m.PoolID, m.Name, m.Labels, m.BMCAddress, m.BMCCredentialsRef, m.NodeID,
		m.BMCCAPEM, m.BMCCertificateSHA256, m.BMCInsecure))
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case pe.Code == "23505" && pe.ConstraintName == "machines_tenant_id_name_key":
			return Machine{}, fault.New(fault.Conflict, "name", "a machine named %q already exists in tenant %s", m.Name, m.TenantID)
		case pe.Code == "23505" && pe.ConstraintName == "machines_site_bmc_address":
			return Machine{}, fault.New(fault.Conflict, "bmc.address", "a machine of site %s already has BMC %s: one server is enrolled once", m.SiteID, m.BMCAddress)
		case pe.Code == "23503" && strings.Contains(pe.ConstraintName, "bmc_credentials_ref"):
			return Machine{}, fault.New(fault.NotFound, "bmc.credentialsRef", "secret %q not found in tenant %s", m.BMCCredentialsRef, m.TenantID)
		case pe.Code == "23503" && strings.Contains(pe.ConstraintName, "site_id"):
			return Machine{}, fault.New(fault.NotFound, "siteId", "site %q not found in tenant %s", m.SiteID, m.TenantID)
		case pe.Code == "23503" && strings.Contains(pe.ConstraintName, "pool_id"):
			return Machine{}, fault.New(fault.NotFound, "poolId", "pool %q not found in tenant %s", m.PoolID, m.TenantID)
		}
	}
	if err != nil {
		return Machine{}, fmt.Errorf("insert machine: %w", err)
	}
	return out, nil
}

// Get reads machine id of tenant ("" for any tenant: the workflow's
// lookup by key); NOT_FOUND on "machineId" otherwise.
func Get(ctx context.Context, q Querier, tenant, id string) (Machine, error) {
	return get(ctx, q, tenant, id, "")
}

// Lock is Get FOR UPDATE, in the caller's transaction.
func Lock(ctx context.Context, q Querier, tenant, id string) (Machine, error) {
	return get(ctx, q, tenant, id, " FOR UPDATE")
}

func get(ctx context.Context, q Querier, tenant, id, suffix string) (Machine, error) {
	m, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM machines WHERE id = $1 AND ($2 = '' OR tenant_id = $2)`+suffix, id, tenant))
	if errors.Is(err, pgx.ErrNoRows) {
		return Machine{}, notFound(tenant, id)
	}
	if err != nil {
		return Machine{}, fmt.Errorf("read machine %s: %w", id, err)
	}
	return m, nil
}

// Filter selects machines for [List]. Empty fields match everything.
type Filter struct {
	// TenantID is the tenant ("" any: the workflow's and the site's view).
	TenantID string
	SiteID   string
	// States, when set, keeps machines in one of them.
	States []State
	// After pages: ids after it, in id order.
	After string
	// Limit bounds the page; 0 means 100.
	Limit int
}

// List returns machines matching f, in id order.
func List(ctx context.Context, q Querier, f Filter) ([]Machine, error) {
	limit := f.Limit
	if limit <= 0 {
		limit = 100
	}
	states := make([]string, len(f.States))
	for i, s := range f.States {
		states[i] = string(s)
	}
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM machines
		WHERE ($1 = '' OR tenant_id = $1) AND ($2 = '' OR site_id = $2) AND (cardinality($3::text[]) = 0 OR state = ANY($3))
		  AND id > $4
		ORDER BY id LIMIT $5`, f.TenantID, f.SiteID, states, f.After, limit)
	if err != nil {
		return nil, fmt.Errorf("list machines: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Machine, error) { return scan(r) })
}

// Change is what a [SetState] writes besides the state. Zero fields keep
// what is stored.
type Change struct {
	// Purpose, when set, replaces the purpose.
	Purpose Purpose
	// Boot, when set, replaces what the boot server does.
	Boot Boot
	// Deadline is the new step's deadline (nil: none).
	Deadline *time.Time
	// Reason says why, with to = failed (cut to MaxReasonLen).
	Reason string
	// Image and CloudInit, when Image is set, replace the deploy's.
	Image     *Image
	CloudInit string
	// PoolID, when set, moves the machine to that pool.
	PoolID string
	// JoinTokenID, when set, records the join token the flow minted.
	JoinTokenID string
}

func stateStrings(ss []State) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = string(s)
	}
	return out
}

func cut(s string) string {
	if len(s) <= MaxReasonLen {
		return s
	}
	return s[:MaxReasonLen]
}

// SetState moves machine id to state to, but only from one of from (each
// of which must be allowed to go to to by the table): the guard that keeps
// concurrent writers from skipping steps. A machine in another state is
// CONFLICT on "state" naming the state it is in; a missing one NOT_FOUND
// on "machineId". The step's attempts start over at 0 and its deadline is
// c.Deadline; with to = failed, failed_step becomes the state it left and
// failed_reason c.Reason, and leaving failed clears both. The generation
// grows.
func SetState(ctx context.Context, q Querier, id string, from []State, to State, c Change) (Machine, error) {
	if !to.Valid() {
		return Machine{}, fmt.Errorf("set state of machine %s: %q is not a state", id, to)
	}
	if len(from) == 0 {
		return Machine{}, fmt.Errorf("set state of machine %s: no state to leave from", id)
	}
	for _, f := range from {
		if !CanTransition(f, to) {
			return Machine{}, fmt.Errorf("set state of machine %s: %s → %s is not a legal transition", id, f, to)
		}
	}
	var image any
	if c.Image != nil {
		image = c.Image
	}
	m, err := scan(q.QueryRow(ctx, `
		UPDATE machines SET
		    state = $3,
		    purpose = coalesce(nullif($4, ''), purpose),
		    boot = coalesce(nullif($5, ''), boot),
		    step_attempts = 0, step_started_at = now(), step_deadline = $6,
		    failed_step = CASE WHEN $3 = 'failed' THEN state ELSE '' END,
		    failed_reason = CASE WHEN $3 = 'failed' THEN $7 ELSE '' END,
		    image = CASE WHEN $8::jsonb IS NULL THEN image ELSE $8::jsonb END,
		    cloud_init = CASE WHEN $8::jsonb IS NULL THEN cloud_init ELSE $9 END,
		    pool_id = coalesce(nullif($10, ''), pool_id),
		    join_token_id = coalesce(nullif($11, ''), join_token_id),
		    generation = generation + 1, updated_at = now()
		WHERE id = $1 AND state = ANY($2)
		RETURNING `+cols, id, stateStrings(from), string(to), string(c.Purpose), string(c.Boot), c.Deadline, cut(c.Reason),
		image, c.CloudInit, c.PoolID, c.JoinTokenID))
	if errors.Is(err, pgx.ErrNoRows) {
		return Machine{}, stateConflict(ctx, q, id, from, string(to))
	}
	if err != nil {
		return Machine{}, fmt.Errorf("set state of machine %s: %w", id, err)
	}
	return m, nil
}

// stateConflict explains why a guarded write matched no row.
func stateConflict(ctx context.Context, q Querier, id string, from []State, what string) error {
	cur, err := Get(ctx, q, "", id)
	if err != nil {
		return err
	}
	return fault.New(fault.Conflict, "state", "machine %s is %s; %s needs it %s", id, cur.State, what, orList(from))
}

func orList(ss []State) string {
	parts := stateStrings(ss)
	if len(parts) == 1 {
		return parts[0]
	}
	return strings.Join(parts[:len(parts)-1], ", ") + " or " + parts[len(parts)-1]
}

// Fail moves machine id from at to failed with reason (see [SetState]).
func Fail(ctx context.Context, q Querier, id string, at State, reason string) (Machine, error) {
	return SetState(ctx, q, id, []State{at}, StateFailed, Change{Reason: reason})
}

// Retry moves a failed machine back to the step it failed in, its attempts
// at 0 and deadline as given, clearing the failure; the generation grows. A
// machine not failed is CONFLICT on "state".
func Retry(ctx context.Context, q Querier, id string, deadline *time.Time) (Machine, error) {
	m, err := scan(q.QueryRow(ctx, `
		UPDATE machines SET state = failed_step, failed_step = '', failed_reason = '',
		    step_attempts = 0, step_started_at = now(), step_deadline = $2,
		    generation = generation + 1, updated_at = now()
		WHERE id = $1 AND state = 'failed' AND failed_step <> ''
		RETURNING `+cols, id, deadline))
	if errors.Is(err, pgx.ErrNoRows) {
		return Machine{}, stateConflict(ctx, q, id, []State{StateFailed}, "retry")
	}
	if err != nil {
		return Machine{}, fmt.Errorf("retry machine %s: %w", id, err)
	}
	return m, nil
}

// Attempt counts a new try of step at (the machine must still be in it)
// with its deadline. The generation does not change.
func Attempt(ctx context.Context, q Querier, id string, at State, deadline time.Time) (Machine, error) {
	m, err := scan(q.QueryRow(ctx, `
		UPDATE machines SET step_attempts = step_attempts + 1, step_deadline = $3, updated_at = now()
		WHERE id = $1 AND state = $2
		RETURNING `+cols, id, string(at), deadline))
	if errors.Is(err, pgx.ErrNoRows) {
		return Machine{}, stateConflict(ctx, q, id, []State{at}, "a new attempt")
	}
	if err != nil {
		return Machine{}, fmt.Errorf("count an attempt of machine %s: %w", id, err)
	}
	return m, nil
}

// ErrMACTaken is in the chain of [SetInventory]'s CONFLICT when another
// machine of the site already has one of the MACs.
var ErrMACTaken = errors.New("MAC address owned by another machine of the site")

// SetInventory records what inspection found while the machine is at and
// its MACs (lower-cased, at most MaxMACs); the generation grows (the boot
// server knows machines by MAC). A MAC another machine of the site has is
// CONFLICT on "macs" wrapping [ErrMACTaken]: the boot server would answer
// one machine's PXE boot with the other's decision.
func SetInventory(ctx context.Context, q Querier, id string, at State, inventory json.RawMessage, macs []string) (Machine, error) {
	if len(macs) > MaxMACs {
		return Machine{}, fmt.Errorf("machine %s: %d MAC addresses, at most %d", id, len(macs), MaxMACs)
	}
	lower := make([]string, len(macs))
	for i, mac := range macs {
		lower[i] = strings.ToLower(mac)
	}
	if inventory == nil {
		inventory = json.RawMessage(`{}`)
	}
	// One writer of a site's MACs at a time, so two machines inspected
	// together cannot both claim one MAC.
	if _, err := q.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('machines.macs:' || site_id, 0)) FROM machines WHERE id = $1`, id); err != nil {
		return Machine{}, fmt.Errorf("lock the MACs of machine %s's site: %w", id, err)
	}
	var owner, mac string
	err := q.QueryRow(ctx, `
		SELECT o.id, x.mac FROM machines o, unnest(o.macs) AS x(mac)
		 WHERE o.site_id = (SELECT site_id FROM machines WHERE id = $1) AND o.id <> $1 AND x.mac = ANY($2)
		 ORDER BY o.id, x.mac LIMIT 1`, id, lower).Scan(&owner, &mac)
	switch {
	case err == nil:
		return Machine{}, fault.Wrap(ErrMACTaken, fault.Conflict, "macs", "MAC %s belongs to machine %s of the same site", mac, owner)
	case !errors.Is(err, pgx.ErrNoRows):
		return Machine{}, fmt.Errorf("check the MACs of machine %s: %w", id, err)
	}
	m, err := scan(q.QueryRow(ctx, `
		UPDATE machines SET inventory = $3, macs = $4, generation = generation + 1, updated_at = now()
		WHERE id = $1 AND state = $2
		RETURNING `+cols, id, string(at), inventory, lower))
	if errors.Is(err, pgx.ErrNoRows) {
		return Machine{}, stateConflict(ctx, q, id, []State{at}, "recording its inventory")
	}
	if err != nil {
		return Machine{}, fmt.Errorf("record the inventory of machine %s: %w", id, err)
	}
	return m, nil
}

// SetBoot sets what the boot server does for the machine while it is at,
// and the join token the flow minted for that boot ("" keeps the stored
// one); the generation grows.
func SetBoot(ctx context.Context, q Querier, id string, at State, boot Boot, joinTokenID string) (Machine, error) {
	m, err := scan(q.QueryRow(ctx, `
		UPDATE machines SET boot = $3, join_token_id = coalesce(nullif($4, ''), join_token_id),
		    generation = generation + 1, updated_at = now()
		WHERE id = $1 AND state = $2
		RETURNING `+cols, id, string(at), string(boot), joinTokenID))
	if errors.Is(err, pgx.ErrNoRows) {
		return Machine{}, stateConflict(ctx, q, id, []State{at}, "a boot change")
	}
	if err != nil {
		return Machine{}, fmt.Errorf("set the boot of machine %s: %w", id, err)
	}
	return m, nil
}

// PinCertificate records sha256 (64 lower-case hex digits) as the pinned
// certificate of machine id's BMC, but only while none is pinned and it is
// not insecure and has no pinned CA: trust on first use. It reports
// whether it pinned.
func PinCertificate(ctx context.Context, q Querier, id, sha256 string) (Machine, bool, error) {
	m, err := scan(q.QueryRow(ctx, `
		UPDATE machines SET bmc_certificate_sha256 = $2, updated_at = now()
		WHERE id = $1 AND bmc_certificate_sha256 = '' AND bmc_ca_pem = '' AND NOT bmc_insecure
		RETURNING `+cols, id, sha256))
	if errors.Is(err, pgx.ErrNoRows) {
		m, err := Get(ctx, q, "", id)
		return m, false, err
	}
	if err != nil {
		return Machine{}, false, fmt.Errorf("pin the BMC certificate of machine %s: %w", id, err)
	}
	return m, true, nil
}

// MaxCredentialUsers bounds [UsersOfCredentials].
const MaxCredentialUsers = 1000

// UsersOfCredentials returns up to MaxCredentialUsers machines of tenant
// naming secret ref, in id order.
func UsersOfCredentials(ctx context.Context, q Querier, tenant, ref string) ([]Machine, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM machines WHERE tenant_id = $1 AND bmc_credentials_ref = $2 ORDER BY id LIMIT $3`,
		tenant, ref, MaxCredentialUsers)
	if err != nil {
		return nil, fmt.Errorf("list machines using secret %s: %w", ref, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Machine, error) { return scan(r) })
}

// TrustOnFirstUse says the machine's BMC certificate is to be pinned from
// the first BMC task: nothing pinned, no CA, not insecure.
func (m Machine) TrustOnFirstUse() bool {
	return m.BMCCertificateSHA256 == "" && m.BMCCAPEM == "" && !m.BMCInsecure
}

// UsingCredentials counts the machines other than except naming secret ref.
func UsingCredentials(ctx context.Context, q Querier, ref, except string) (int, error) {
	var n int
	if err := q.QueryRow(ctx, `SELECT count(*) FROM machines WHERE bmc_credentials_ref = $1 AND id <> $2`, ref, except).Scan(&n); err != nil {
		return 0, fmt.Errorf("count machines using secret %s: %w", ref, err)
	}
	return n, nil
}

// Delete removes machine id of tenant, but only while it is in one of
// from; CONFLICT on "state" otherwise. It returns the machine as it was.
func Delete(ctx context.Context, q Querier, tenant, id string, from []State) (Machine, error) {
	m, err := scan(q.QueryRow(ctx, `DELETE FROM machines WHERE id = $1 AND tenant_id = $2 AND state = ANY($3) RETURNING `+cols,
		id, tenant, stateStrings(from)))
	if errors.Is(err, pgx.ErrNoRows) {
		if _, err := Get(ctx, q, tenant, id); err != nil {
			return Machine{}, err
		}
		return Machine{}, stateConflict(ctx, q, id, from, "delete")
	}
	if err != nil {
		return Machine{}, fmt.Errorf("delete machine %s: %w", id, err)
	}
	return m, nil
}
