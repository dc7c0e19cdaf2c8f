package nodes

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Drain and retire (the drain job, services/lifecycle; DESIGN §12): a node
// goes adopted → draining (no new bookings) → drained (its bookings are the
// lost-node policy's) → retired when the drain was a retire, or back to
// adopted on [Undrain]. Each transition is one guarded statement, so a
// transition that no longer applies (the node moved meanwhile) changes
// nothing and says so.

// Drain is how [StartDrain] drains a node.
type Drain struct {
	// Deadline is when its bookings must be gone.
	Deadline time.Time
	// Reason says why, for the events and nodes.get.
	Reason string
	// By is [DrainByOperator] or [DrainByRemediation].
	By string
	// Retire ends the drain in retirement.
	Retire bool
}

// ErrWrongState is wrapped by the CONFLICT of a transition that does not
// apply to the node's state.
var ErrWrongState = errors.New("the node's state does not allow this")

// wrongState is the CONFLICT on "nodeId" of a transition from n's state.
func wrongState(n Node, what, allowed string) error {
	return fault.Wrap(ErrWrongState, fault.Conflict, "nodeId", "node %s is %s%s: only %s nodes can be %s",
		n.ID, n.State, retiringNote(n), allowed, what)
}

func retiringNote(n Node) string {
	if n.Retiring && n.State != StateRetired {
		return " (retiring)"
	}
	return ""
}

// notFound is the NOT_FOUND on "nodeId" of a write to a node that does not
// exist.
func notFound(id string) error {
	return fault.New(fault.NotFound, "nodeId", "node %q not found", id)
}

// after tells a guarded write that changed no row apart: the node is gone
// (NOT_FOUND) or in another state (CONFLICT from wrong).
func after(ctx context.Context, q Querier, id string, wrong func(Node) error) error {
	n, err := Lookup(ctx, q, id)
	if fault.CodeOf(err) == fault.NotFound {
		return notFound(id)
	}
	if err != nil {
		return err
	}
	return wrong(n)
}

// StartDrain makes node id draining with d's deadline, reason and drainer:
// placement stops booking it at once (only adopted nodes are eligible),
// while desired state and commands keep flowing. An adopted node starts
// draining now; a draining one keeps its drain_started_at and takes the new
// deadline and reason, and stays an operator's drain once an operator
// drained it (so the remediation ladder never undrains it). d.Retire is
// OR-ed into retiring. A drained node may only be retired (d.Retire): it
// stays drained and becomes retiring. Other states (adopting, failed,
// retired) are CONFLICT on "nodeId" naming the state; no node is NOT_FOUND.
func StartDrain(ctx context.Context, q Querier, id string, d Drain) (Node, error) {
	if d.By != DrainByOperator && d.By != DrainByRemediation {
		return Node{}, fault.New(fault.InvalidInput, "by", "expected %s or %s, got %q", DrainByOperator, DrainByRemediation, d.By)
	}
	n, err := scan(q.QueryRow(ctx, `
		UPDATE nodes SET
		       state = CASE WHEN state = 'drained' THEN 'drained' ELSE 'draining' END,
		       drain_deadline = CASE WHEN state = 'drained' THEN drain_deadline ELSE $2 END,
		       drain_reason = CASE WHEN state = 'drained' THEN drain_reason ELSE $3 END,
		       drain_by = CASE WHEN state IN ('draining', 'drained') AND drain_by = 'operator' THEN 'operator' ELSE $4 END,
		       drain_started_at = CASE WHEN state IN ('draining', 'drained') THEN coalesce(drain_started_at, now()) ELSE now() END,
		       retiring = retiring OR $5,
		       updated_at = now()
		 WHERE id = $1 AND (state IN ('adopted', 'draining') OR (state = 'drained' AND $5))
		RETURNING `+cols, id, d.Deadline, d.Reason, d.By, d.Retire))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, after(ctx, q, id, func(n Node) error {
			if n.State == StateDrained {
				return wrongState(n, "drained again", "adopted or draining")
			}
			return wrongState(n, "drained", "adopted, draining (or, to retire, drained)")
		})
	}
	if err != nil {
		return Node{}, fmt.Errorf("drain node %s: %w", id, err)
	}
	return n, nil
}

