package wake_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// TestMain fails on a goroutine the waker leaves behind (its in-process
// dispatches end with them).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// localGateway records what the waker dispatched and delivered in process.
type localGateway struct {
	holds     map[string]bool
	nodes     chan string
	delivered chan []string
}

func (g *localGateway) Holds(id string) bool { return g.holds[id] }

func (g *localGateway) Dispatch(_ context.Context, id string) error {
	g.nodes <- id
	return nil
}

func (g *localGateway) DispatchSite(context.Context, string) error { return nil }

func (g *localGateway) Deliver(_ context.Context, ids ...string) error {
	g.delivered <- ids
	return nil
}

func receive[T any](t *testing.T, ch chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("no " + what)
		var zero T
		return zero
	}
}

// TestNodeWakesGoWhereTheNodeIs: a node held by this process's gateway is
// dispatched in process, one held by another gateway is woken on that
// gateway's subject alone, and one held by none wakes nobody.
func TestNodeWakesGoWhereTheNodeIs(t *testing.T) {
	ns := natstest.New(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	heard := make(chan string, 8)
	sub, err := nc.Subscribe(wake.CommandsPrefix+"*", func(m *nats.Msg) { heard <- m.Subject + " " + string(m.Data) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	var asked [][]string
	w := wake.New(nc, func(_ context.Context, ids []string) (map[string]string, error) {
		asked = append(asked, ids)
		return map[string]string{"node_b": "gw-2"}, nil // node_c has no session
	}, nil)
	local := &localGateway{holds: map[string]bool{"node_a": true}, nodes: make(chan string, 8)}
	w.SetGateway(local)

	w.Wake(wake.Set{Nodes: []string{"node_a", "node_b", "node_c"}})
	if got := receive(t, local.nodes, "local dispatch"); got != "node_a" {
		t.Fatalf("dispatched %s in process, want node_a", got)
	}
	if got := receive(t, heard, "command wake"); got != "bc.commands.gw-2 node_b" {
		t.Fatalf("heard %q, want node_b on gw-2's subject", got)
	}
	if len(asked) != 1 || !slices.Equal(asked[0], []string{"node_b", "node_c"}) {
		t.Fatalf("looked up %v, want only the nodes not held here", asked)
	}
	// Nothing else was published: a marker sent after arrives next.
	if err := nc.Publish(wake.CommandsSubject("marker"), nil); err != nil {
		t.Fatal(err)
	}
	if got := receive(t, heard, "marker"); got != "bc.commands.marker " {
		t.Fatalf("heard %q, want only the marker", got)
	}

	var none *wake.Waker
	none.Wake(wake.Set{Nodes: []string{"node_a"}, Deliveries: true}) // a nil waker does nothing
}

// TestSpecWakesGoWhereTheNodeIs: a transaction's desired-state wakes are
// one in-process delivery of the nodes this process's gateway holds, and
// one wake per other gateway naming exactly its nodes; a node no gateway
// held wakes nobody (its gateway's resync delivers it when it connects).
func TestSpecWakesGoWhereTheNodeIs(t *testing.T) {
	ns := natstest.New(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	heard := make(chan string, 8)
	sub, err := nc.Subscribe(wake.NodeSpecPrefix+"*", func(m *nats.Msg) { heard <- m.Subject + " " + string(m.Data) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	w := wake.New(nc, nil, nil)
	local := &localGateway{holds: map[string]bool{"node_l1": true, "node_l2": true}, delivered: make(chan []string, 8)}
	w.SetGateway(local)

	w.Wake(wake.Set{Specs: []wake.Spec{
		{NodeID: "node_l1", GatewayID: "gw-here"},
		{NodeID: "node_1", GatewayID: "gw-a"},
		{NodeID: "node_2", GatewayID: "gw-b"},
		{NodeID: "node_3", GatewayID: "gw-a"},
		{NodeID: "node_l2"},
		{NodeID: "node_4"},
	}})
	if got := receive(t, local.delivered, "local delivery"); !slices.Equal(got, []string{"node_l1", "node_l2"}) {
		t.Fatalf("delivered %v in process, want node_l1 and node_l2", got)
	}
	got := []string{receive(t, heard, "spec wake"), receive(t, heard, "spec wake")}
	slices.Sort(got)
	if want := []string{"bc.nodespec.gw-a node_1\nnode_3", "bc.nodespec.gw-b node_2"}; !slices.Equal(got, want) {
		t.Fatalf("heard %q, want %q", got, want)
	}
	// Nothing else was published: a marker sent after arrives next.
	if err := nc.Publish(wake.NodeSpecSubject("marker"), nil); err != nil {
		t.Fatal(err)
	}
	if got := receive(t, heard, "marker"); got != "bc.nodespec.marker " {
		t.Fatalf("heard %q, want only the marker", got)
	}
	select {
	case ids := <-local.delivered:
		t.Fatalf("a second local delivery %v", ids)
	default:
	}
}
