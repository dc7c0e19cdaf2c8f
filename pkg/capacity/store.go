package capacity

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

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

// DefaultLostAfter is how long a node may go unseen before placement stops
// booking it and the placer treats its bookings as lost.
const DefaultLostAfter = 2 * time.Minute

// Insert writes a new reservation r (state pending, no bookings).
func Insert(ctx context.Context, q Querier, r Reservation) error {
	labels := r.Constraints.NodeLabels
	if labels == nil {
		labels = map[string]string{}
	}
	_, err := q.Exec(ctx, `
		INSERT INTO reservations (id, tenant_id, pool_id, gpu_count, model, min_memory_bytes, same_node, node_labels,
			state, reason, start_time, end_time)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9, $10, $11)`,
		r.ID, r.TenantID, r.PoolID, r.GPUCount, r.Constraints.Model, r.Constraints.MinMemoryBytes, r.Constraints.SameNode,
		labels, r.Reason, r.StartTime, r.EndTime)
	if err != nil {
		return fmt.Errorf("insert reservation: %w", err)
	}
	return nil
}

const rsvCols = `id, tenant_id, pool_id, gpu_count, model, min_memory_bytes, same_node, node_labels, state, reason,
	start_time, end_time, created_at, updated_at, bound_at, finished_at, gpu_hours`

func scanRsv(row pgx.Row) (Reservation, error) {
	var r Reservation
	err := row.Scan(&r.ID, &r.TenantID, &r.PoolID, &r.GPUCount, &r.Constraints.Model, &r.Constraints.MinMemoryBytes,
		&r.Constraints.SameNode, &r.Constraints.NodeLabels, &r.State, &r.Reason, &r.StartTime, &r.EndTime,
		&r.CreatedAt, &r.UpdatedAt, &r.BoundAt, &r.FinishedAt, &r.GPUHours)
	return r, err
}

// Get reads reservation id of tenant with its bookings (the active ones, or
// for a finished reservation the ones it held). A missing one is NOT_FOUND
// on field "id".
func Get(ctx context.Context, q Querier, tenant, id string) (Reservation, error) {
	return get(ctx, q, `SELECT `+rsvCols+` FROM reservations WHERE id = $1 AND tenant_id = $2`, id, tenant)
}

// Lock reads reservation id FOR UPDATE, whatever its tenant.
func Lock(ctx context.Context, q Querier, id string) (Reservation, error) {
	return get(ctx, q, `SELECT `+rsvCols+` FROM reservations WHERE id = $1 FOR UPDATE`, id)
}

func get(ctx context.Context, q Querier, sql string, args ...any) (Reservation, error) {
	r, err := scanRsv(q.QueryRow(ctx, sql, args...))
	if errors.Is(err, pgx.ErrNoRows) {
		return Reservation{}, fault.New(fault.NotFound, "id", "no reservation %q", args[0])
	}
	if err != nil {
		return Reservation{}, fmt.Errorf("read reservation: %w", err)
	}
	if err := loadBookings(ctx, q, []*Reservation{&r}); err != nil {
		return Reservation{}, err
	}
	return r, nil
}

func loadBookings(ctx context.Context, q Querier, rs []*Reservation) error {
	if len(rs) == 0 {
		return nil
	}
	ids := make([]string, len(rs))
	byID := map[string]*Reservation{}
	for i, r := range rs {
		ids[i] = r.ID
		byID[r.ID] = r
	}
	// A live reservation shows its active bookings; a finished one the
	// bookings it held last.
	rows, err := q.Query(ctx, `
		SELECT b.reservation_id, b.node_id, b.device_id, b.model FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.reservation_id = ANY($1) AND (b.active OR (r.state NOT IN ('pending', 'placed', 'bound') AND b.released_at = r.finished_at))
		ORDER BY b.reservation_id, b.node_id, b.device_id`, ids)
	if err != nil {
		return fmt.Errorf("read bookings: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var b Booking
		if err := rows.Scan(&id, &b.NodeID, &b.DeviceID, &b.Model); err != nil {
			return err
		}
		byID[id].Bookings = append(byID[id].Bookings, b)
	}
	return rows.Err()
}

// ListFilter narrows [List].
type ListFilter struct {
	TenantID, PoolID, State string
	// After is the id of the last reservation of the previous page.
	After string
	Limit int
}

// List pages through a tenant's reservations, newest first.
func List(ctx context.Context, q Querier, f ListFilter) ([]Reservation, error) {
	rows, err := q.Query(ctx, `SELECT `+rsvCols+` FROM reservations
		WHERE tenant_id = $1 AND ($2 = '' OR pool_id = $2) AND ($3 = '' OR state = $3)
		  AND ($4 = '' OR (created_at, id) < (SELECT created_at, id FROM reservations WHERE id = $4))
		ORDER BY created_at DESC, id DESC LIMIT $5`, f.TenantID, f.PoolID, f.State, f.After, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list reservations: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Reservation, error) { return scanRsv(r) })
	if err != nil {
		return nil, fmt.Errorf("list reservations: %w", err)
	}
	ptrs := make([]*Reservation, len(out))
	for i := range out {
		ptrs[i] = &out[i]
	}
	return out, loadBookings(ctx, q, ptrs)
}

