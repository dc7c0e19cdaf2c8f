package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
)

// captureTx is a transaction that records its one Exec and affects no
// rows (the session is stale), so a report's store runs without a database.
type captureTx struct {
	pgx.Tx
	args []any
}

func (c *captureTx) Exec(_ context.Context, _ string, args ...any) (pgconn.CommandTag, error) {
	c.args = args
	return pgconn.NewCommandTag("INSERT 0 0"), nil
}

// discardUnknown drops the unknown fields of m and its messages: what a
// JSON encoding of m cannot carry.
func discardUnknown(m protoreflect.Message) {
	m.SetUnknown(nil)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i := range v.List().Len() {
				discardUnknown(v.List().Get(i).Message())
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, e protoreflect.Value) bool {
				discardUnknown(e.Message())
				return true
			})
		case !fd.IsList() && !fd.IsMap() && fd.Message() != nil:
			discardUnknown(v.Message())
		}
		return true
	})
}

// FuzzSessionRequest decodes a daemon's Session frame and prepares it the
// way the session loop does, without a database: no panic; the frame
// re-encodes to an equal message; an Observed becomes section status JSON
// that lists every section with its state, flagged failed exactly when one
// failed, and its events are consistent; an InventoryReport is stored as
// proto3 JSON that the inventory controller decodes back to the report.
func FuzzSessionRequest(f *testing.F) {
	for _, m := range []*agentv1.SessionRequest{
		{Body: &agentv1.SessionRequest_Hello{Hello: &agentv1.Hello{NodeId: "n1", BootId: "b1", JournalId: "j1", ObservedGeneration: 3}}},
		{Body: &agentv1.SessionRequest_Heartbeat{Heartbeat: &agentv1.Heartbeat{}}},
		{Body: &agentv1.SessionRequest_Observed{Observed: &agentv1.Observed{Generation: 2, ObservedGeneration: 2, Sections: []*agentv1.SectionStatus{
			{Section: "network", State: agentv1.SectionState_SECTION_STATE_FAILED, Reason: "no link", Generation: 2},
			{Section: "labels", State: agentv1.SectionState(99)},
		}}}},
		{Body: &agentv1.SessionRequest_Observed{Observed: &agentv1.Observed{Generation: 5, ObservedGeneration: 4}}},
		{Body: &agentv1.SessionRequest_Inventory{Inventory: &agentv1.InventoryReport{Sections: []string{"gpus"}, Host: &agentv1.Host{Hostname: "gpu-1", Kernel: "6.8"},
			Gpus: []*agentv1.GPU{{Uuid: "GPU-a", Model: "H100", MemoryBytes: 80 << 30, PciBusId: "0000:01:00.0"}}}}},
		{Body: &agentv1.SessionRequest_CommandUpdate{CommandUpdate: &agentv1.CommandUpdate{Id: "cmd_1", Seq: 1}}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x1a, 0x03, 0x0a, 0x01, 0xff}) // an inventory section that is not UTF-8
	f.Fuzz(func(t *testing.T, b []byte) {
		var m agentv1.SessionRequest
		if err := proto.Unmarshal(b, &m); err != nil {
			return
		}
		again, err := proto.Marshal(&m)
		if err != nil {
			t.Fatalf("a decoded frame does not encode: %v", err)
		}
		var m2 agentv1.SessionRequest
		if err := proto.Unmarshal(again, &m2); err != nil || !proto.Equal(&m, &m2) {
			t.Fatalf("the frame does not round-trip: %v", err)
		}
		g := &Gateway{started: true, reports: make(chan *report, 1), stop: make(chan struct{})}
		s := &session{nodeID: "n1", epoch: 7}
		if obs := m.GetObserved(); obs != nil {
			checkObserved(t, g, s, obs)
		}
		if inv := m.GetInventory(); inv != nil {
			checkInventory(t, g, s, inv)
		}
	})
}

