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

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

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
// MIG-enabled, without MIG slices, and not put in MIG mode by its node's
// desired state) of the model with the memory, and no active booking.
// capacity_recount (migration 00037) counts the same.
const eligibleSQL = nodeEligibleSQL + `
	AND d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND d.quarantined_at IS NULL AND NOT d.mig_enabled
	AND ($2 = '' OR d.model = $2 OR starts_with(d.model, $2 || ' ')) AND d.memory_bytes >= $3
	AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active)
	AND NOT EXISTS (SELECT 1 FROM devices s WHERE s.node_id = d.node_id AND s.kind = 'mig' AND s.parent_id = d.id AND s.missing_since IS NULL)
	AND NOT coalesce(n.spec->'mig'->'gpus' @> jsonb_build_array(jsonb_build_object('gpuUuid', d.id, 'migEnabled', true)), false)
	AND NOT EXISTS (SELECT 1 FROM mig_layouts_draining w WHERE w.node_id = d.node_id AND w.gpu_uuid = d.id)`

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
	var done bool
	if r.MigProfile != "" {
		done, err = placeSlices(ctx, tx, r, o, count, busy)
	} else {
		var nodes []NodeFree
		nodes, err = freeCounts(ctx, tx, r.PoolID, r.Constraints, o.LostAfter, o.Exclude, count)
		if err != nil {
			return nil, false, err
		}
		slices.SortFunc(nodes, func(a, b NodeFree) int { return strings.Compare(a.NodeID, b.NodeID) })
		done, err = placeOn(ctx, tx, r, nodes, count, attempt, o.LostAfter, busy)
	}
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

// Refused reports whether err is a placement's NO_CAPACITY, QUOTA_EXCEEDED
// or NOT_FOUND (the pool is no longer one the tenant may book: its ancestor
// stopped sharing it) rather than a failure to retry.
func Refused(err error) bool {
	c := fault.CodeOf(err)
	return c == fault.NoCapacity || c == fault.QuotaExceeded || c == fault.NotFound
}