// Sharing settings of a pool (see pkg/pools).
const (
	sharingNone        = "none"
	sharingDescendants = "descendants"
)

// notBookable is the refusal of a pool that tenant may not book: one that
// does not exist, another tenant's, or an ancestor's that is not shared
// with its descendants. All read the same, so the refusal does not say
// whether an ancestor has such a pool.
func notBookable(tenant, pool string) error {
	return fault.New(fault.NotFound, "poolId", "no pool %q that tenant %s can book (its own pools, or an ancestor's shared with its descendants)", pool, tenant)
}

// PoolOf checks that pool exists, is a GPU pool, and belongs to tenant or
// to one of its ancestors that shares it with its descendants (sharing
// "descendants"); otherwise NOT_FOUND (or INVALID_INPUT for another class)
// on field "poolId". [Place] checks the same again in its transaction.
func PoolOf(ctx context.Context, q Querier, tenant, pool string) error {
	var owner, class, sharing string
	err := q.QueryRow(ctx, `SELECT tenant_id, class, sharing FROM pools WHERE id = $1`, pool).Scan(&owner, &class, &sharing)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && owner != tenant && (sharing != sharingDescendants || iam.Below(tenant, owner) == nil)) {
		return notBookable(tenant, pool)
	}
	if err != nil {
		return fmt.Errorf("read pool: %w", err)
	}
	if class != "gpu" {
		return fault.New(fault.InvalidInput, "poolId", "pool %s is a %s pool; GPUs are reserved in gpu pools", pool, class)
	}
	return nil
}

// eligibleSQL is the condition on nodes n and devices d that makes an atom
// bookable for constraints ($2 model, $3 minimum memory, $4 labels) with
// $5 the lost-after interval: the node adopted (not draining), schedulable
// (observed generation at least 1), seen within lostAfter, carrying the
// labels; the device a healthy, present, not quarantined whole GPU (not
// MIG-enabled) of the model with the memory, and no active booking.
const eligibleSQL = nodeEligibleSQL + `
	AND d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND d.quarantined_at IS NULL AND NOT d.mig_enabled
	AND ($2 = '' OR d.model = $2 OR starts_with(d.model, $2 || ' ')) AND d.memory_bytes >= $3
	AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active)`

// nodeEligibleSQL is the part of eligibleSQL on the node n alone.
const nodeEligibleSQL = `n.state = 'adopted' AND n.observed_generation >= 1
	AND n.last_seen_at > now() - $5::interval AND n.labels @> $4::jsonb`

// FreeCounts lists the eligible nodes of the pool (see eligibleSQL) that
// have free atoms matching c, with how many are free and how many of the
// node's atoms are booked. Free holds one placeholder [Atom] (NodeID only)
// per free atom, for [Plan]; [Place] reads the chosen atoms afterwards.
//
// The counts come from node_capacity and node_capacity_free (migration
// 00010), which triggers on bookings and devices keep equal to the truth:
// about one row per node instead of every device and booking of the pool.
func FreeCounts(ctx context.Context, q Querier, pool string, c Constraints, lostAfter time.Duration) ([]NodeFree, error) {
	return freeCounts(ctx, q, pool, c, lostAfter, nil, 0)
}

// spareCandidates is how many nodes beyond what [Plan] can use [Place]
// reads of each kind of node (same free and booked counts), to plan around
// nodes that concurrent creates hold.
const spareCandidates = 32