// Undrain returns draining or drained node id to service (adopted) and
// clears its drain (deadline, reason, drainer, start, retiring): a retire
// still draining is cancelled. A retiring node already drained is past
// return (its retirement is under way), and a retired one is gone for good:
// both, like any other state, are CONFLICT on "nodeId"; no node is
// NOT_FOUND.
func Undrain(ctx context.Context, q Querier, id string) (Node, error) {
	n, err := scan(q.QueryRow(ctx, `
		UPDATE nodes SET state = 'adopted', drain_deadline = NULL, drain_reason = '', drain_by = '',
		       drain_started_at = NULL, retiring = false, updated_at = now()
		 WHERE id = $1 AND (state = 'draining' OR (state = 'drained' AND NOT retiring))
		RETURNING `+cols, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, after(ctx, q, id, func(n Node) error {
			if n.State == StateDrained && n.Retiring {
				return fault.Wrap(ErrWrongState, fault.Conflict, "nodeId", "node %s is drained and being retired: it cannot return to service", n.ID)
			}
			return wrongState(n, "undrained", "draining or drained")
		})
	}
	if err != nil {
		return Node{}, fmt.Errorf("undrain node %s: %w", id, err)
	}
	return n, nil
}

// MarkDrained moves node id from draining to drained when its drain is
// over: its deadline passed (database time) or it holds no active booking.
// It returns the node and whether it changed; a node not draining, or
// whose drain is not over, is left alone (false).
func MarkDrained(ctx context.Context, q Querier, id string) (Node, bool, error) {
	n, err := scan(q.QueryRow(ctx, `
		UPDATE nodes n SET state = 'drained', updated_at = now()
		 WHERE n.id = $1 AND n.state = 'draining'
		   AND (n.drain_deadline <= now() OR NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n.id AND b.active))
		RETURNING `+cols, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, false, nil
	}
	if err != nil {
		return Node{}, false, fmt.Errorf("mark node %s drained: %w", id, err)
	}
	return n, true, nil
}

// MarkRetired moves drained, retiring node id to retired (retired_at now)
// once its bookings are gone — or at once when withBookings, for a lost-node
// policy (wait) that keeps them. It returns the node and whether it
// changed; any other node is left alone (false).
func MarkRetired(ctx context.Context, q Querier, id string, withBookings bool) (Node, bool, error) {
	n, err := scan(q.QueryRow(ctx, `
		UPDATE nodes n SET state = 'retired', retired_at = now(), updated_at = now()
		 WHERE n.id = $1 AND n.state = 'drained' AND n.retiring
		   AND ($2 OR NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n.id AND b.active))
		RETURNING `+cols, id, withBookings))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, false, nil
	}
	if err != nil {
		return Node{}, false, fmt.Errorf("mark node %s retired: %w", id, err)
	}
	return n, true, nil
}

// DueDrains returns, in id order and at most limit (0: 1,000), the nodes
// whose drain job has something to do now: draining ones whose deadline
// passed or that hold no active booking, and drained ones being retired —
// one statement, for the job's periodic pass (which is what completes a
// drain at its deadline with the bus down).
func DueDrains(ctx context.Context, q Querier, limit int) ([]string, error) {
	if limit <= 0 {
		limit = 1000
	}
	rows, err := q.Query(ctx, `
		SELECT n.id FROM nodes n
		 WHERE (n.state = 'draining' AND (n.drain_deadline <= now()
		        OR NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n.id AND b.active)))
		    OR (n.state = 'drained' AND n.retiring)
		 ORDER BY n.id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("due drains: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("due drains: %w", err)
	}
	return ids, nil
}

// DrainKeys lists the nodes in shards that are draining, or drained and
// being retired: the drain job's keys for resync.
func DrainKeys(ctx context.Context, q Querier, shards []int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM nodes
		WHERE shard = ANY($1) AND (state = 'draining' OR (state = 'drained' AND retiring)) ORDER BY id`, shards)
	if err != nil {
		return nil, fmt.Errorf("drain keys: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("drain keys: %w", err)
	}
	return ids, nil
}

// ReservationRef names a reservation and its tenant.
type ReservationRef struct {
	ID       string
	TenantID string
}

// LiveReservationsOn lists, in id order, the live reservations (pending,
// placed or bound) holding an active booking on node id: those a drain of
// the node tells (reservation.node_draining). It only reads the bookings
// and reservations tables (pkg/capacity writes them).
func LiveReservationsOn(ctx context.Context, q Querier, id string) ([]ReservationRef, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT r.id, r.tenant_id FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.node_id = $1 AND b.active AND r.state IN ('pending', 'placed', 'bound') ORDER BY r.id`, id)
	if err != nil {
		return nil, fmt.Errorf("reservations on node %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ReservationRef])
	if err != nil {
		return nil, fmt.Errorf("reservations on node %s: %w", id, err)
	}
	return out, nil
}

// Condition types a node list can be filtered on ([Filter.Condition]):
// Ready (values True, Unknown, Lost), Draining (True while draining or
// drained), NeedsRepair (the latched nodes.needs_repair), Drifted
// (fleet.drift's) and the inventory controller's conditions in
// nodes.conditions.
const (
	ConditionDraining    = "Draining"
	ConditionNeedsRepair = "NeedsRepair"
	// ConditionUpgradeFailed holds while the node's agent section reports
	// a latched failed upgrade (nodes.upgrade_failed, see [RecordObserved]).
	ConditionUpgradeFailed = "UpgradeFailed"
)

// InventoryConditions are the condition types the inventory controller
// stores in nodes.conditions.
var InventoryConditions = []string{"GPUsHealthy", "DevicesPresent", "AcceptancePassed", "InventoryReported"}

// ConditionFilter is a parsed condition filter: nodes whose condition Type
// has value Value (Negate: does not).
type ConditionFilter struct {
	Type   string
	Value  string
	Negate bool
}

// ParseCondition parses a condition filter: "Type" (it holds), "Type=Value"
// or "!Type" (it does not hold; a node without the condition does not hold
// it). Values are True or False, and for Ready also Unknown and Lost. Bad
// syntax, an unknown type or value is INVALID_INPUT on "condition".
func ParseCondition(s string) (ConditionFilter, error) {
	bad := func(format string, args ...any) (ConditionFilter, error) {
		return ConditionFilter{}, fault.New(fault.InvalidInput, "condition", format, args...)
	}
	var f ConditionFilter
	rest := s
	if strings.HasPrefix(rest, "!") {
		f.Negate, rest = true, rest[1:]
	}
	typ, value, hasValue := strings.Cut(rest, "=")
	if hasValue && f.Negate {
		return bad(`expected "Type", "Type=Value" or "!Type", got %q`, s)
	}
	if !hasValue {
		value = ReadyTrue
	}
	known := append([]string{ConditionReady, ConditionDraining, ConditionNeedsRepair, ConditionDrifted, ConditionUpgradeFailed}, InventoryConditions...)
	if !contains(known, typ) {
		return bad("unknown condition type %q in %q: expected one of %s", typ, s, strings.Join(known, ", "))
	}
	values := []string{"True", "False"}
	if typ == ConditionReady {
		values = []string{ReadyTrue, ReadyUnknown, ReadyLost}
	}
	if !contains(values, value) {
		return bad("condition %s has no value %q: expected one of %s", typ, value, strings.Join(values, ", "))
	}
	f.Type, f.Value = typ, value
	return f, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// sql is f as a condition on nodes (unaliased) with its one argument, the
// argument's placeholder being arg.
func (f ConditionFilter) sql(arg string) (string, any) {
	var cond string
	var v any = f.Value
	switch f.Type {
	case ConditionReady:
		cond = "ready = " + arg
	case ConditionDraining:
		cond, v = "(state IN ('draining', 'drained')) = "+arg+"::boolean", f.Value == "True"
	case ConditionNeedsRepair:
		cond, v = "needs_repair = "+arg+"::boolean", f.Value == "True"
	case ConditionUpgradeFailed:
		cond, v = "(upgrade_failed <> '') = "+arg+"::boolean", f.Value == "True"
	default:
		// The inventory controller's conditions and Drifted: a JSON array of
		// {type, status, …}; a node without the condition matches neither
		// value.
		cond = "conditions @> " + arg + "::jsonb"
		v = fmt.Sprintf(`[{"type": %q, "status": %t}]`, f.Type, f.Value == "True")
	}
	if f.Negate {
		cond = "NOT coalesce(" + cond + ", false)"
	}
	return cond, v
}
