package mcpserver

import (
	"encoding/json"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// The tools' outputs: small summaries of the API's resources with their
// ids, states and conditions (the JSON schema clients see is generated from
// these types).

// Condition is one of a node's conditions (Ready, Draining, NeedsRepair…).
type Condition struct {
	Type   string `json:"type"`
	Status bool   `json:"status"`
	Value  string `json:"value,omitempty"`
	Reason string `json:"reason,omitempty"`
	// Reasons are each reason of a condition that has several (Drifted).
	Reasons []string `json:"reasons,omitempty"`
	Since   string   `json:"since,omitempty"`
}

// Node is a node's summary.
type Node struct {
	ID                 string            `json:"id"`
	TenantID           string            `json:"tenantId"`
	PoolID             string            `json:"poolId"`
	Hostname           string            `json:"hostname,omitempty"`
	State              string            `json:"state"`
	Schedulable        bool              `json:"schedulable"`
	GPUs               int               `json:"gpus" jsonschema:"GPUs the node has"`
	HealthyGPUs        int               `json:"healthyGpus"`
	QuarantinedGPUs    int               `json:"quarantinedGpus,omitempty"`
	MissingGPUs        int               `json:"missingGpus,omitempty"`
	GPUModels          []string          `json:"gpuModels,omitempty"`
	Conditions         []Condition       `json:"conditions"`
	Labels             map[string]string `json:"labels,omitempty"`
	LastSeenAt         string            `json:"lastSeenAt,omitempty"`
	Generation         int64             `json:"generation"`
	ObservedGeneration int64             `json:"observedGeneration"`
	DrainDeadline      string            `json:"drainDeadline,omitempty"`
	DrainReason        string            `json:"drainReason,omitempty"`
	Retiring           bool              `json:"retiring,omitempty"`
	SpecError          string            `json:"specError,omitempty"`
	MigSlices          int               `json:"migSlices,omitempty" jsonschema:"MIG slices the node's GPUs have"`
	BookedMigSlices    int               `json:"bookedMigSlices,omitempty" jsonschema:"of those, the ones a reservation books"`
	RolloutID          string            `json:"rolloutId,omitempty" jsonschema:"the active rollout the node is in (nodes_get only)"`
	RolloutBatch       *int32            `json:"rolloutBatch,omitempty" jsonschema:"its batch in that rollout, 0-based (nodes_get only)"`
	RolloutReleased    bool              `json:"rolloutReleased,omitempty" jsonschema:"its batch was released: it has the rollout's change"`
}

// GPU is one of a node's GPUs.
type GPU struct {
	ID               string `json:"id"`
	Index            int32  `json:"index"`
	Model            string `json:"model,omitempty"`
	MemoryBytes      int64  `json:"memoryBytes,omitempty"`
	PCIBusID         string `json:"pciBusId,omitempty"`
	Healthy          bool   `json:"healthy"`
	HealthReason     string `json:"healthReason,omitempty"`
	Quarantined      bool   `json:"quarantined,omitempty"`
	QuarantineReason string `json:"quarantineReason,omitempty"`
	Missing          bool   `json:"missing,omitempty"`
	MigEnabled       bool   `json:"migEnabled,omitempty"`
	// MigLayout is the profiles its node's mig section gives it.
	MigLayout []string   `json:"migLayout,omitempty" jsonschema:"the MIG profiles its layout gives it (desired state)"`
	MigSlices []MigSlice `json:"migSlices,omitempty" jsonschema:"its MIG slices as the node reported them, by start"`
}

// MigSlice is one MIG slice of a GPU.
type MigSlice struct {
	ID            string `json:"id" jsonschema:"the slice's MIG-… UUID: the device a booking names"`
	Profile       string `json:"profile"`
	Start         int32  `json:"start" jsonschema:"its first memory slice on the GPU"`
	MemoryBytes   int64  `json:"memoryBytes,omitempty"`
	ComputeSlices int32  `json:"computeSlices,omitempty"`
	Missing       bool   `json:"missing,omitempty"`
	ReservationID string `json:"reservationId,omitempty" jsonschema:"the reservation booking it; empty when free"`
}

// Section is the state of one section of a node's desired state.
type Section struct {
	Section    string `json:"section"`
	State      string `json:"state"`
	Reason     string `json:"reason,omitempty"`
	Generation int64  `json:"generation"`
}

// Command is a command's summary.
type Command struct {
	ID              string `json:"id"`
	NodeID          string `json:"nodeId"`
	Kind            string `json:"kind"`
	State           string `json:"state" jsonschema:"pending, in_flight, or a final state (succeeded, failed, expired, cancelled, timed_out)"`
	Final           bool   `json:"final" jsonschema:"the command settled: its state will not change again"`
	Reason          string `json:"reason,omitempty"`
	Seq             int64  `json:"seq"`
	Attempts        int32  `json:"attempts"`
	NotAfter        string `json:"notAfter,omitempty"`
	CreateTime      string `json:"createTime,omitempty"`
	DispatchTime    string `json:"dispatchTime,omitempty"`
	FinishTime      string `json:"finishTime,omitempty"`
	CancelRequested bool   `json:"cancelRequested,omitempty"`
	// Result is the daemon's result when it is at most maxResultBytes of
	// JSON; a bigger one is left out (ResultTruncated) — read it with
	// `better-compute api commands.get`.
	Result          map[string]any `json:"result,omitempty"`
	ResultBytes     int            `json:"resultBytes,omitempty"`
	ResultTruncated bool           `json:"resultTruncated,omitempty"`
}

// Booking is one booked GPU or MIG slice.
type Booking struct {
	NodeID         string `json:"nodeId"`
	DeviceID       string `json:"deviceId" jsonschema:"the GPU's UUID, or a MIG slice's MIG-… UUID"`
	Model          string `json:"model,omitempty"`
	MigProfile     string `json:"migProfile,omitempty" jsonschema:"for a MIG slice: its profile"`
	ParentDeviceID string `json:"parentDeviceId,omitempty" jsonschema:"for a MIG slice: its GPU's UUID"`
}

// Reservation is a reservation's summary.
type Reservation struct {
	ID         string    `json:"id"`
	TenantID   string    `json:"tenantId"`
	PoolID     string    `json:"poolId"`
	GPUCount   int32     `json:"gpuCount" jsonschema:"GPUs booked, or MIG slices when migProfile is set"`
	MigProfile string    `json:"migProfile,omitempty" jsonschema:"the profile of the MIG slices it books; empty for whole GPUs"`
	Model      string    `json:"model,omitempty"`
	SameNode   bool      `json:"sameNode,omitempty"`
	State      string    `json:"state" jsonschema:"pending, placed, bound, released, expired or failed"`
	Reason     string    `json:"reason,omitempty"`
	Bookings   []Booking `json:"bookings"`
	Nodes      []string  `json:"nodes" jsonschema:"the nodes its GPUs are on"`
	StartTime  string    `json:"startTime,omitempty"`
	EndTime    string    `json:"endTime,omitempty"`
	CreateTime string    `json:"createTime,omitempty"`
	BoundTime  string    `json:"boundTime,omitempty"`
	FinishTime string    `json:"finishTime,omitempty"`
	GPUHours   float64   `json:"gpuHours"`
}

// Counts are GPU counts of a pool.
type Counts struct {
	Free        int32 `json:"free"`
	Booked      int32 `json:"booked"`
	Unavailable int32 `json:"unavailable"`
	Quarantined int32 `json:"quarantined"`
}

// ModelCounts are the counts of one GPU model.
type ModelCounts struct {
	Model string `json:"model"`
	Counts
}

// TenantUsage is one tenant's use of a pool.
type TenantUsage struct {
	TenantID string  `json:"tenantId"`
	Booked   int32   `json:"booked"`
	GPUHours float64 `json:"gpuHours"`
}

// MigProfileCounts are the counts of one MIG profile's slices.
type MigProfileCounts struct {
	Profile string `json:"profile"`
	Counts
}

// Capacity is a pool's capacity.
type Capacity struct {
	PoolID       string             `json:"poolId"`
	Total        Counts             `json:"total" jsonschema:"whole GPUs (a GPU in MIG mode counts as unavailable)"`
	Models       []ModelCounts      `json:"models"`
	MigProfiles  []MigProfileCounts `json:"migProfiles" jsonschema:"MIG slices per profile: free, booked, unavailable, quarantined"`
	Tenants      []TenantUsage      `json:"tenants"`
	DriftedNodes int32              `json:"driftedNodes,omitempty" jsonschema:"nodes whose Drifted condition holds"`
	ComputeTime  string             `json:"computeTime,omitempty"`
}

// Event is one event of the event log.
type Event struct {
	ID            string         `json:"id"`
	Cursor        string         `json:"cursor" jsonschema:"pass as after to list the events after this one"`
	TenantID      string         `json:"tenantId"`
	Type          string         `json:"type"`
	Subject       string         `json:"subject,omitempty"`
	Time          string         `json:"time,omitempty"`
	Data          map[string]any `json:"data,omitempty"`
	DataTruncated bool           `json:"dataTruncated,omitempty"`
}

// maxResultBytes and maxDataBytes bound a command's result and an event's
// data in a tool's answer.
const (
	maxResultBytes = 16 << 10
	maxDataBytes   = 8 << 10
)

func timeString(t *timestamppb.Timestamp) string {
	if t == nil {
		return ""
	}
	return t.AsTime().UTC().Format(time.RFC3339)
}

// bounded returns st as a map when its JSON is at most limit bytes, with
// its size.
func bounded(st *structpb.Struct, limit int) (map[string]any, int, bool) {
	if st == nil {
		return nil, 0, false
	}
	m := st.AsMap()
	b, err := json.Marshal(m)
	if err != nil {
		return nil, 0, true
	}
	if len(b) > limit {
		return nil, len(b), true
	}
	return m, len(b), false
}

func nodeOf(n *computev1.Node) Node {
	out := Node{
		ID: n.GetId(), TenantID: n.GetTenantId(), PoolID: n.GetPoolId(), Hostname: n.GetHostname(), State: n.GetState(),
		Schedulable: n.GetSchedulable(), Conditions: []Condition{}, LastSeenAt: timeString(n.GetLastSeenAt()),
		Generation: n.GetGeneration(), ObservedGeneration: n.GetObservedGeneration(),
		DrainDeadline: timeString(n.GetDrainDeadline()), DrainReason: n.GetDrainReason(), Retiring: n.GetRetiring(),
		SpecError: n.GetSpecError(),
	}
	if len(n.GetLabels()) > 0 {
		out.Labels = n.GetLabels()
	}
	for _, d := range n.GetDevices() {
		if d.GetKind() != "gpu" {
			continue
		}
		out.GPUs++
		switch {
		case d.GetMissingSince() != nil:
			out.MissingGPUs++
		case d.GetQuarantined():
			out.QuarantinedGPUs++
		case d.GetHealthy():
			out.HealthyGPUs++
		}
		if m := d.GetModel(); m != "" && !slices.Contains(out.GPUModels, m) {
			out.GPUModels = append(out.GPUModels, m)
		}
	}
	for _, d := range n.GetDevices() {
		for _, sl := range d.GetMigSlices() {
			out.MigSlices++
			if sl.GetReservationId() != "" {
				out.BookedMigSlices++
			}
		}
	}
	for _, c := range n.GetConditions() {
		out.Conditions = append(out.Conditions, Condition{Type: c.GetType(), Status: c.GetStatus(), Value: c.GetValue(), Reason: c.GetReason(),
			Reasons: c.GetReasons(), Since: timeString(c.GetSince())})
	}
	if id := n.GetRolloutId(); id != "" {
		b := n.GetRolloutBatch()
		out.RolloutID, out.RolloutBatch, out.RolloutReleased = id, &b, n.GetRolloutReleased()
	}
	return out
}

func gpusOf(n *computev1.Node) []GPU {
	out := []GPU{}
	for _, d := range n.GetDevices() {
		if d.GetKind() != "gpu" {
			continue
		}
		out = append(out, GPU{
			ID: d.GetId(), Index: d.GetIndex(), Model: d.GetModel(), MemoryBytes: d.GetMemoryBytes(), PCIBusID: d.GetPciBusId(),
			Healthy: d.GetHealthy(), HealthReason: d.GetHealthReason(), Quarantined: d.GetQuarantined(),
			QuarantineReason: d.GetQuarantineReason(), Missing: d.GetMissingSince() != nil,
			MigEnabled: d.GetMigEnabled(), MigLayout: d.GetMigLayout(), MigSlices: migSlicesOf(d),
		})
	}
	return out
}

func migSlicesOf(d *computev1.Device) []MigSlice {
	var out []MigSlice
	for _, s := range d.GetMigSlices() {
		out = append(out, MigSlice{ID: s.GetId(), Profile: s.GetProfile(), Start: s.GetStart(), MemoryBytes: s.GetMemoryBytes(),
			ComputeSlices: s.GetComputeSlices(), Missing: s.GetMissingSince() != nil, ReservationID: s.GetReservationId()})
	}
	return out
}

func sectionsOf(n *computev1.Node) []Section {
	out := []Section{}
	for _, s := range n.GetSections() {
		out = append(out, Section{Section: s.GetSection(), State: s.GetState(), Reason: s.GetReason(), Generation: s.GetGeneration()})
	}
	return out
}

// finalCommand reports whether a command's state is final.
func finalCommand(state string) bool { return state != "pending" && state != "in_flight" }

func commandOf(c *computev1.Command) Command {
	out := Command{
		ID: c.GetId(), NodeID: c.GetNodeId(), Kind: c.GetKind(), State: c.GetState(), Final: finalCommand(c.GetState()),
		Reason: c.GetReason(), Seq: c.GetSeq(), Attempts: c.GetAttempts(), NotAfter: timeString(c.GetNotAfter()),
		CreateTime: timeString(c.GetCreateTime()), DispatchTime: timeString(c.GetDispatchTime()), FinishTime: timeString(c.GetFinishTime()),
		CancelRequested: c.GetCancelRequestedTime() != nil,
	}
	out.Result, out.ResultBytes, out.ResultTruncated = bounded(c.GetResult(), maxResultBytes)
	return out
}

func reservationOf(r *computev1.Reservation) Reservation {
	out := Reservation{
		ID: r.GetId(), TenantID: r.GetTenantId(), PoolID: r.GetPoolId(), GPUCount: r.GetGpuCount(), MigProfile: r.GetMigProfile(),
		Model: r.GetConstraints().GetModel(), SameNode: r.GetConstraints().GetSameNode(), State: r.GetState(), Reason: r.GetReason(),
		Bookings: []Booking{}, Nodes: []string{},
		StartTime: timeString(r.GetStartTime()), EndTime: timeString(r.GetEndTime()), CreateTime: timeString(r.GetCreateTime()),
		BoundTime: timeString(r.GetBoundTime()), FinishTime: timeString(r.GetFinishTime()), GPUHours: r.GetGpuHours(),
	}
	for _, b := range r.GetBookings() {
		out.Bookings = append(out.Bookings, Booking{NodeID: b.GetNodeId(), DeviceID: b.GetDeviceId(), Model: b.GetModel(),
			MigProfile: b.GetMigProfile(), ParentDeviceID: b.GetParentDeviceId()})
		if !slices.Contains(out.Nodes, b.GetNodeId()) {
			out.Nodes = append(out.Nodes, b.GetNodeId())
		}
	}
	return out
}

func countsOf(c *computev1.CapacityCounts) Counts {
	return Counts{Free: c.GetFree(), Booked: c.GetBooked(), Unavailable: c.GetUnavailable(), Quarantined: c.GetQuarantined()}
}

func capacityOf(pool string, c *computev1.CapacityServiceGetResponse) Capacity {
	out := Capacity{PoolID: pool, Total: countsOf(c.GetTotal()), Models: []ModelCounts{}, MigProfiles: []MigProfileCounts{}, Tenants: []TenantUsage{},
		DriftedNodes: c.GetDriftedNodes(), ComputeTime: timeString(c.GetComputeTime())}
	for _, m := range c.GetModels() {
		out.Models = append(out.Models, ModelCounts{Model: m.GetModel(), Counts: countsOf(m.GetCounts())})
	}
	for _, m := range c.GetMigProfiles() {
		out.MigProfiles = append(out.MigProfiles, MigProfileCounts{Profile: m.GetProfile(), Counts: countsOf(m.GetCounts())})
	}
	for _, t := range c.GetTenants() {
		out.Tenants = append(out.Tenants, TenantUsage{TenantID: t.GetTenantId(), Booked: t.GetBooked(), GPUHours: t.GetGpuHours()})
	}
	return out
}

func eventOf(e *computev1.Event) Event {
	out := Event{ID: e.GetId(), Cursor: e.GetCursor(), TenantID: e.GetTenantId(), Type: e.GetType(), Subject: e.GetSubject(), Time: timeString(e.GetTime())}
	out.Data, _, out.DataTruncated = bounded(e.GetData(), maxDataBytes)
	return out
}