// freeCounts is [FreeCounts] without the nodes in exclude and, when count
// is above 0, only the nodes [Plan] can pick for count atoms (and
// spareCandidates more) of each kind. Plan ranks nodes by free atoms, then
// booked atoms, then id, and takes at most ceil(count/free) nodes with free
// atoms each, so the first of each kind by id are the only ones it can
// pick: it plans the same from them as from every node, and a shortage it
// reports is the same (a kind left out has count atoms on the nodes kept).
func freeCounts(ctx context.Context, q Querier, pool string, c Constraints, lostAfter time.Duration, exclude []string, count int) ([]NodeFree, error) {
	labels := c.NodeLabels
	if labels == nil {
		labels = map[string]string{}
	}
	if exclude == nil {
		exclude = []string{}
	}
	// Planned for its arguments each time (an unnamed statement): a cached
	// generic plan guesses a handful of eligible nodes and nests loops over
	// all of them, several times slower at a thousand nodes.
	rows, err := q.Query(ctx, `
		SELECT node_id, booked, free FROM (
			SELECT c.node_id, c.booked, sum(f.free)::int AS free,
			       row_number() OVER (PARTITION BY sum(f.free), c.booked ORDER BY c.node_id) AS rank
			  FROM nodes n JOIN node_capacity c ON c.node_id = n.id JOIN node_capacity_free f ON f.node_id = n.id
			 WHERE n.pool_id = $1 AND `+nodeEligibleSQL+` AND NOT (n.id = ANY($6))
			   AND ($2 = '' OR f.model = $2 OR starts_with(f.model, $2 || ' ')) AND f.memory_bytes >= $3
			 GROUP BY c.node_id, c.booked) k
		 WHERE $7 = 0 OR rank <= ($7 + free - 1) / free + $8`,
		pgx.QueryExecModeCacheDescribe, pool, c.Model, c.MinMemoryBytes, labels, lostAfter, exclude, count, spareCandidates)
	if err != nil {
		return nil, fmt.Errorf("read free capacity: %w", err)
	}
	defer rows.Close()
	var out []NodeFree
	for rows.Next() {
		var n NodeFree
		var free int
		if err := rows.Scan(&n.NodeID, &n.Booked, &free); err != nil {
			return nil, err
		}
		n.Free = make([]Atom, free)
		for i := range n.Free {
			n.Free[i] = Atom{NodeID: n.NodeID, Index: i}
		}
		out = append(out, n)
	}
	return out, rows.Err()
}

// freeAtoms reads the free atoms (see eligibleSQL) of nodes, in device
// order, by node.
func freeAtoms(ctx context.Context, q Querier, nodes []string, c Constraints, lostAfter time.Duration) (map[string][]Atom, error) {
	labels := c.NodeLabels
	if labels == nil {
		labels = map[string]string{}
	}
	rows, err := q.Query(ctx, `
		SELECT d.node_id, d.id, d.model, d.memory_bytes, d.index
		  FROM nodes n JOIN devices d ON d.node_id = n.id
		 WHERE n.id = ANY($1) AND `+eligibleSQL+`
		 ORDER BY d.node_id, d.index, d.id`, nodes, c.Model, c.MinMemoryBytes, labels, lostAfter)
	if err != nil {
		return nil, fmt.Errorf("read free atoms: %w", err)
	}
	defer rows.Close()
	out := map[string][]Atom{}
	for rows.Next() {
		var a Atom
		if err := rows.Scan(&a.NodeID, &a.DeviceID, &a.Model, &a.MemoryBytes, &a.Index); err != nil {
			return nil, err
		}
		out[a.NodeID] = append(out[a.NodeID], a)
	}
	return out, rows.Err()
}

// PlaceOptions tune [Place].
type PlaceOptions struct {
	// LostAfter: see [FreeAtoms]; 0 means [DefaultLostAfter].
	LostAfter time.Duration
	// Exclude are nodes not to book (a lost node being replaced).
	Exclude []string
	// Count books this many atoms instead of the reservation's count (a
	// re-placement of the lost part).
	Count int
}

