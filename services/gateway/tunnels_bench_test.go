package gateway_test

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/services/gateway"
)

// BenchmarkTunnels1000 holds 1,000 tunnels open at once through one
// gateway (one node's session; a raw daemon client answers each open on
// the same connection), sends one frame both ways on each, and reports
// the heap per open tunnel — the gateway's end and the daemon client's
// stream together, both in this process — with every tunnel open.
func BenchmarkTunnels1000(b *testing.B) {
	const n = 1000
	f := setup(b)
	f.addNode(b, "node_m")
	cert := f.ca.node(b, "node_m")
	c := f.client(b, f.addr, &cert)
	sess, _ := open(b, c, "node_m")
	for !f.gw.Ready("node_m") {
		runtime.Gosched()
	}
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		tuns := make([]*gateway.Tunnel, n)
		streams := make([]agentv1.NodeService_TunnelClient, n)
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := range n {
			wg.Go(func() {
				t, err := f.gw.OpenTunnel(context.Background(), "node_m", "tun_"+strconv.Itoa(i), "127.0.0.1:2222")
				tuns[i] = t
				if err != nil {
					errs <- err
				}
			})
		}
		for opened := 0; opened < n; { // the daemon: one stream per open, on its connection
			m, err := sess.Recv()
			if err != nil {
				b.Fatal(err)
			}
			o := m.GetOpenTunnel()
			if o == nil {
				continue
			}
			opened++
			st, err := c.Tunnel(b.Context())
			if err != nil {
				b.Fatal(err)
			}
			if err := st.Send(&agentv1.TunnelRequest{TunnelId: o.GetTunnelId()}); err != nil {
				b.Fatal(err)
			}
			i, _ := strconv.Atoi(o.GetTunnelId()[len("tun_"):])
			streams[i] = st
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
		buf := make([]byte, 16)
		for i := range n {
			if _, err := tuns[i].Write([]byte("ping")); err != nil {
				b.Fatal(err)
			}
			if _, err := streams[i].Recv(); err != nil {
				b.Fatal(err)
			}
			if err := streams[i].Send(&agentv1.TunnelRequest{Data: []byte("pong")}); err != nil {
				b.Fatal(err)
			}
			if _, err := tuns[i].Read(buf); err != nil {
				b.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/n, "heap-B/tunnel")
		for i := range n {
			tuns[i].Close(nil)
			_, _ = streams[i].Recv()
		}
	}
}
