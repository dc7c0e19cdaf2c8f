package capacity

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/proto/migcatalog"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// sliceEligibleSQL is the condition on nodes n, slices d (devices of kind
// mig) and their GPUs p that makes a slice bookable for $2 (the profile),
// $7 (the model, or ”), $4 (labels) and $5 (lost-after): the node as for a
// whole GPU (nodeEligibleSQL), the slice present and of the profile, its
// GPU healthy, present and not quarantined, neither the slice nor its GPU
// booked, the node's stored mig section not removing it
// (mig_slice_doomed, migration 00039: a pending layout without it) and
// its GPU's layout change not waiting for bookings (a draining mark).
const sliceEligibleSQL = nodeEligibleSQL + `
	AND d.kind = 'mig' AND d.profile = $2 AND d.missing_since IS NULL
	AND p.kind = 'gpu' AND p.healthy AND p.missing_since IS NULL AND p.quarantined_at IS NULL
	AND ($7 = '' OR p.model = $7 OR starts_with(p.model, $7 || ' '))
	AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active)
	AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = p.node_id AND b.device_id = p.id AND b.active)
	AND ` + sliceStaysSQL

// sliceStaysSQL is the condition on nodes n, slices d and their GPUs p
// that the slice is not about to go: the node's stored mig section keeps
// it and its GPU has no draining mark.
const sliceStaysSQL = `NOT mig_slice_doomed(n.spec, p.id, d.profile, d.mig_start)
	AND NOT EXISTS (SELECT 1 FROM mig_layouts_draining w WHERE w.node_id = p.node_id AND w.gpu_uuid = p.id)`

// sliceAtom is one free slice a placement may book.
type sliceAtom struct {
	NodeID, ID, Model string
	ComputeSlices     int
}

// freeSlices reads up to limit free slices of r's profile in r's pool (see
// sliceEligibleSQL), not on the nodes in exclude, packing: the nodes with
// the most bookings first (by id on a tie), reading only as many nodes as
// their free counts (node_slices_free, migration 00037) say hold limit,
// and on a node the slices of GPUs with the most booked slices first (a
// partly used GPU before an unused one), then by GPU index and start.
func freeSlices(ctx context.Context, q Querier, r *Reservation, exclude []string, limit int, o PlaceOptions) ([]sliceAtom, error) {
	labels := r.Constraints.NodeLabels
	if labels == nil {
		labels = map[string]string{}
	}
	exclude = append(append([]string{}, o.Exclude...), exclude...) // never NULL
	rows, err := q.Query(ctx, `
		WITH cand AS (
			SELECT f.node_id, sum(f.free) AS free, coalesce(c.booked, 0) AS booked
			  FROM node_slices_free f JOIN nodes n ON n.id = f.node_id LEFT JOIN node_capacity c ON c.node_id = f.node_id
			 WHERE n.pool_id = $1 AND f.profile = $2 AND f.free > 0 AND ($7 = '' OR f.model = $7 OR starts_with(f.model, $7 || ' '))
			   AND NOT (n.id = ANY($3)) AND `+nodeEligibleSQL+`
			 GROUP BY f.node_id, c.booked),
		picked AS (
			SELECT node_id, booked FROM (
				SELECT node_id, booked, sum(free) OVER (ORDER BY booked DESC, node_id) - free AS before FROM cand) x
			 WHERE before < $6),
		used AS (
			SELECT s.node_id, s.parent_id, count(*) AS n
			  FROM bookings b JOIN devices s ON s.node_id = b.node_id AND s.id = b.device_id
			 WHERE b.node_id IN (SELECT node_id FROM picked) AND b.active AND b.mig_profile <> ''
			 GROUP BY s.node_id, s.parent_id)
		SELECT d.node_id, d.id, p.model, d.compute_slices
		  FROM picked k JOIN nodes n ON n.id = k.node_id JOIN devices d ON d.node_id = k.node_id
		  JOIN devices p ON p.node_id = d.node_id AND p.id = d.parent_id
		  LEFT JOIN used u ON u.node_id = d.node_id AND u.parent_id = d.parent_id
		 WHERE `+sliceEligibleSQL+`
		 ORDER BY k.booked DESC, k.node_id, coalesce(u.n, 0) DESC, p.index, d.mig_start, d.id
		 LIMIT $6`,
		pgx.QueryExecModeCacheDescribe, r.PoolID, r.MigProfile, exclude, labels, o.LostAfter, limit, r.Constraints.Model)
	if err != nil {
		return nil, fmt.Errorf("read free MIG slices: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[sliceAtom])
}

// placeSlices books count MIG slices of r.MigProfile for r (a try of
// [Place]): it picks them with freeSlices, locks their nodes (their
// node_capacity rows, as whole-GPU placement does, passing over nodes a
// concurrent create holds unless nothing fits without them) and inserts
// the bookings if the slices are still free. False when a slice went to a
// concurrent create first (the caller rolls back and tries again); the
// partial unique index bookings_active_atom is what makes a double booking
// impossible. NO_CAPACITY on count when too few slices are free.
func placeSlices(ctx context.Context, tx pgx.Tx, r *Reservation, o PlaceOptions, count int, busy map[string]bool) (bool, error) {
	for {
		var skip []string
		for n := range busy {
			skip = append(skip, n)
		}
		slices.Sort(skip)
		picked, err := freeSlices(ctx, tx, r, skip, count, o)
		if err != nil {
			return false, err
		}
		wait := false
		if len(picked) < count && len(skip) > 0 {
			// It fits only with nodes other creates hold: wait for them.
			wait = true
			if picked, err = freeSlices(ctx, tx, r, nil, count, o); err != nil {
				return false, err
			}
		}
		if len(picked) < count {
			return false, fault.New(fault.NoCapacity, "count",
				"need %d × MIG %s; %d free on schedulable nodes of the pool (slices of healthy GPUs that are not booked whole)",
				count, r.MigProfile, len(picked))
		}
		var want []string
		for _, a := range picked {
			if !slices.Contains(want, a.NodeID) {
				want = append(want, a.NodeID)
			}
		}
		slices.Sort(want)
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
				continue // nothing locked: pick around them
			}
			return false, nil
		}
		return bookSlices(ctx, tx, r, picked)
	}
}