// Place books atoms for r in tx: it locks the quotas that apply, checks
// that r's tenant may book the pool (see [PoolOf] and [checkShared]), picks
// atoms with [Plan], inserts the bookings and checks the quotas against
// what is now booked, and moves r to placed. It returns the booked nodes
// (whose desired state the caller invalidates). No capacity is NO_CAPACITY
// on gpuCount saying what was missing; over quota (an explicit one or a
// shared pool's default) is QUOTA_EXCEEDED on gpuCount with the limit; a
// pool the tenant may not book (no longer shared) is NOT_FOUND on poolId.
// Each error leaves tx as it was before the call.
func Place(ctx context.Context, tx pgx.Tx, r *Reservation, o PlaceOptions) ([]string, error) {
	if o.LostAfter <= 0 {
		o.LostAfter = DefaultLostAfter
	}
	count := r.GPUCount
	if o.Count > 0 {
		count = o.Count
	}
	// Nodes concurrent creates held when this one tried to lock them.
	busy := map[string]bool{}
	for attempt := 0; ; attempt++ {
		if attempt > 50 {
			return nil, fault.New(fault.Unavailable, "gpuCount", "placement kept losing atoms to concurrent reservations; retry")
		}
		// Each try runs under one savepoint: a failed or lost one leaves
		// tx as it was, its locks released.
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		nodes, done, err := placeOnce(ctx, sp, r, o, count, attempt, busy)
		if err != nil || !done {
			if rerr := sp.Rollback(ctx); err == nil {
				err = rerr
			}
			if err != nil {
				return nil, err
			}
			continue // the counts were stale: count again
		}
		if err := sp.Commit(ctx); err != nil {
			return nil, err
		}
		r.State, r.Reason = StatePlaced, ""
		return nodes, nil
	}
}

// placeOnce is one try of [Place]: false when a planned node had fewer free
// atoms than counted (a concurrent create booked it first), or only some of
// the planned nodes could be locked; the caller then rolls back and tries
// again.
func placeOnce(ctx context.Context, tx pgx.Tx, r *Reservation, o PlaceOptions, count, attempt int, busy map[string]bool) ([]string, bool, error) {
	// Creates under a quota place one at a time; a create that no quota
	// applies to locks nothing here. The same statement reads the pool's
	// tenant.
	var owner string
	var quotas bool
	err := tx.QueryRow(ctx, `
		SELECT p.tenant_id,
		       (SELECT count(*) FROM (SELECT 1 FROM quotas WHERE pool_id = $1 AND tenant_id = ANY($2) FOR UPDATE) l) > 0
		  FROM pools p WHERE p.id = $1`, r.PoolID, iam.Ancestors(r.TenantID)).Scan(&owner, &quotas)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, notBookable(r.TenantID, r.PoolID)
	}
	if err != nil {
		return nil, false, fmt.Errorf("lock quotas: %w", err)
	}
	if owner != r.TenantID {
		if err := checkShared(ctx, tx, r, owner, count); err != nil {
			return nil, false, err
		}
	}
	if attempt >= 5 {
		// Contention: the counts keep going stale before this create
		// books. Queue behind the pool instead; creates that lock the pool
		// place one at a time.
		if _, err := tx.Exec(ctx, `SELECT 1 FROM pools WHERE id = $1 FOR NO KEY UPDATE`, r.PoolID); err != nil {
			return nil, false, fmt.Errorf("lock pool: %w", err)
		}
	}
	nodes, err := freeCounts(ctx, tx, r.PoolID, r.Constraints, o.LostAfter, o.Exclude, count)
	if err != nil {
		return nil, false, err
	}
	slices.SortFunc(nodes, func(a, b NodeFree) int { return strings.Compare(a.NodeID, b.NodeID) })
	done, err := placeOn(ctx, tx, r, nodes, count, attempt, o.LostAfter, busy)
	if err != nil || !done {
		return nil, false, err
	}
	if quotas {
		if err := checkQuotas(ctx, tx, r); err != nil {
			return nil, false, err
		}
	}
	var booked []string
	err = tx.QueryRow(ctx, `
		WITH u AS (
			UPDATE reservations SET state = 'placed', reason = '', updated_at = now()
			 WHERE id = $1 RETURNING id)
		SELECT coalesce(array_agg(DISTINCT node_id ORDER BY node_id), '{}') FROM bookings, u
		 WHERE reservation_id = u.id AND active`, r.ID).Scan(&booked)
	if err != nil {
		return nil, false, fmt.Errorf("mark placed: %w", err)
	}
	return booked, true, nil
}

