package console

import (
	"cmp"
	"net/http"
	"slices"
	"strings"

	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Fleet page bounds.
const (
	// MaxTiles is the most node tiles the fleet page draws; above it the
	// grid shows one group per pool and Ready value.
	MaxTiles = 2000
	// listPage is the page size of every list call: nodes.list's maximum.
	listPage = 1000
	// maxFleetPages bounds the nodes.list pages one fleet page reads
	// (200,000 nodes).
	maxFleetPages = 200
	// maxPools bounds the pools the fleet page shows, each with a
	// capacity.get.
	maxPools = 200
	// maxLabelFilters bounds the key=value pairs of the label filter.
	maxLabelFilters = 16
)

// readyAttr is a Ready condition's value as a tile's data-ready: True,
// False (Lost, or a two-valued False) or Unknown (no heartbeat lately, or
// no condition yet).
func readyAttr(v string) string {
	switch v {
	case "True":
		return "True"
	case "Unknown", "":
		return "Unknown"
	}
	return "False"
}

// readyOf is a node's Ready condition value (True, Unknown, Lost), "" when
// it has none.
func readyOf(n *computev1.Node) string {
	for _, c := range n.GetConditions() {
		if c.GetType() == "Ready" {
			if v := c.GetValue(); v != "" {
				return v
			}
			if c.GetStatus() {
				return "True"
			}
			return "False"
		}
	}
	return ""
}

type count struct {
	Name  string
	Count int
}

type conditionCount struct {
	Type        string
	True, False int
}

type poolRow struct {
	ID, Name, Class                        string
	Nodes                                  int
	Free, Booked, Quarantined, Unavailable int32
	// Drifted counts the pool's nodes whose Drifted condition holds.
	Drifted int32
	// Slices are the pool's MIG slices per profile (capacity.get).
	Slices []sliceCount
	Error  *client.Envelope
}

// sliceCount is one MIG profile's slices in a pool.
type sliceCount struct {
	Profile                                string
	Free, Booked, Quarantined, Unavailable int32
}

// rolloutRow is one rollout on the fleet page.
type rolloutRow struct {
	ID, PoolID, PoolName, State, Message string
	// Batch is the current batch, 1-based (0 before the first); Batches
	// how many the rollout has.
	Batch, Batches int
	Failed         []string
	Created        *timestamppb.Timestamp
}

type tile struct {
	ID, Name, PoolID, State, Ready, ReadyValue string
}

type tileGroup struct {
	PoolID, PoolName string
	// Ready is the group's data-ready (True, False, Unknown); Value the
	// Ready condition's value (True, Unknown, Lost).
	Ready, Value string
	Count        int
}

type fleetFilter struct{ Pool, Label, Condition string }

type fleetData struct {
	Filter     fleetFilter
	Total      int
	States     []count
	Ready      []count
	Conditions []conditionCount
	Pools      []poolRow
	Tiles      []tile
	Groups     []tileGroup
	Aggregated bool
	// Truncated says the fleet has more nodes than one page reads.
	Truncated bool
	MaxTiles  int
	// MIG says a pool has MIG slices.
	MIG bool
	// Rollouts are the tenant's (or the pool's) rollouts: active ones
	// first, then the newest, at most maxRolloutRows.
	Rollouts []rolloutRow
	// RolloutsError is why rollouts.list failed, when it did.
	RolloutsError *client.Envelope
}

// parseLabels reads the label filter: key=value pairs separated by commas.
func parseLabels(s string) (map[string]string, error) {
	if s == "" {
		return nil, nil
	}
	out := map[string]string{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, fault.New(fault.InvalidInput, "label", "expected key=value (pairs separated by commas), got %q", part)
		}
		out[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	if len(out) > maxLabelFilters {
		return nil, fault.New(fault.InvalidInput, "label", "at most %d labels, got %d", maxLabelFilters, len(out))
	}
	return out, nil
}

// listPools reads the tenant's pools (at most maxPools).
func (c *Console) listPools(s *session) ([]*computev1.Pool, error) {
	pc := computev1.NewPoolsServiceClient(c.cfg.Conn)
	var out []*computev1.Pool
	token := ""
	for len(out) < maxPools {
		resp, err := pc.List(s.ctx, &computev1.PoolsServiceListRequest{TenantId: s.Tenant, PageSize: listPage, PageToken: token})
		if err != nil {
			return nil, err
		}
		out = append(out, resp.GetPools()...)
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	return out[:min(len(out), maxPools)], nil
}

// resolvePool takes a pool id or name and returns its id.
func resolvePool(pools []*computev1.Pool, v string) string {
	for _, p := range pools {
		if p.GetId() == v {
			return v
		}
	}
	for _, p := range pools {
		if p.GetName() == v {
			return p.GetId()
		}
	}
	return v
}

func (c *Console) fleetPage(_ http.ResponseWriter, r *http.Request, s *session, p *page) (string, error) {
	p.Title, p.Active = "Fleet", "fleet"
	d := &fleetData{MaxTiles: MaxTiles}
	p.Data = d
	var err error
	if d.Filter.Pool, err = query(r, "pool", maxField); err != nil {
		return "fleet", err
	}
	if d.Filter.Label, err = query(r, "label", 4*maxField); err != nil {
		return "fleet", err
	}
	if d.Filter.Condition, err = query(r, "condition", maxField); err != nil {
		return "fleet", err
	}
	labels, err := parseLabels(d.Filter.Label)
	if err != nil {
		return "fleet", err
	}
	pools, err := c.listPools(s)
	if err != nil {
		return "fleet", err
	}
	poolID := ""
	if d.Filter.Pool != "" {
		poolID = resolvePool(pools, d.Filter.Pool)
	}
	p.Stream = streamURL(s, "node.ready,node.not_ready,node.lost", "", "")

	nc := computev1.NewNodesServiceClient(c.cfg.Conn)
	states := map[string]int{}
	ready := map[string]int{}
	conds := map[string]*conditionCount{}
	perPool := map[string]int{}
	groups := map[[2]string]int{}
	token := ""
	for range maxFleetPages {
		resp, err := nc.List(s.ctx, &computev1.NodesServiceListRequest{
			TenantId: s.Tenant, PoolId: poolID, Labels: labels, Condition: d.Filter.Condition, PageSize: listPage, PageToken: token,
		})
		if err != nil {
			return "fleet", err
		}
		for _, n := range resp.GetNodes() {
			d.Total++
			states[n.GetState()]++
			rv := readyOf(n)
			ready[cmp.Or(rv, "Unknown")]++
			perPool[n.GetPoolId()]++
			for _, cd := range n.GetConditions() {
				cc := conds[cd.GetType()]
				if cc == nil {
					cc = &conditionCount{Type: cd.GetType()}
					conds[cd.GetType()] = cc
				}
				if cd.GetStatus() {
					cc.True++
				} else {
					cc.False++
				}
			}
			groups[[2]string{n.GetPoolId(), cmp.Or(rv, "Unknown")}]++
			if len(d.Tiles) <= MaxTiles {
				d.Tiles = append(d.Tiles, tile{
					ID: n.GetId(), Name: cmp.Or(n.GetHostname(), n.GetId()), PoolID: n.GetPoolId(), State: n.GetState(),
					Ready: readyAttr(rv), ReadyValue: cmp.Or(rv, "Unknown"),
				})
			}
		}
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	d.Truncated = token != ""
	names := map[string]string{}
	for _, pl := range pools {
		names[pl.GetId()] = pl.GetName()
	}
	if len(d.Tiles) > MaxTiles {
		d.Aggregated, d.Tiles = true, nil
		for k, n := range groups {
			d.Groups = append(d.Groups, tileGroup{PoolID: k[0], PoolName: cmp.Or(names[k[0]], k[0]), Ready: readyAttr(k[1]), Value: k[1], Count: n})
		}
		slices.SortFunc(d.Groups, func(a, b tileGroup) int {
			return cmp.Or(cmp.Compare(a.PoolName, b.PoolName), cmp.Compare(a.Value, b.Value))
		})
	}
	d.States = sortedCounts(states)
	d.Ready = sortedCounts(ready)
	for _, cc := range conds {
		d.Conditions = append(d.Conditions, *cc)
	}
	slices.SortFunc(d.Conditions, func(a, b conditionCount) int { return cmp.Compare(a.Type, b.Type) })

	cc := computev1.NewCapacityServiceClient(c.cfg.Conn)
	for _, pl := range pools {
		if poolID != "" && pl.GetId() != poolID {
			continue
		}
		row := poolRow{ID: pl.GetId(), Name: pl.GetName(), Class: pl.GetClass(), Nodes: perPool[pl.GetId()]}
		if pl.GetClass() == "gpu" {
			capa, err := cc.Get(s.ctx, &computev1.CapacityServiceGetRequest{TenantId: s.Tenant, PoolId: pl.GetId()})
			if err != nil {
				env := envelope(err)
				row.Error = &env
			} else {
				t := capa.GetTotal()
				row.Free, row.Booked, row.Quarantined, row.Unavailable = t.GetFree(), t.GetBooked(), t.GetQuarantined(), t.GetUnavailable()
				row.Drifted = capa.GetDriftedNodes()
				for _, m := range capa.GetMigProfiles() {
					mc := m.GetCounts()
					row.Slices = append(row.Slices, sliceCount{Profile: m.GetProfile(), Free: mc.GetFree(), Booked: mc.GetBooked(),
						Quarantined: mc.GetQuarantined(), Unavailable: mc.GetUnavailable()})
				}
				d.MIG = d.MIG || len(row.Slices) > 0
			}
		}
		d.Pools = append(d.Pools, row)
	}
	d.Rollouts, d.RolloutsError = c.listRollouts(s, poolID, names)
	return "fleet", nil
}

// Rollout list bounds.
const (
	// maxRolloutPages bounds the rollouts.list pages the fleet page reads.
	maxRolloutPages = 5
	// rolloutPage is their size.
	rolloutPage = 100
	// maxRolloutRows is how many rollouts the fleet page shows.
	maxRolloutRows = 20
)

// listRollouts reads the tenant's rollouts (pool's, when one is set): the
// active ones first, then the newest.
func (c *Console) listRollouts(s *session, pool string, names map[string]string) ([]rolloutRow, *client.Envelope) {
	rc := computev1.NewRolloutsServiceClient(c.cfg.Conn)
	var all []*computev1.Rollout
	token := ""
	for range maxRolloutPages {
		resp, err := rc.List(s.ctx, &computev1.RolloutsServiceListRequest{TenantId: s.Tenant, PoolId: pool, PageSize: rolloutPage, PageToken: token})
		if err != nil {
			env := envelope(err)
			return nil, &env
		}
		all = append(all, resp.GetRollouts()...)
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	active := func(r *computev1.Rollout) int {
		switch r.GetState() {
		case "pending", "progressing", "paused":
			return 0
		}
		return 1
	}
	slices.SortStableFunc(all, func(a, b *computev1.Rollout) int {
		return cmp.Or(cmp.Compare(active(a), active(b)), b.GetCreateTime().AsTime().Compare(a.GetCreateTime().AsTime()))
	})
	var out []rolloutRow
	for _, r := range all[:min(len(all), maxRolloutRows)] {
		out = append(out, rolloutRow{ID: r.GetId(), PoolID: r.GetPoolId(), PoolName: cmp.Or(names[r.GetPoolId()], r.GetPoolId()),
			State: r.GetState(), Message: r.GetMessage(), Batch: int(r.GetCurrentBatch()) + 1, Batches: len(r.GetBatches()),
			Failed: r.GetFailedNodes(), Created: r.GetCreateTime()})
	}
	return out, nil
}

func sortedCounts(m map[string]int) []count {
	out := make([]count, 0, len(m))
	for k, v := range m {
		out = append(out, count{k, v})
	}
	slices.SortFunc(out, func(a, b count) int { return cmp.Compare(a.Name, b.Name) })
	return out
}
