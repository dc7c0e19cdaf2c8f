// Package admission runs the sequence every mutation of the API goes
// through, so each method writes only its own work.
//
// A request-as-resource create ([Admitter.Create]):
//
//  1. (the caller has authenticated and passed the tenant pre-check)
//  2. transaction 1: the idempotency lookup — a repeat of the same request
//     under the same key finds the stored result, a different request under
//     it is CONFLICT — then the draft: the resource's projection row (and the
//     method's own draft row, if it has one);
//  3. one authorization decision on the drafted resource; a denial removes
//     the draft and writes a "deny" audit row. A repeat is decided again
//     like a first call, and only an allowed one returns the stored result;
//     a denied one gets the denial (the stored result stays for the key);
//  4. transaction 2: the method's work, the live projection row, an audit
//     row, an outbox row and the stored result, all or nothing.
//
// Idempotency keys are scoped to (tenant, identity, method). Concurrent
// identical creates converge on one resource: the second finds the first's
// pending row and adopts its resource id, and transaction 2 locks that row,
// so only one of them does the work and the other replays its result.
//
// Any other mutation ([Admitter.Mutate]) is one decision then one
// transaction with the work, the audit row and the outbox row.
package admission

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// DB is what admission needs of the database: a pool.
type DB interface {
	db.Beginner
	authz.Querier
}

// Authorizer makes the one decision of a mutation.
type Authorizer interface {
	Authorize(ctx context.Context, q authz.Querier, p iam.Principal, action authz.Action, res authz.Resource) error
}

// Config configures an [Admitter].
type Config struct {
	// DB is the pool. Required.
	DB DB
	// Authorizer decides. Required.
	Authorizer Authorizer
	// IdempotencyTTL is how long a key's result is kept; 0 means 24 hours.
	IdempotencyTTL time.Duration
	// Logger receives clean-up failures; nil discards.
	Logger *slog.Logger
	// Waker sends the wakes a mutation's transaction collected (the keys
	// its work enqueued, ...), after its commit; nil leaves them to the
	// loops' resync.
	Waker *wake.Waker
}

// Admitter runs admissions.
type Admitter struct {
	db     DB
	authz  Authorizer
	ttl    time.Duration
	logger *slog.Logger
	waker  *wake.Waker
}

// New returns an Admitter.
func New(cfg Config) *Admitter {
	return &Admitter{
		db:     cfg.DB,
		authz:  cfg.Authorizer,
		ttl:    cmp.Or(cfg.IdempotencyTTL, 24*time.Hour),
		logger: cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		waker:  cfg.Waker,
	}
}

// MaxKeyLength bounds an idempotency key.
const MaxKeyLength = 255

// Call says who is calling what; every admission has one.
type Call struct {
	// Principal is the authenticated caller.
	Principal iam.Principal
	// Method is the full gRPC method name.
	Method string
	// Action is the method's catalog action.
	Action authz.Action
	// TenantID is the request's tenant, which the pre-check passed.
	TenantID string
	// RequestID goes into the audit row.
	RequestID string
}

// Outcome is what a method's work produced.
type Outcome struct {
	// Response is the method's result as JSON: returned, and stored for
	// replays of a create.
	Response []byte
	// Event is written to the outbox; its TenantID defaults to the call's.
	// Type is required.
	Event outbox.Event
	// Resource, when set, replaces the resource's projection row (a create
	// always writes one: Resource defaults to the drafted resource).
	Resource *authz.Resource
	// Detail goes into the audit row.
	Detail map[string]any
}

// Create is a request-as-resource create.
type Create struct {
	Call
	// IdempotencyKey is optional; without one every call creates.
	IdempotencyKey string
	// RequestHash identifies the request under its key (a hash of the
	// request without the key).
	RequestHash []byte
	// Resource is the resource to create, for the draft and the decision.
	// An empty ID is filled by NewID.
	Resource authz.Resource
	// NewID mints the new resource's id when Resource.ID is empty.
	NewID func() string
	// Existing says Resource is an existing resource the create acts on
	// (the node a command runs on) rather than the one it makes: its
	// projection row is neither drafted nor rewritten, only decided on.
	Existing bool
	// Draft, when set, writes the method's own draft row in transaction 1.
	Draft func(ctx context.Context, tx pgx.Tx, id string) error
	// Work does the method's work in transaction 2. What it enqueues or
	// registers through q is poked or run after the commit.
	Work func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (Outcome, error)
}

// Result is an admitted create's answer.
type Result struct {
	// Response is the stored or fresh JSON response.
	Response []byte
	// ResourceID is the created resource's id.
	ResourceID string
	// Replayed says Response was stored by an earlier call under the key.
	Replayed bool
}