// placeOn plans count atoms for r on nodes (the counts read at the start of
// the try) and books them. Each planned node is locked first (its
// node_capacity row, which every change to its bookings also locks), so
// nothing books its atoms between the read and the insert. A planned node
// that a concurrent create holds (busy) is passed over and the rest planned
// again without waiting; only when nothing fits without the busy nodes does
// it wait for them. False when a planned node has fewer free atoms than
// counted, or only some of the planned nodes were locked: the caller rolls
// back (releasing them) and counts again. NO_CAPACITY when nothing fits.
func placeOn(ctx context.Context, tx pgx.Tx, r *Reservation, nodes []NodeFree, count, attempt int, lostAfter time.Duration, busy map[string]bool) (bool, error) {
	for {
		wait := false
		planned, short := Plan(slices.DeleteFunc(slices.Clone(nodes), func(n NodeFree) bool { return busy[n.NodeID] }), count, r.Constraints.SameNode)
		if short != nil && len(busy) > 0 {
			// It fits only with nodes other creates hold: wait for them.
			wait = true
			planned, short = Plan(nodes, count, r.Constraints.SameNode)
		}
		if short != nil {
			short.Model = r.Constraints.Model
			return false, fault.New(fault.NoCapacity, "gpuCount", "%s", short.Error())
		}
		var want []string
		for _, a := range planned {
			if !slices.Contains(want, a.NodeID) {
				want = append(want, a.NodeID)
			}
		}
		lock := `SELECT node_id FROM node_capacity WHERE node_id = ANY($1) ORDER BY node_id FOR UPDATE`
		if !wait {
			lock += ` SKIP LOCKED`
		}
		rows, err := tx.Query(ctx, lock, want)
		if err != nil {
			return false, fmt.Errorf("lock nodes: %w", err)
		}
		locked, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return false, fmt.Errorf("lock nodes: %w", err)
		}
		if len(locked) < len(want) {
			for _, n := range want {
				if !slices.Contains(locked, n) {
					busy[n] = true
				}
			}
			if len(locked) == 0 && !wait {
				continue // nothing locked: plan around them
			}
			return false, nil
		}
		atoms, ok, err := pickAtoms(ctx, tx, r, planned, attempt, lostAfter)
		if err != nil || !ok {
			return false, err
		}
		return book(ctx, tx, r, atoms)
	}
}

// pickAtoms reads the free atoms of the planned nodes and takes as many on
// each as planned; false when a node has fewer than that now.
func pickAtoms(ctx context.Context, q Querier, r *Reservation, planned []Atom, attempt int, lostAfter time.Duration) ([]Atom, bool, error) {
	want := map[string]int{}
	var nodes []string
	for _, a := range planned {
		if want[a.NodeID] == 0 {
			nodes = append(nodes, a.NodeID)
		}
		want[a.NodeID]++
	}
	free, err := freeAtoms(ctx, q, nodes, r.Constraints, lostAfter)
	if err != nil {
		return nil, false, err
	}
	var out []Atom
	for _, n := range nodes {
		f := []NodeFree{{NodeID: n, Free: free[n]}}
		if len(f[0].Free) < want[n] {
			return nil, false, nil
		}
		rotate(f, r.ID, attempt)
		out = append(out, f[0].Free[:want[n]]...)
	}
	return out, true, nil
}

// rotate starts each node's free atoms at an offset derived from the
// reservation and the attempt, so concurrent placements that pick the same
// node (packing makes them) mostly pick different atoms of it instead of
// colliding on the first free one.
func rotate(nodes []NodeFree, id string, attempt int) {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	seed := int(h.Sum32()>>1) + attempt
	for i := range nodes {
		f := nodes[i].Free
		if len(f) == 0 {
			continue
		}
		if k := seed % len(f); k > 0 {
			nodes[i].Free = append(f[k:len(f):len(f)], f[:k]...)
		}
	}
}

// book inserts bookings of atoms for r; false when a concurrent transaction
// holds one of them, and then the caller rolls back what was inserted (it
// runs under [Place]'s savepoint for the try). The planned nodes are locked, so that
// takes a writer that books without locking them.
func book(ctx context.Context, tx pgx.Tx, r *Reservation, atoms []Atom) (bool, error) {
	nodes, devs, models := make([]string, len(atoms)), make([]string, len(atoms)), make([]string, len(atoms))
	for i, a := range atoms {
		nodes[i], devs[i], models[i] = a.NodeID, a.DeviceID, a.Model
	}
	tag, err := tx.Exec(ctx, `
		INSERT INTO bookings (reservation_id, node_id, device_id, model, tenant_id, pool_id)
		SELECT $1, n, d, m, $5, $6 FROM unnest($2::text[], $3::text[], $4::text[]) AS t(n, d, m)
		ON CONFLICT DO NOTHING`, r.ID, nodes, devs, models, r.TenantID, r.PoolID)
	if err != nil {
		return false, fmt.Errorf("insert bookings: %w", err)
	}
	return int(tag.RowsAffected()) == len(atoms), nil
}

