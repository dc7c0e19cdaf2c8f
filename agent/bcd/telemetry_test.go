package bcd_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/bcd"
	"github.com/bettercompute/bettercompute/agent/internal/otlptest"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestNode_ExportsTelemetryOverOTLP: `bcd node --otlp-endpoint` sends its
// eight mock GPUs' metrics and its own (session up, command outcomes) to a
// real OTLP receiver, under the node's id, and --prometheus-listen serves
// them for a scrape.
func TestNode_ExportsTelemetryOverOTLP(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	root := joinMock(t, cp, t.TempDir())
	rcv := otlptest.New(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	promAddr := lis.Addr().String()
	_ = lis.Close() // bcd listens there (a loopback port just freed)

	nodeID := startNode(t, cp, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-tel",
		"--deny-kinds", "logs.collect", "--otlp-endpoint", "http://" + rcv.Addr, "--telemetry-interval", "1s",
		"--prometheus-listen", promAddr})
	cp.SendCommand(&agentv1.Command{Id: "cmd_t", NodeId: nodeID, Seq: 1, Kind: "logs.collect", NotAfter: timestamppb.New(time.Now().Add(time.Minute))})
	select {
	case <-cp.Updates:
	case <-t.Context().Done():
		t.Fatal("no answer to the command")
	}
	req := rcv.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool {
		got := otlptest.ByName(req)
		up := got["bcd.session.up"]
		rejected := false
		for _, p := range got["bcd.commands"] {
			rejected = rejected || (p.Attrs["outcome"] == "REJECTED" && p.Attrs["reject"] == "UNSUPPORTED")
		}
		return len(got["gpu.utilization"]) == 8 && len(up) == 1 && up[0].Value == 1 && rejected
	})
	if res := otlptest.Resource(req); res["bettercompute.node.id"] != nodeID || res["service.name"] != "bcd" {
		t.Errorf("resource %v: want the node id %s and service bcd", res, nodeID)
	}
	res, err := http.Get("http://" + promAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "gpu_temperature_celsius{") || !strings.Contains(string(b), "bcd_session_up 1") {
		t.Errorf("scrape of --prometheus-listen lacks the GPU and session metrics:\n%s", b)
	}
}

// TestNode_SiteOTLPEndpointMovesTheExport: with no --otlp-endpoint, bcd node
// exports nothing until its site section names an endpoint; then its GPU
// metrics reach that receiver.
func TestNode_SiteOTLPEndpointMovesTheExport(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	root := joinMock(t, cp, t.TempDir())
	rcv := otlptest.New(t)
	nodeID := startNode(t, cp, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-site-tel",
		"--telemetry-interval", "1s"})
	endpoint := "http://" + rcv.Addr
	cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: nodeID},
		Site: &agentv1.SiteSettings{OtlpEndpoint: &endpoint}}})
	req := rcv.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool {
		return len(otlptest.ByName(req)["gpu.utilization"]) == 8
	})
	if res := otlptest.Resource(req); res["bettercompute.node.id"] != nodeID {
		t.Errorf("resource %v: want the node id %s", res, nodeID)
	}
}

// TestNode_SiteTelemetryInterval: the site section's telemetry_interval
// replaces --telemetry-interval live: with the flag at an hour (one export
// per loop start), three exports arrive saying the site's second; a value
// out of bounds is refused naming the field; removed, the export starts
// again at the flag's hour. The site section's status says each.
func TestNode_SiteTelemetryInterval(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	root := joinMock(t, cp, t.TempDir())
	rcv := otlptest.New(t)
	nodeID := startNode(t, cp, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-interval",
		"--otlp-endpoint", "http://" + rcv.Addr, "--telemetry-interval", "1h"})
	interval := func(req *collectorpb.ExportMetricsServiceRequest) float64 {
		if p := otlptest.ByName(req)["bcd.telemetry.interval"]; len(p) == 1 {
			return p[0].Value
		}
		return -1
	}
	desire := func(gen int64, site *agentv1.SiteSettings) *agentv1.SectionStatus {
		t.Helper()
		cp.SetDesired(&agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: nodeID}, Site: site}})
		for {
			select {
			case o := <-cp.Observed:
				for _, s := range o.GetSections() {
					if s.GetSection() == "site" && o.GetGeneration() == gen {
						return s
					}
				}
			case <-t.Context().Done():
				t.Fatalf("no site status for generation %d", gen)
			}
		}
	}

	if st := desire(1, &agentv1.SiteSettings{TelemetryInterval: durationpb.New(time.Second)}); !strings.Contains(st.GetReason(), "telemetry_interval: applied (1s, live)") {
		t.Errorf("site status %v, want telemetry_interval applied", st)
	}
	for n := 0; n < 3; {
		if interval(rcv.Next(t)) == 1 {
			n++
		}
	}
	st := desire(2, &agentv1.SiteSettings{TelemetryInterval: durationpb.New(500 * time.Millisecond)})
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), "telemetry_interval") {
		t.Errorf("site status %v for 500ms, want FAILED_TERMINAL naming telemetry_interval", st)
	}
	if st := desire(3, &agentv1.SiteSettings{}); !strings.Contains(st.GetReason(), "telemetry_interval: unset") {
		t.Errorf("site status %v, want telemetry_interval unset", st)
	}
	rcv.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool { return interval(req) == 3600 })
}

// startNode runs `bcd node` with args until the test ends (then checks it
// exited 0) and returns the node id of its first Hello.
func startNode(t *testing.T, cp *testcontrol.Server, args []string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var nodeErr bytes.Buffer
	go func() { done <- bcd.Run(ctx, args, &bytes.Buffer{}, &nodeErr) }()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("node exited %d: %s", code, nodeErr.String())
		}
	})
	select {
	case h := <-cp.Hellos:
		return h.GetNodeId()
	case code := <-done:
		done <- code
		t.Fatalf("node exited %d: %s", code, nodeErr.String())
	case <-t.Context().Done():
		t.Fatal("no Hello from bcd node")
	}
	return ""
}
