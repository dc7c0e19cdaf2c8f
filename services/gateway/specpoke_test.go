package gateway_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/wake"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestSpecRouterPokesEachGatewayOncePerBatch: a batch of changes is one
// poke per gateway holding some of its nodes, naming exactly those nodes;
// a node no gateway ever held is poked to none.
func TestSpecRouterPokesEachGatewayOncePerBatch(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	sub, err := nc.SubscribeSync(wake.NodeSpecPrefix + ">")
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	r := gateway.NewSpecRouter(nc, nil)
	r.Changed(t.Context(), []nodespec.Change{
		{NodeID: "node_1", Generation: 2, GatewayID: "gw-a"},
		{NodeID: "node_2", Generation: 5, GatewayID: "gw-b"},
		{NodeID: "node_3", Generation: 2, GatewayID: "gw-a"},
		{NodeID: "node_4", Generation: 1},
	})
	got := map[string][]string{}
	for range 2 {
		m, err := sub.NextMsg(5 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		got[strings.TrimPrefix(m.Subject, wake.NodeSpecPrefix)] = strings.Fields(string(m.Data))
	}
	if !slices.Equal(got["gw-a"], []string{"node_1", "node_3"}) || !slices.Equal(got["gw-b"], []string{"node_2"}) || len(got) != 2 {
		t.Fatalf("pokes %v", got)
	}
	if m, err := sub.NextMsg(200 * time.Millisecond); err == nil {
		t.Fatalf("a third poke: %s %q", m.Subject, m.Data)
	}
}