// checkShared checks a booking of count atoms by r's tenant in a pool of
// another tenant, owner: owner must be an ancestor whose pool is shared
// with its descendants (else NOT_FOUND on poolId, as for another tenant's
// pool), and unless a quota for every model of r's tenant or of an ancestor
// below owner covers it, the pool's default quota bounds what the child of
// owner on that chain and its descendants book (QUOTA_EXCEEDED on
// gpuCount). It locks the pool row first: descendants' bookings in a
// shared pool are placed one at a time, so the count it reads stays true
// until commit, and a concurrent pools.update of the sharing waits.
func checkShared(ctx context.Context, tx pgx.Tx, r *Reservation, owner string, count int) error {
	chain := iam.Below(r.TenantID, owner)
	if chain == nil {
		return notBookable(r.TenantID, r.PoolID)
	}
	var sharing string
	var limit int
	err := tx.QueryRow(ctx, `SELECT sharing, default_quota FROM pools WHERE id = $1 FOR NO KEY UPDATE`, r.PoolID).Scan(&sharing, &limit)
	if errors.Is(err, pgx.ErrNoRows) {
		return notBookable(r.TenantID, r.PoolID)
	}
	if err != nil {
		return fmt.Errorf("lock pool: %w", err)
	}
	if sharing != sharingDescendants {
		return notBookable(r.TenantID, r.PoolID)
	}
	// A new statement after the lock, so it sees every booking committed
	// by the descendants' creates this one waited for.
	top := chain[len(chain)-1]
	var covered bool
	var used int
	err = tx.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM quotas WHERE pool_id = $1 AND tenant_id = ANY($2) AND model = ''),
		       (SELECT count(*) FROM bookings
		         WHERE pool_id = $1 AND active AND (tenant_id = $3 OR starts_with(tenant_id, $3 || '.')))`,
		r.PoolID, chain, top).Scan(&covered, &used)
	if err != nil {
		return fmt.Errorf("check default quota: %w", err)
	}
	if covered || used+count <= limit {
		return nil
	}
	if limit == 0 {
		return fault.New(fault.QuotaExceeded, "gpuCount",
			"no quota for every model is set in pool %s for tenant %s or an ancestor below %s, and the pool's default quota is 0 GPUs: ask tenant %s for a quota",
			r.PoolID, r.TenantID, owner, owner)
	}
	return fault.New(fault.QuotaExceeded, "gpuCount",
		"no quota for every model is set in pool %s for tenant %s or an ancestor below %s, so the pool's default quota applies: %d GPUs for %s and its descendants; %d in use, this reservation asks for %d more",
		r.PoolID, r.TenantID, owner, limit, top, used, count)
}

// checkQuotas fails with QUOTA_EXCEEDED if, with r's bookings inserted, any
// quota of r's tenant or its ancestors in r's pool is over its limit. The
// quota rows are locked by the caller, so concurrent creates under one quota
// see each other's bookings.
func checkQuotas(ctx context.Context, tx pgx.Tx, r *Reservation) error {
	rows, err := tx.Query(ctx, `
		SELECT q.tenant_id, q.model, q.gpu_limit,
		       (SELECT count(*) FROM bookings b
		         WHERE b.pool_id = q.pool_id AND b.active
		           AND (q.tenant_id = 'root' OR b.tenant_id = q.tenant_id OR b.tenant_id LIKE q.tenant_id || '.%')
		           AND (q.model = '' OR b.model = q.model OR starts_with(b.model, q.model || ' '))) AS used,
		       (SELECT count(*) FROM bookings b
		         WHERE b.reservation_id = $3 AND b.active AND (q.model = '' OR b.model = q.model OR starts_with(b.model, q.model || ' '))) AS mine
		  FROM quotas q
		 WHERE q.pool_id = $1 AND q.tenant_id = ANY($2)
		 ORDER BY length(q.tenant_id) DESC, q.model`, r.PoolID, iam.Ancestors(r.TenantID), r.ID)
	if err != nil {
		return fmt.Errorf("check quotas: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var tenant, model string
		var limit, used, mine int
		if err := rows.Scan(&tenant, &model, &limit, &used, &mine); err != nil {
			return err
		}
		if mine > 0 && used > limit {
			what := "GPUs"
			if model != "" {
				what = model + " GPUs"
			}
			return fault.New(fault.QuotaExceeded, "gpuCount",
				"quota of tenant %s in pool %s is %d %s; %d in use, this reservation asks for %d more",
				tenant, r.PoolID, limit, what, used-mine, mine)
		}
	}
	return rows.Err()
}

// SetPending records why r stays pending.
func SetPending(ctx context.Context, q Querier, id, reason string) error {
	_, err := q.Exec(ctx, `UPDATE reservations SET reason = $2, updated_at = now()
		WHERE id = $1 AND state = 'pending' AND reason <> $2`, id, reason)
	return err
}

// Finish ends live reservation id in state (released, expired or failed)
// with reason: its bookings are freed. It returns the nodes that held them
// (whose desired state the caller invalidates) and false when the
// reservation was already finished (nothing changed).
func Finish(ctx context.Context, q Querier, id, state, reason string) ([]string, bool, error) {
	var nodes []string
	var changed bool
	err := q.QueryRow(ctx, `
		WITH r AS (
			UPDATE reservations SET state = $2, reason = $3, finished_at = now(), updated_at = now()
			 WHERE id = $1 AND state IN ('pending', 'placed', 'bound') RETURNING id, finished_at),
		b AS (
			UPDATE bookings SET active = false, released_at = r.finished_at FROM r
			 WHERE bookings.reservation_id = r.id AND bookings.active RETURNING bookings.node_id)
		SELECT (SELECT count(*) > 0 FROM r), coalesce((SELECT array_agg(DISTINCT node_id ORDER BY node_id) FROM b), '{}')`,
		id, state, reason).Scan(&changed, &nodes)
	if err != nil {
		return nil, false, fmt.Errorf("finish reservation %s: %w", id, err)
	}
	return nodes, changed, nil
}

// Unbook frees r's active bookings on node (a lost node being replaced) and
// moves r back to placed; the caller books replacements.
func Unbook(ctx context.Context, q Querier, id, node string) (int, error) {
	tag, err := q.Exec(ctx, `UPDATE bookings SET active = false, released_at = now()
		WHERE reservation_id = $1 AND node_id = $2 AND active`, id, node)
	if err != nil {
		return 0, fmt.Errorf("unbook %s on %s: %w", id, node, err)
	}
	return int(tag.RowsAffected()), nil
}

// UnbookDevice frees r's active booking of device on node (a quarantined
// GPU being replaced) and returns how many it freed (0 or 1); the caller
// books a replacement.
func UnbookDevice(ctx context.Context, q Querier, id, node, device string) (int, error) {
	tag, err := q.Exec(ctx, `UPDATE bookings SET active = false, released_at = now()
		WHERE reservation_id = $1 AND node_id = $2 AND device_id = $3 AND active`, id, node, device)
	if err != nil {
		return 0, fmt.Errorf("unbook %s of %s on %s: %w", device, id, node, err)
	}
	return int(tag.RowsAffected()), nil
}

// DeviceBookings lists the live reservations with an active booking of
// device on node, by id.
func DeviceBookings(ctx context.Context, q Querier, node, device string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT b.reservation_id FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.node_id = $1 AND b.device_id = $2 AND b.active AND r.state IN ('pending', 'placed', 'bound')
		ORDER BY b.reservation_id`, node, device)
	if err != nil {
		return nil, fmt.Errorf("bookings of %s on %s: %w", device, node, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Assignments is one node's active bookings by reservation: Order lists the
// reservations sorted, Devices their devices sorted.
type Assignments struct {
	Order   []string
	Devices map[string][]string
}

// NodesAssignments is [NodeAssignments] for many nodes in one statement:
// nodes without bookings are absent from the map.
func NodesAssignments(ctx context.Context, q Querier, nodes []string) (map[string]*Assignments, error) {
	rows, err := q.Query(ctx, `SELECT node_id, reservation_id, device_id FROM bookings WHERE node_id = ANY($1) AND active
		ORDER BY node_id, reservation_id, device_id`, nodes)
	if err != nil {
		return nil, fmt.Errorf("read bookings of %d nodes: %w", len(nodes), err)
	}
	defer rows.Close()
	out := map[string]*Assignments{}
	for rows.Next() {
		var node, rsv, dev string
		if err := rows.Scan(&node, &rsv, &dev); err != nil {
			return nil, err
		}
		a := out[node]
		if a == nil {
			a = &Assignments{Devices: map[string][]string{}}
			out[node] = a
		}
		if _, ok := a.Devices[rsv]; !ok {
			a.Order = append(a.Order, rsv)
		}
		a.Devices[rsv] = append(a.Devices[rsv], dev)
	}
	return out, rows.Err()
}

// AwaitingBind returns which of nodes hold an active booking of a placed
// reservation: the nodes whose convergence may bind one ([Bind]).
func AwaitingBind(ctx context.Context, q Querier, nodes []string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT b.node_id FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.node_id = ANY($1) AND b.active AND r.state = 'placed'`, nodes)
	if err != nil {
		return nil, fmt.Errorf("nodes awaiting bind: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Bind moves every placed reservation with bookings on node to bound when
// all of its booked nodes have observed a generation whose spec exposes its
// devices, and returns those bound (id and tenant).
func Bind(ctx context.Context, q Querier, node string) ([][2]string, error) {
	rows, err := q.Query(ctx, `
		UPDATE reservations r SET state = 'bound', bound_at = now(), updated_at = now(), reason = ''
		 WHERE r.state = 'placed'
		   AND r.id IN (SELECT reservation_id FROM bookings WHERE node_id = $1 AND active)
		   AND NOT EXISTS (
		       SELECT 1 FROM bookings b JOIN nodes n ON n.id = b.node_id
		        WHERE b.reservation_id = r.id AND b.active
		          AND NOT (n.generation >= 1 AND n.observed_generation >= n.generation
		                   AND EXISTS (SELECT 1 FROM jsonb_array_elements(coalesce(n.spec->'devices'->'assignments', '[]')) a
		                                WHERE a->>'reservationId' = r.id AND coalesce(a->'gpuUuids', '[]') ? b.device_id)))
		RETURNING r.id, r.tenant_id`, node)
	if err != nil {
		return nil, fmt.Errorf("bind reservations on %s: %w", node, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]string, error) {
		var v [2]string
		return v, r.Scan(&v[0], &v[1])
	})
}

// Quota bounds a tenant's bookings in a pool.
type Quota struct {
	PoolID, TenantID, Model string
	GPULimit                int
	UpdatedAt               time.Time
}

// SetQuota sets (limit ≥ 0) or removes (limit < 0) a quota; removing
// returns false.
func SetQuota(ctx context.Context, q Querier, qt Quota) (Quota, bool, error) {
	if qt.GPULimit < 0 {
		_, err := q.Exec(ctx, `DELETE FROM quotas WHERE pool_id = $1 AND tenant_id = $2 AND model = $3`, qt.PoolID, qt.TenantID, qt.Model)
		return Quota{}, false, err
	}
	err := q.QueryRow(ctx, `
		INSERT INTO quotas (pool_id, tenant_id, model, gpu_limit) VALUES ($1, $2, $3, $4)
		ON CONFLICT (pool_id, tenant_id, model) DO UPDATE SET gpu_limit = EXCLUDED.gpu_limit, updated_at = now()
		RETURNING updated_at`, qt.PoolID, qt.TenantID, qt.Model, qt.GPULimit).Scan(&qt.UpdatedAt)
	if err != nil {
		return Quota{}, false, fmt.Errorf("set quota: %w", err)
	}
	return qt, true, nil
}

// ListQuotas lists pool's quotas.
func ListQuotas(ctx context.Context, q Querier, pool string) ([]Quota, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, tenant_id, model, gpu_limit, updated_at FROM quotas
		WHERE pool_id = $1 ORDER BY tenant_id, model`, pool)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Quota, error) {
		var v Quota
		return v, r.Scan(&v.PoolID, &v.TenantID, &v.Model, &v.GPULimit, &v.UpdatedAt)
	})
}

// Why explains in a sentence why a pending reservation is not placed yet.
func Why(r Reservation, now time.Time) string {
	if r.StartTime != nil && r.StartTime.After(now) {
		return "starts at " + r.StartTime.UTC().Format(time.RFC3339) + "; the placer places it then"
	}
	return strings.TrimSpace(r.Reason)
}

// Refused reports whether err is a placement's NO_CAPACITY, QUOTA_EXCEEDED
// or NOT_FOUND (the pool is no longer one the tenant may book: its ancestor
// stopped sharing it) rather than a failure to retry.
func Refused(err error) bool {
	c := fault.CodeOf(err)
	return c == fault.NoCapacity || c == fault.QuotaExceeded || c == fault.NotFound
}