// bookSlices inserts bookings of slices for r, each only if neither it nor
// its GPU has an active booking now (its node is locked: a new statement
// sees every booking committed before); false when one could not be
// booked.
func bookSlices(ctx context.Context, tx pgx.Tx, r *Reservation, slices []sliceAtom) (bool, error) {
	nodes, devs, models, cs := make([]string, len(slices)), make([]string, len(slices)), make([]string, len(slices)), make([]int32, len(slices))
	for i, a := range slices {
		nodes[i], devs[i], models[i], cs[i] = a.NodeID, a.ID, a.Model, int32(a.ComputeSlices)
	}
	tag, err := tx.Exec(ctx, `
		INSERT INTO bookings (reservation_id, node_id, device_id, model, tenant_id, pool_id, mig_profile, compute_slices)
		SELECT $1, t.n, t.d, t.m, $5, $6, $7, t.c FROM unnest($2::text[], $3::text[], $4::text[], $8::int[]) AS t(n, d, m, c)
		  JOIN devices s ON s.node_id = t.n AND s.id = t.d AND s.kind = 'mig' AND s.missing_since IS NULL
		 WHERE NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = t.n AND b.device_id = t.d AND b.active)
		   AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = t.n AND b.device_id = s.parent_id AND b.active)
		ON CONFLICT DO NOTHING`, r.ID, nodes, devs, models, r.TenantID, r.PoolID, r.MigProfile, cs)
	if err != nil {
		return false, fmt.Errorf("insert bookings: %w", err)
	}
	return int(tag.RowsAffected()) == len(slices), nil
}