// take answers the next report g's writer gets, after check.
func take(g *Gateway, check func(*report) error) chan error {
	out := make(chan error, 1)
	go func() {
		r := <-g.reports
		err := check(r)
		r.done <- nil
		out <- err
	}()
	return out
}

func checkObserved(t *testing.T, g *Gateway, s *session, obs *agentv1.Observed) {
	var got *report
	res := take(g, func(r *report) error { got = r; return nil })
	if err := g.storeObserved(t.Context(), s, obs); err != nil {
		t.Fatalf("storeObserved: %v", err)
	}
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	r := got.observed
	if got.nodeID != s.nodeID || r == nil || r.obs != obs {
		t.Fatalf("report %+v is not the session's Observed", got)
	}
	var status []struct {
		Section    string `json:"section"`
		State      string `json:"state"`
		Reason     string `json:"reason"`
		Generation int64  `json:"generation"`
	}
	if err := json.Unmarshal(r.status, &status); err != nil || status == nil {
		t.Fatalf("section status %s is not a JSON array: %v", r.status, err)
	}
	if len(status) != len(obs.GetSections()) {
		t.Fatalf("section status has %d sections, the report %d", len(status), len(obs.GetSections()))
	}
	failed := false
	for i, st := range obs.GetSections() {
		failed = failed || st.GetState() == agentv1.SectionState_SECTION_STATE_FAILED || st.GetState() == agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL
		want := status[i]
		if want.Section != st.GetSection() || want.State != st.GetState().String() || want.Reason != st.GetReason() || want.Generation != st.GetGeneration() {
			t.Fatalf("section %d: stored %+v for %v", i, want, st)
		}
	}
	if r.failed != failed {
		t.Fatalf("failed = %v, want %v", r.failed, failed)
	}
	for _, gen := range []int64{0, obs.GetGeneration(), obs.GetObservedGeneration(), obs.GetObservedGeneration() + 1} {
		st := nodestore.Observed{Stored: true, TenantID: "t1", Generation: gen, ObservedGeneration: max(gen, obs.GetObservedGeneration())}
		ev, ok := observedEvent(r, st)
		want := ""
		switch {
		case failed:
			want = "node.convergence_failed"
		case obs.GetObservedGeneration() == gen:
			want = "node.converged"
		}
		if ok != (want != "") || ev.Type != want || (ok && (ev.Resource != s.nodeID || ev.TenantID != "t1")) {
			t.Fatalf("generation %d: event %+v, %v; want %q", gen, ev, ok, want)
		}
	}
}

func checkInventory(t *testing.T, g *Gateway, s *session, inv *agentv1.InventoryReport) {
	if _, err := protojson.Marshal(inv); err != nil {
		// JSON cannot carry it: refused before anything is queued.
		if err := g.storeInventory(t.Context(), s, inv); err == nil {
			t.Fatal("storeInventory stored a report protojson refuses")
		}
		return
	}
	tx := &captureTx{}
	res := take(g, func(r *report) error {
		if r.nodeID != s.nodeID || r.store == nil {
			return fmt.Errorf("report %+v is not a store of the session's inventory", r)
		}
		return r.store(context.Background(), tx, nil)
	})
	if err := g.storeInventory(t.Context(), s, inv); err != nil {
		t.Fatalf("storeInventory: %v", err)
	}
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	if len(tx.args) != 3 || tx.args[0] != s.nodeID || tx.args[1] != s.epoch {
		t.Fatalf("inventory stored with %v", tx.args)
	}
	raw, ok := tx.args[2].(json.RawMessage)
	if !ok {
		t.Fatalf("report stored as %T", tx.args[2])
	}
	var rep agentv1.InventoryReport
	if err := protojson.Unmarshal(raw, &rep); err != nil {
		t.Fatalf("the inventory controller cannot decode the stored report %s: %v", raw, err)
	}
	want := proto.Clone(inv)
	discardUnknown(want.ProtoReflect())
	if !proto.Equal(&rep, want) {
		t.Fatalf("stored report %s decodes to %v, want %v", raw, &rep, want)
	}
}
