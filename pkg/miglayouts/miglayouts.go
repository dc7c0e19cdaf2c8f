// Package miglayouts stores MIG layouts (tables mig_layouts and
// mig_layouts_draining) and says what they mean for a node's GPUs: a
// pool's named layouts and a node's overrides, each a GPU selector (a
// catalog model, or GPU indices) and the GPU instances to create
// (proto/migcatalog's profiles), or MIG mode off. [Validate] is the
// admission check pools.update and nodes.update run; [Resolve] picks the
// layout of each GPU of a node, which the capacity.mig nodespec
// contributor places.
package miglayouts

import (
	"cmp"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/proto/migcatalog"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Bounds of a layout list.
const (
	// MaxLayouts is the most layouts of a pool or a node.
	MaxLayouts = 16
	// MaxName is the longest layout name.
	MaxName = 64
	// MaxIndex is the highest GPU index a selector names.
	MaxIndex = 7
	// MaxInstances is the most GPU instances of one layout (a GPU has 7
	// compute slices).
	MaxInstances = 7
)

// Selector picks GPUs: by catalog model name or by index; exactly one is
// set.
type Selector struct {
	Model   string
	Indices []int
}

// Layout is one named layout.
type Layout struct {
	Name     string
	Selector Selector
	// Profiles are the GPU instances, one profile name per instance;
	// empty when Disabled.
	Profiles []string
	// Disabled turns MIG mode off on the matching GPUs.
	Disabled bool
}

// GPU is what a layout is matched and checked against: one GPU of a node
// as its inventory reports it.
type GPU struct {
	UUID  string
	Index int
	// Model is the catalog model (migcatalog.ByProductName of the
	// reported product name and memory); nil when it has no MIG profiles.
	Model *migcatalog.Model
	// MIGEnabled is the GPU's current mode, as reported.
	MIGEnabled bool
}

// GPUsOf are the GPUs of a node's devices that it still reports, by index;
// nil when there are none (its inventory is not known).
func GPUsOf(devices []nodes.Device) []GPU {
	var out []GPU
	for _, d := range devices {
		if d.Kind != "gpu" || d.MissingSince != nil {
			continue
		}
		m, _ := migcatalog.ByProductName(d.Model, uint64(max(d.MemoryBytes, 0)))
		out = append(out, GPU{UUID: d.ID, Index: d.Index, Model: m, MIGEnabled: d.MIGEnabled})
	}
	slices.SortFunc(out, func(a, b GPU) int { return cmp.Or(cmp.Compare(a.Index, b.Index), cmp.Compare(a.UUID, b.UUID)) })
	return out
}

// Matches reports whether s picks g.
func (s Selector) Matches(g GPU) bool {
	if s.Model != "" {
		return g.Model != nil && strings.EqualFold(g.Model.Name, s.Model)
	}
	return slices.Contains(s.Indices, g.Index)
}

var layoutName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`)

// Validate checks layouts at admission; field prefixes every fault's field
// ("mig" gives "mig.layouts[0].profiles"). gpus are the GPUs of the node
// the layouts are for (nil for a pool's, or a node that reported none):
// an index selector must name GPUs it has, and a layout is checked against
// the models of the GPUs it matches there; otherwise against the
// selector's model, or every catalog model for an index selector (a pool
// mixes models). An impossible layout is INVALID_INPUT naming the
// profile and the GPU model.
func Validate(layouts []Layout, field string, gpus []GPU) error {
	if len(layouts) > MaxLayouts {
		return fault.New(fault.InvalidInput, field+".layouts", "at most %d layouts, got %d", MaxLayouts, len(layouts))
	}
	names := map[string]bool{}
	for i, l := range layouts {
		at := fmt.Sprintf("%s.layouts[%d]", field, i)
		if l.Name == "" {
			return fault.New(fault.InvalidInput, at+".name", "required")
		}
		if len(l.Name) > MaxName || !layoutName.MatchString(l.Name) {
			return fault.New(fault.InvalidInput, at+".name", "expected lowercase letters, digits and inner hyphens, at most %d characters, got %q", MaxName, l.Name)
		}
		if names[l.Name] {
			return fault.New(fault.InvalidInput, at+".name", "layout %q named twice", l.Name)
		}
		names[l.Name] = true
		models, err := selectorModels(l.Selector, at+".gpuSelector", gpus)
		if err != nil {
			return err
		}
		if l.Disabled {
			if len(l.Profiles) > 0 {
				return fault.New(fault.InvalidInput, at+".profiles", "must be empty when disabled (MIG mode off)")
			}
			continue
		}
		if len(l.Profiles) == 0 {
			return fault.New(fault.InvalidInput, at+".profiles", "required: 1 to %d profiles, or disabled", MaxInstances)
		}
		if len(l.Profiles) > MaxInstances {
			return fault.New(fault.InvalidInput, at+".profiles", "at most %d GPU instances per GPU, got %d", MaxInstances, len(l.Profiles))
		}
		for _, m := range models {
			if _, err := m.Place(l.Profiles, nil); err != nil {
				return fault.New(fault.InvalidInput, at+".profiles", "%v", err)
			}
		}
	}
	return nil
}

// selectorModels checks s and returns the catalog models it can match.
func selectorModels(s Selector, field string, gpus []GPU) ([]*migcatalog.Model, error) {
	if (s.Model == "") == (len(s.Indices) == 0) {
		return nil, fault.New(fault.InvalidInput, field, "set exactly one of model and indices")
	}
	if s.Model != "" {
		m, ok := migcatalog.ByName(s.Model)
		if !ok {
			return nil, fault.New(fault.InvalidInput, field+".model", "expected a MIG-capable GPU model (%s), got %q", strings.Join(migcatalog.ModelNames(), ", "), s.Model)
		}
		return []*migcatalog.Model{m}, nil
	}
	if len(s.Indices) > MaxIndex+1 {
		return nil, fault.New(fault.InvalidInput, field+".indices", "at most %d indices, got %d", MaxIndex+1, len(s.Indices))
	}
	seen := map[int]bool{}
	var models []*migcatalog.Model
	for _, ix := range s.Indices {
		if ix < 0 || ix > MaxIndex {
			return nil, fault.New(fault.InvalidInput, field+".indices", "expected GPU indices 0 to %d, got %d", MaxIndex, ix)
		}
		if seen[ix] {
			return nil, fault.New(fault.InvalidInput, field+".indices", "index %d named twice", ix)
		}
		seen[ix] = true
		if gpus == nil {
			continue
		}
		at := slices.IndexFunc(gpus, func(g GPU) bool { return g.Index == ix })
		if at < 0 {
			return nil, fault.New(fault.InvalidInput, field+".indices", "the node reports no GPU %d (it has %d)", ix, len(gpus))
		}
		g := gpus[at]
		if g.Model == nil {
			return nil, fault.New(fault.InvalidInput, field+".indices", "GPU %d (%s) is not a MIG-capable model (%s)", ix, g.UUID, strings.Join(migcatalog.ModelNames(), ", "))
		}
		if !slices.Contains(models, g.Model) {
			models = append(models, g.Model)
		}
	}
	if gpus == nil {
		for i := range migcatalog.Models {
			models = append(models, &migcatalog.Models[i])
		}
	}
	return models, nil
}

// Resolve picks each GPU's layout: the first of node's layouts that
// matches it, else the first of pool's; a GPU none matches is absent.
func Resolve(node, pool []Layout, gpus []GPU) map[string]Layout {
	out := map[string]Layout{}
	for _, g := range gpus {
		for _, list := range [][]Layout{node, pool} {
			if i := slices.IndexFunc(list, func(l Layout) bool { return l.Selector.Matches(g) }); i >= 0 {
				out[g.UUID] = list[i]
				break
			}
		}
	}
	return out
}

// SetPool replaces pool's layouts with layouts.
func SetPool(ctx context.Context, q Querier, pool string, layouts []Layout) error {
	return set(ctx, q, "pool_id", pool, layouts)
}

// SetNode replaces node's layouts (its overrides) with layouts.
func SetNode(ctx context.Context, q Querier, node string, layouts []Layout) error {
	return set(ctx, q, "node_id", node, layouts)
}

func set(ctx context.Context, q Querier, col, id string, layouts []Layout) error {
	if _, err := q.Exec(ctx, `DELETE FROM mig_layouts WHERE `+col+` = $1`, id); err != nil {
		return fmt.Errorf("replace MIG layouts of %s: %w", id, err)
	}
	if len(layouts) == 0 {
		return nil
	}
	pos := make([]int, len(layouts))
	names, models, indices, profiles := make([]string, len(layouts)), make([]string, len(layouts)), make([]string, len(layouts)), make([]string, len(layouts))
	disabled := make([]bool, len(layouts))
	for i, l := range layouts {
		pos[i], names[i], models[i], disabled[i] = i, l.Name, l.Selector.Model, l.Disabled
		indices[i], profiles[i] = arrayLiteral(intsToStrings(l.Selector.Indices)), arrayLiteral(l.Profiles)
	}
	_, err := q.Exec(ctx, `INSERT INTO mig_layouts (`+col+`, position, name, model, indices, profiles, disabled)
		SELECT $1, p, n, m, i::integer[], pr::text[], d
		FROM unnest($2::integer[], $3::text[], $4::text[], $5::text[], $6::text[], $7::boolean[]) AS u(p, n, m, i, pr, d)`,
		id, pos, names, models, indices, profiles, disabled)
	if err != nil {
		return fmt.Errorf("replace MIG layouts of %s: %w", id, err)
	}
	return nil
}

func intsToStrings(v []int) []string {
	out := make([]string, len(v))
	for i, n := range v {
		out[i] = fmt.Sprint(n)
	}
	return out
}

// arrayLiteral is a PostgreSQL array literal of v, each element quoted.
func arrayLiteral(v []string) string {
	var b strings.Builder
	b.WriteByte('{')
	for i, s := range v {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('"')
		b.WriteString(strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s))
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String()
}

// Layouts are the layouts of some pools and nodes, each list in order.
type Layouts struct {
	Pools map[string][]Layout
	Nodes map[string][]Layout
	// Draining are the nodes with a GPU marked draining ([MarkDraining]).
	Draining map[string]bool
}

// Of reads the layouts of pools and nodes, and which of nodes have
// draining marks, in one statement.
func Of(ctx context.Context, q Querier, pools, nodes []string) (Layouts, error) {
	out := Layouts{Pools: map[string][]Layout{}, Nodes: map[string][]Layout{}, Draining: map[string]bool{}}
	rows, err := q.Query(ctx, `SELECT * FROM (
		SELECT false AS mark, coalesce(pool_id, '') AS pool_id, coalesce(node_id, '') AS node_id, position, name, model, indices, profiles, disabled
		FROM mig_layouts WHERE pool_id = ANY($1) OR node_id = ANY($2)
		UNION ALL
		SELECT DISTINCT true, '', node_id, 0, '', '', '{}'::integer[], '{}'::text[], false
		FROM mig_layouts_draining WHERE node_id = ANY($2)) l
		ORDER BY pool_id, node_id, position`, pools, nodes)
	if err != nil {
		return out, fmt.Errorf("read MIG layouts: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var mark bool
		var pool, node string
		var pos int
		var l Layout
		var indices []int32
		if err := rows.Scan(&mark, &pool, &node, &pos, &l.Name, &l.Selector.Model, &indices, &l.Profiles, &l.Disabled); err != nil {
			return out, fmt.Errorf("read MIG layouts: %w", err)
		}
		if mark {
			out.Draining[node] = true
			continue
		}
		for _, ix := range indices {
			l.Selector.Indices = append(l.Selector.Indices, int(ix))
		}
		if len(l.Profiles) == 0 {
			l.Profiles = nil
		}
		if pool != "" {
			out.Pools[pool] = append(out.Pools[pool], l)
		} else {
			out.Nodes[node] = append(out.Nodes[node], l)
		}
	}
	return out, rows.Err()
}

// Waiting is a GPU whose layout change waits for bookings, and the booked
// devices (the GPU itself, or its MIG slices) the change removes.
type Waiting struct {
	GPU     string
	Devices []string
}

// MarkDraining marks node's waiting GPUs (mig_layouts_draining, with the
// booked devices each change removes) and returns the GPUs not marked
// before (whose reservation.device_draining event is due), sorted.
func MarkDraining(ctx context.Context, q Querier, node string, waiting []Waiting) ([]string, error) {
	if len(waiting) == 0 {
		return nil, nil
	}
	gpus, devs := make([]string, len(waiting)), make([]string, len(waiting))
	for i, w := range waiting {
		gpus[i], devs[i] = w.GPU, arrayLiteral(w.Devices)
	}
	rows, err := q.Query(ctx, `INSERT INTO mig_layouts_draining AS d (node_id, gpu_uuid, devices)
		SELECT $1, g, v::text[] FROM unnest($2::text[], $3::text[]) AS u(g, v)
		ON CONFLICT (node_id, gpu_uuid) DO UPDATE SET devices = EXCLUDED.devices WHERE d.devices IS DISTINCT FROM EXCLUDED.devices
		RETURNING gpu_uuid, xmax = 0`, node, gpus, devs)
	if err != nil {
		return nil, fmt.Errorf("mark MIG draining on %s: %w", node, err)
	}
	var out []string
	var g string
	var fresh bool
	_, err = pgx.ForEachRow(rows, []any{&g, &fresh}, func() error {
		if fresh {
			out = append(out, g)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("mark MIG draining on %s: %w", node, err)
	}
	slices.Sort(out)
	return out, nil
}

// Reset policies of a pool (mig_pool_settings.reset_policy, migration
// 00038): what the health job runs when a GPU's MIG mode change waits for
// a reset.
const (
	ResetGPU        = "gpu-reset"
	ResetNodeReboot = "node-reboot"
)

// ResetPolicies lists the reset policies.
var ResetPolicies = []string{ResetGPU, ResetNodeReboot}

// SetResetPolicy sets pool's reset policy; "" (or the default) removes its
// row.
func SetResetPolicy(ctx context.Context, q Querier, pool, policy string) error {
	var err error
	if policy == "" || policy == ResetGPU {
		_, err = q.Exec(ctx, `DELETE FROM mig_pool_settings WHERE pool_id = $1`, pool)
	} else {
		_, err = q.Exec(ctx, `INSERT INTO mig_pool_settings (pool_id, reset_policy) VALUES ($1, $2)
			ON CONFLICT (pool_id) DO UPDATE SET reset_policy = EXCLUDED.reset_policy`, pool, policy)
	}
	if err != nil {
		return fmt.Errorf("set the MIG reset policy of %s: %w", pool, err)
	}
	return nil
}

// ResetPolicyOf returns pool's reset policy ([ResetGPU] when it set none).
func ResetPolicyOf(ctx context.Context, q Querier, pool string) (string, error) {
	rows, err := q.Query(ctx, `SELECT reset_policy FROM mig_pool_settings WHERE pool_id = $1`, pool)
	if err != nil {
		return "", fmt.Errorf("read the MIG reset policy of %s: %w", pool, err)
	}
	p, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", fmt.Errorf("read the MIG reset policy of %s: %w", pool, err)
	}
	if len(p) == 0 {
		return ResetGPU, nil
	}
	return p[0], nil
}

// ClearDraining removes the draining marks of nodes' GPUs but those in
// keep (node id → GPU UUIDs still waiting).
func ClearDraining(ctx context.Context, q Querier, nodes []string, keep map[string][]string) error {
	var kn, kg []string
	for n, gpus := range keep {
		for _, g := range gpus {
			kn, kg = append(kn, n), append(kg, g)
		}
	}
	_, err := q.Exec(ctx, `DELETE FROM mig_layouts_draining d WHERE d.node_id = ANY($1)
		AND (d.node_id, d.gpu_uuid) NOT IN (SELECT * FROM unnest($2::text[], $3::text[]))`, nodes, kn, kg)
	if err != nil {
		return fmt.Errorf("clear MIG draining marks: %w", err)
	}
	return nil
}