// Create runs the admission sequence for c.
func (a *Admitter) Create(ctx context.Context, c Create) (Result, error) {
	if len(c.IdempotencyKey) > MaxKeyLength {
		return Result{}, fault.New(fault.InvalidInput, "idempotencyKey", "at most %d characters", MaxKeyLength)
	}
	keyed := c.IdempotencyKey != ""
	scope := []any{c.TenantID, c.Principal.IdentityID, c.Method, c.IdempotencyKey}

	// Transaction 1: idempotency lookup, draft, projection row.
	var (
		id     string
		stored []byte
		owner  bool // this call inserted the idempotency row
	)
	err := db.InTx(ctx, a.db, db.TxOptions{}, func(tx pgx.Tx) error {
		id, stored, owner = c.Resource.ID, nil, true
		if id == "" {
			id = c.NewID()
		}
		if keyed {
			if _, err := tx.Exec(ctx, `DELETE FROM idempotency
				WHERE tenant_id = $1 AND identity_id = $2 AND method = $3 AND key = $4 AND expires_at <= now()`, scope...); err != nil {
				return fmt.Errorf("expire idempotency key: %w", err)
			}
			tag, err := tx.Exec(ctx, `
				INSERT INTO idempotency (tenant_id, identity_id, method, key, request_hash, resource_id, expires_at)
				VALUES ($1, $2, $3, $4, $5, $6, now() + $7::interval)
				ON CONFLICT DO NOTHING`, append(scope, c.RequestHash, id, a.ttl)...)
			if err != nil {
				return fmt.Errorf("record idempotency key: %w", err)
			}
			if tag.RowsAffected() == 0 {
				owner = false
				var hash []byte
				err := tx.QueryRow(ctx, `SELECT request_hash, resource_id, response FROM idempotency
					WHERE tenant_id = $1 AND identity_id = $2 AND method = $3 AND key = $4`, scope...).Scan(&hash, &id, &stored)
				if err != nil {
					return fmt.Errorf("read idempotency key: %w", err)
				}
				if !bytes.Equal(hash, c.RequestHash) {
					return fault.New(fault.Conflict, "idempotencyKey", "idempotency key %q was used for a different request", c.IdempotencyKey)
				}
				if stored != nil {
					return nil
				}
			}
		}
		res := c.Resource
		res.ID = id
		if c.Existing {
			return nil
		}
		if err := authz.PutDraft(ctx, tx, res); err != nil {
			return err
		}
		if owner && c.Draft != nil {
			return c.Draft(ctx, tx, id)
		}
		return nil
	})
	if err != nil {
		return Result{}, err
	}

	res := c.Resource
	res.ID = id
	// Only the call that inserted the idempotency row removes it (and the
	// draft): a concurrent identical call that fails leaves both to it.
	forget := func(deny bool) {
		a.forget(ctx, c.Call, res, scope, keyed, owner, deny)
	}

	// The one decision, made for a replay too: a caller who lost the
	// permission since the first call gets the denial, not the stored result.
	if err := a.authz.Authorize(ctx, nil, c.Principal, c.Action, res); err != nil {
		forget(fault.CodeOf(err) == fault.AccessDenied)
		return Result{}, err
	}
	if stored != nil {
		return Result{Response: stored, ResourceID: id, Replayed: true}, nil
	}

	// Transaction 2: the work, projection, audit, outbox, stored result.
	var out Outcome
	var q *reconcile.Queue
	err = db.InTx(ctx, a.db, db.TxOptions{}, func(tx pgx.Tx) error {
		stored, q = nil, reconcile.NewQueue(tx)
		if keyed {
			err := tx.QueryRow(ctx, `SELECT response FROM idempotency
				WHERE tenant_id = $1 AND identity_id = $2 AND method = $3 AND key = $4 FOR UPDATE`, scope...).Scan(&stored)
			if errors.Is(err, pgx.ErrNoRows) {
				return fault.New(fault.Conflict, "idempotencyKey", "an earlier request under idempotency key %q failed while this one ran; retry", c.IdempotencyKey)
			}
			if err != nil {
				return fmt.Errorf("lock idempotency key: %w", err)
			}
			if stored != nil {
				return nil // a concurrent identical request finished first
			}
		}
		var err error
		if out, err = c.Work(ctx, tx, q, id); err != nil {
			return err
		}
		audited := res
		switch {
		case out.Resource != nil:
			audited = *out.Resource
		case !c.Existing:
			out.Resource = &res
		}
		if err := a.record(ctx, tx, c.Call, audited, out); err != nil {
			return err
		}
		if keyed {
			if _, err := tx.Exec(ctx, `UPDATE idempotency SET response = $5
				WHERE tenant_id = $1 AND identity_id = $2 AND method = $3 AND key = $4`, append(scope, out.Response)...); err != nil {
				return fmt.Errorf("store idempotent result: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		forget(false)
		return Result{}, err
	}
	if stored != nil {
		return Result{Response: stored, ResourceID: id, Replayed: true}, nil
	}
	q.Committed(a.waker)
	return Result{Response: out.Response, ResourceID: id}, nil
}

// record writes the live projection row (when res is set), the audit row and
// the outbox row of an allowed mutation.
func (a *Admitter) record(ctx context.Context, tx pgx.Tx, c Call, res authz.Resource, out Outcome) error {
	if out.Resource != nil {
		if err := authz.Put(ctx, tx, *out.Resource); err != nil {
			return err
		}
	}
	if err := audit.Write(ctx, tx, auditRecord(c, res, audit.Allow, out.Detail)); err != nil {
		return err
	}
	ev := out.Event
	ev.TenantID = cmp.Or(ev.TenantID, c.TenantID)
	ev.Resource = cmp.Or(ev.Resource, res.ID)
	if ev.Type == "" {
		return fmt.Errorf("%s: an admitted mutation must name its outbox event", c.Method)
	}
	if ev.Payload == nil && out.Response != nil {
		ev.Payload = out.Response
	}
	_, err := outbox.Write(ctx, tx, ev)
	return err
}

func auditRecord(c Call, res authz.Resource, decision string, detail map[string]any) audit.Record {
	return audit.Record{
		TenantID:      c.TenantID,
		Actor:         c.Principal.IdentityID,
		ActorTenantID: c.Principal.TenantID,
		Action:        string(c.Action),
		Resource:      res.UID(),
		Decision:      decision,
		RequestID:     c.RequestID,
		Method:        c.Method,
		Detail:        detail,
	}
}

// forget removes what transaction 1 left for a create that will not happen,
// and records a denial. It runs even when the request's context is done.
func (a *Admitter) forget(ctx context.Context, c Call, res authz.Resource, scope []any, keyed, owner, deny bool) {
	if !owner && !deny {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := db.InTx(ctx, a.db, db.TxOptions{}, func(tx pgx.Tx) error {
		if owner {
			if keyed {
				if _, err := tx.Exec(ctx, `DELETE FROM idempotency
					WHERE tenant_id = $1 AND identity_id = $2 AND method = $3 AND key = $4 AND response IS NULL`, scope...); err != nil {
					return err
				}
			}
			if err := authz.DeleteDraft(ctx, tx, res.Type, res.ID); err != nil {
				return err
			}
		}
		if deny {
			return audit.Write(ctx, tx, auditRecord(c, res, audit.Deny, nil))
		}
		return nil
	})
	if err != nil {
		a.logger.WarnContext(ctx, "clean up after a create that did not happen", "method", c.Method, "resource", res.UID(), "err", err)
	}
}

// Mutation is any mutation other than a create: an update, a revoke, a put,
// a delete.
type Mutation struct {
	Call
	// Resource is the resource acted on (from the projection, or built from
	// the request for resources without a row).
	Resource authz.Resource
	// Work does the method's work in the mutation's transaction. What it
	// enqueues or registers through q is poked or run after the commit.
	Work func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (Outcome, error)
}

// Mutate makes m's one decision (a denial writes a "deny" audit row), then
// runs its work with the audit and outbox rows in one transaction, and
// returns the work's response.
func (a *Admitter) Mutate(ctx context.Context, m Mutation) ([]byte, error) {
	if err := a.authz.Authorize(ctx, nil, m.Principal, m.Action, m.Resource); err != nil {
		if fault.CodeOf(err) == fault.AccessDenied {
			if werr := audit.Write(context.WithoutCancel(ctx), a.db, auditRecord(m.Call, m.Resource, audit.Deny, nil)); werr != nil {
				a.logger.WarnContext(ctx, "audit a denial", "method", m.Method, "err", werr)
			}
		}
		return nil, err
	}
	var out Outcome
	var q *reconcile.Queue
	err := db.InTx(ctx, a.db, db.TxOptions{}, func(tx pgx.Tx) error {
		q = reconcile.NewQueue(tx)
		var err error
		if out, err = m.Work(ctx, tx, q); err != nil {
			return err
		}
		return a.record(ctx, tx, m.Call, m.Resource, out)
	})
	if err != nil {
		return nil, err
	}
	q.Committed(a.waker)
	return out.Response, nil
}

// Read makes the one decision of a read: no audit row, no transaction.
func (a *Admitter) Read(ctx context.Context, c Call, res authz.Resource) error {
	return a.authz.Authorize(ctx, nil, c.Principal, c.Action, res)
}

// IsUnique reports whether err is a unique violation, which a method's work
// usually turns into CONFLICT.
func IsUnique(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505"
}

// PruneIdempotency deletes up to limit expired idempotency records (a key
// past its TTL no longer replays) and returns how many.
func PruneIdempotency(ctx context.Context, q interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM idempotency WHERE ctid = ANY (ARRAY(
		SELECT ctid FROM idempotency WHERE expires_at <= now() ORDER BY expires_at LIMIT $1))`, limit)
	if err != nil {
		return 0, fmt.Errorf("prune idempotency records: %w", err)
	}
	return tag.RowsAffected(), nil
}
