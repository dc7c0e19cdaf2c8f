package gateway_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestSessionsMetric checks the gauge a gateway's autoscaler reads follows
// the sessions the gateway holds.
func TestSessionsMetric(t *testing.T) {
	t.Parallel()
	f := setup(t)
	reg := prometheus.NewRegistry()
	reg.MustRegister(f.gw.Collector())
	sessions := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == gateway.SessionsMetric {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatalf("no %s gathered", gateway.SessionsMetric)
		return 0
	}
	if n := sessions(); n != 0 {
		t.Fatalf("%s = %v before any session", gateway.SessionsMetric, n)
	}
	f.addNode(t, "node_a")
	cert := f.ca.node(t, "node_a")
	stream, _ := open(t, f.client(t, f.addr, &cert), "node_a")
	poll.Until(t, 15*time.Second, "the gauge to count the session", func() bool { return sessions() == 1 })
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 15*time.Second, "the gauge to drop the closed session", func() bool { return sessions() == 0 })
}