// CheckMigProfile checks that profile is a MIG profile of pool's GPUs'
// models (proto/migcatalog; the models of its present GPUs, or of any
// catalog model while it has none the catalog knows): INVALID_INPUT on
// migProfile otherwise, naming the models and their profiles.
func CheckMigProfile(ctx context.Context, q Querier, pool, profile string) error {
	// Fast path: the pool has slices of the profile.
	var has bool
	err := q.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM devices d JOIN nodes n ON n.id = d.node_id
		                WHERE d.kind = 'mig' AND d.missing_since IS NULL AND d.profile = $2 AND n.pool_id = $1)`, pool, profile).Scan(&has)
	if err != nil {
		return fmt.Errorf("read pool MIG slices: %w", err)
	}
	if has {
		return nil
	}
	rows, err := q.Query(ctx, `
		SELECT DISTINCT d.model, d.memory_bytes FROM nodes n JOIN devices d ON d.node_id = n.id
		 WHERE n.pool_id = $1 AND d.kind = 'gpu' AND d.missing_since IS NULL`, pool)
	if err != nil {
		return fmt.Errorf("read pool GPU models: %w", err)
	}
	defer rows.Close()
	var models []*migcatalog.Model
	for rows.Next() {
		var name string
		var mem int64
		if err := rows.Scan(&name, &mem); err != nil {
			return err
		}
		if m, ok := migcatalog.ByProductName(name, uint64(max(mem, 0))); ok && !slices.Contains(models, m) {
			models = append(models, m)
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	known := len(models) > 0
	if !known {
		for _, n := range migcatalog.ModelNames() {
			m, _ := migcatalog.ByName(n)
			models = append(models, m)
		}
	}
	var have []string
	for _, m := range models {
		if _, ok := m.Profile(profile); ok {
			return nil
		}
		have = append(have, fmt.Sprintf("%s: %s", m.Name, strings.Join(m.ProfileNames(), ", ")))
	}
	if known {
		return fault.New(fault.InvalidInput, "migProfile", "no MIG profile %q on the GPUs of pool %s (%s)", profile, pool, strings.Join(have, "; "))
	}
	return fault.New(fault.InvalidInput, "migProfile", "no MIG profile %q in the catalog (%s)", profile, strings.Join(have, "; "))
}

// SliceCounts is how many MIG slices of one profile a pool has, by state.
type SliceCounts struct {
	Profile                                string
	Free, Booked, Unavailable, Quarantined int32
}

// MigCounts counts pool's present MIG slices per profile, read now: booked
// (an active booking), quarantined (its GPU is), free (bookable: see
// sliceEligibleSQL) and unavailable (the rest: its GPU unhealthy, missing
// or booked whole, its node not schedulable or unseen for lostAfter, or
// the slice about to go: sliceStaysSQL).
func MigCounts(ctx context.Context, q Querier, pool string, lostAfter time.Duration) ([]SliceCounts, error) {
	rows, err := q.Query(ctx, `
		WITH s AS (
			SELECT d.profile,
			       EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active) AS booked,
			       p.quarantined_at IS NOT NULL AS quarantined,
			       (n.state = 'adopted' AND n.observed_generation >= 1 AND n.last_seen_at > now() - $2::interval
			        AND p.healthy AND p.missing_since IS NULL AND `+sliceStaysSQL+`
			        AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = p.node_id AND b.device_id = p.id AND b.active)) AS ok
			  FROM nodes n JOIN devices d ON d.node_id = n.id AND d.kind = 'mig' AND d.missing_since IS NULL
			  JOIN devices p ON p.node_id = d.node_id AND p.id = d.parent_id
			 WHERE n.pool_id = $1)
		SELECT profile,
		       count(*) FILTER (WHERE ok AND NOT booked AND NOT quarantined), count(*) FILTER (WHERE booked AND NOT quarantined),
		       count(*) FILTER (WHERE NOT ok AND NOT booked AND NOT quarantined), count(*) FILTER (WHERE quarantined)
		  FROM s GROUP BY profile ORDER BY profile`, pool, lostAfter)
	if err != nil {
		return nil, fmt.Errorf("count MIG slices: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[SliceCounts])
	if err != nil {
		return nil, fmt.Errorf("count MIG slices: %w", err)
	}
	return out, nil
}
