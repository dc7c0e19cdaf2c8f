package instances

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Provider pools (class "provider", migration 00027): an instance there has
// no host; the vps.provider workflow (services/vps) makes and drives its
// machine at the pool's provider, keyed by the instance id, and records
// the machine's id and state here.

// ProviderJob is the work-queue kind of the provider workflow, keyed by
// instance id: enqueue it in the transaction of every change of a provider
// instance's desired state.
const ProviderJob = "vps.provider"

// Steps of the provider workflow.
const (
	StepCreate = "create"
	StepStart  = "start"
	StepStop   = "stop"
	StepDelete = "delete"
)

// ProviderSettings are a provider pool's settings: the provider API's base
// URL and the secret (kind provider) holding its credentials.
type ProviderSettings struct {
	PoolID         string
	Endpoint       string
	CredentialsRef string
	UpdatedAt      time.Time
}

// GetProviderSettings reads pool's provider settings; false when none are
// set.
func GetProviderSettings(ctx context.Context, q Querier, pool string) (ProviderSettings, bool, error) {
	s := ProviderSettings{PoolID: pool}
	err := q.QueryRow(ctx, `SELECT endpoint, credentials_ref, updated_at FROM provider_pool_settings WHERE pool_id = $1`, pool).
		Scan(&s.Endpoint, &s.CredentialsRef, &s.UpdatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return ProviderSettings{}, false, nil
	}
	if err != nil {
		return ProviderSettings{}, false, fmt.Errorf("read provider settings of %s: %w", pool, err)
	}
	return s, true, nil
}

// SetProviderSettings stores a provider pool's settings; the caller has
// validated them (the endpoint, and that the secret is the pool tenant's
// and of kind provider).
func SetProviderSettings(ctx context.Context, q Querier, s ProviderSettings) error {
	_, err := q.Exec(ctx, `
		INSERT INTO provider_pool_settings (pool_id, endpoint, credentials_ref) VALUES ($1, $2, $3)
		ON CONFLICT (pool_id) DO UPDATE SET endpoint = EXCLUDED.endpoint, credentials_ref = EXCLUDED.credentials_ref, updated_at = now()`,
		s.PoolID, s.Endpoint, s.CredentialsRef)
	if err != nil {
		return fmt.Errorf("set provider settings of %s: %w", s.PoolID, err)
	}
	return nil
}

// MaxCredentialUsers bounds [PoolsUsingCredentials].
const MaxCredentialUsers = 1000

// PoolsUsingCredentials returns the ids of up to MaxCredentialUsers
// provider pools whose settings name secret ref, in id order.
func PoolsUsingCredentials(ctx context.Context, q Querier, ref string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT pool_id FROM provider_pool_settings WHERE credentials_ref = $1 ORDER BY pool_id LIMIT $2`,
		ref, MaxCredentialUsers)
	if err != nil {
		return nil, fmt.Errorf("list pools using secret %s: %w", ref, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ProviderInstance is a provider instance with its workflow's state.
type ProviderInstance struct {
	Instance
	// Step is what the workflow is doing ("" when settled), Deadline when
	// the step must be done by, Attempts how many provider calls of the
	// step failed.
	Step     string
	Deadline *time.Time
	Attempts int
	// CreateSent: a create may have reached the provider, so a machine may
	// exist under the instance's key even without a ProviderMachineID.
	CreateSent bool
	// MachineState is the machine's state as the provider last reported.
	MachineState string
	// Now is the database's clock at the read.
	Now time.Time
}

// GetProvider reads instance id with its workflow's state (FOR UPDATE when
// lock). NOT_FOUND on instanceId when missing.
func GetProvider(ctx context.Context, q Querier, id string, lock bool) (ProviderInstance, error) {
	var in Instance
	var err error
	if lock {
		in, err = Lock(ctx, q, id)
	} else {
		in, err = get(ctx, q, `SELECT `+cols+` FROM instances i WHERE i.id = $1`, id)
	}
	if err != nil {
		return ProviderInstance{}, err
	}
	p := ProviderInstance{Instance: in}
	err = q.QueryRow(ctx, `SELECT provider_step, provider_deadline, provider_attempts, provider_create_sent, provider_machine_state, now()
		FROM instances WHERE id = $1`, id).Scan(&p.Step, &p.Deadline, &p.Attempts, &p.CreateSent, &p.MachineState, &p.Now)
	if err != nil {
		return ProviderInstance{}, fmt.Errorf("read provider state of %s: %w", id, err)
	}
	return p, nil
}

// BeginStep makes step instance id's current step, due within timeout,
// with no failed attempts — unless it already is the current step (its
// deadline and attempts are kept). It reports whether the step is new.
func BeginStep(ctx context.Context, q Querier, id, step string, timeout time.Duration) (bool, error) {
	tag, err := q.Exec(ctx, `UPDATE instances SET provider_step = $2, provider_deadline = now() + $3::interval, provider_attempts = 0,
		updated_at = now() WHERE id = $1 AND provider_step <> $2`, id, step, timeout)
	if err != nil {
		return false, fmt.Errorf("begin step %s of %s: %w", step, id, err)
	}
	return tag.RowsAffected() > 0, nil
}

// MarkCreateSent records, before the first create call, that a machine
// may exist under instance id's key. Commit it before calling the
// provider.
func MarkCreateSent(ctx context.Context, q Querier, id string) error {
	if _, err := q.Exec(ctx, `UPDATE instances SET provider_create_sent = true WHERE id = $1`, id); err != nil {
		return fmt.Errorf("mark create of %s: %w", id, err)
	}
	return nil
}

// FailedAttempt counts a failed provider call of instance id's step and
// returns the attempts so far.
func FailedAttempt(ctx context.Context, q Querier, id string) (int, error) {
	var n int
	err := q.QueryRow(ctx, `UPDATE instances SET provider_attempts = provider_attempts + 1 WHERE id = $1 RETURNING provider_attempts`, id).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count attempt of %s: %w", id, err)
	}
	return n, nil
}

// RecordMachine stores the machine the provider made (or reported) for
// instance id: its id and state. The first record is when the provider's
// capacity is held (placed_at).
func RecordMachine(ctx context.Context, q Querier, id, machineID, machineState string) error {
	_, err := q.Exec(ctx, `UPDATE instances SET provider_machine_id = $2, provider_machine_state = $3,
		placed_at = coalesce(placed_at, now()), observed_at = now(), updated_at = now() WHERE id = $1`, id, machineID, machineState)
	if err != nil {
		return fmt.Errorf("record machine of %s: %w", id, err)
	}
	return nil
}

// Settle moves instance id to state (running or stopped), observed at its
// current generation, and ends its step. It starts accruing usage the
// first time. It reports whether the state changed.
func Settle(ctx context.Context, q Querier, id, state, machineState string) (bool, error) {
	if state != StateRunning && state != StateStopped {
		return false, fmt.Errorf("settle %s: state %q", id, state)
	}
	var changed bool
	err := q.QueryRow(ctx, `
		WITH old AS (SELECT state FROM instances WHERE id = $1)
		UPDATE instances i SET state = $2, reason = '', provider_step = '', provider_deadline = NULL, provider_attempts = 0,
		       provider_machine_state = $3, observed_state = $2, observed_reason = '', observed_generation = i.generation,
		       observed_at = now(), accrued_at = coalesce(i.accrued_at, now()), updated_at = now()
		  FROM old WHERE i.id = $1 RETURNING old.state <> $2`, id, state, machineState).Scan(&changed)
	if err != nil {
		return false, fmt.Errorf("settle %s: %w", id, err)
	}
	return changed, nil
}

// FailProvider moves instance id to failed with reason (bounded); a failed
// provider instance is settled: only its delete runs the workflow again.
func FailProvider(ctx context.Context, q Querier, id, reason string) error {
	if len(reason) > 1024 {
		reason = reason[:1024]
	}
	if _, err := accrue(ctx, q, id); err != nil {
		return err
	}
	_, err := q.Exec(ctx, `UPDATE instances SET state = 'failed', reason = $2, observed_state = 'failed', observed_reason = $2,
		observed_at = now(), provider_step = '', provider_deadline = NULL, updated_at = now() WHERE id = $1`, id, reason)
	if err != nil {
		return fmt.Errorf("fail %s: %w", id, err)
	}
	return nil
}

// DeleteProvider deletes provider instance id (one with no host): it moves
// to deleting, its generation bumped, until the workflow has deleted its
// machine ([FinishDelete]). False when it already was deleting or deleted.
// Enqueue [ProviderJob] in the same transaction.
func DeleteProvider(ctx context.Context, q Querier, id string) (Instance, bool, error) {
	in, err := Lock(ctx, q, id)
	if err != nil {
		return Instance{}, false, err
	}
	if in.NodeID != "" {
		return Instance{}, false, fault.New(fault.Conflict, "instanceId", "instance %s runs on host %s, not at a provider", id, in.NodeID)
	}
	if !Live(in.State) {
		return in, false, nil
	}
	if _, err := accrue(ctx, q, id); err != nil {
		return Instance{}, false, err
	}
	if _, err := q.Exec(ctx, `UPDATE instances SET state = 'deleting', reason = '', generation = generation + 1, updated_at = now(),
		provider_step = '', provider_deadline = NULL, provider_attempts = 0 WHERE id = $1`, id); err != nil {
		return Instance{}, false, fmt.Errorf("delete %s: %w", id, err)
	}
	in, err = Lock(ctx, q, id)
	return in, true, err
}

// FinishDelete moves deleting instance id to deleted once its machine is
// gone.
func FinishDelete(ctx context.Context, q Querier, id string) error {
	_, err := q.Exec(ctx, `UPDATE instances SET state = 'deleted', deleted_at = now(), provider_step = '', provider_deadline = NULL,
		provider_machine_state = 'deleted', observed_state = 'absent', observed_at = now(), updated_at = now()
		WHERE id = $1 AND state = 'deleting'`, id)
	if err != nil {
		return fmt.Errorf("finish delete of %s: %w", id, err)
	}
	return nil
}

// ProviderUnsettled lists provider instances the workflow still has work
// for — pending, deleting, or running or stopped against their desired
// power state — after id after, by id, at most limit.
func ProviderUnsettled(ctx context.Context, q Querier, after string, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `
		SELECT i.id FROM instances i JOIN pools p ON p.id = i.pool_id AND p.class = 'provider'
		 WHERE i.node_id IS NULL AND i.state IN ('pending', 'running', 'stopped', 'deleting') AND i.id > $1
		   AND (i.state IN ('pending', 'deleting') OR i.state <> i.power OR i.provider_step <> '')
		 ORDER BY i.id LIMIT $2`, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list unsettled provider instances: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
