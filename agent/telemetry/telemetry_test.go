package telemetry_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/bettercompute/bettercompute/agent/internal/otlptest"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/telemetry"
)

// nextWithGPUs waits for an export carrying GPU metrics (the first one of a
// new exporter always does: the loop collects as it starts).
func nextWithGPUs(t *testing.T, r *otlptest.Receiver) *collectorpb.ExportMetricsServiceRequest {
	t.Helper()
	return r.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool {
		return len(otlptest.ByName(req)["gpu.temperature"]) > 0
	})
}

// mockGPUs opens the mock NVML (eight H200s).
func mockGPUs(t testing.TB) *inventory.Collector {
	t.Helper()
	inv, err := inventory.New(inventory.NewMock(), inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	return inv
}

func newTelemetry(t testing.TB, cfg telemetry.Config) *telemetry.Telemetry {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	tel, err := telemetry.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Close(context.Background()) })
	return tel
}

// TestNodeMetricsReceivedOverOTLP: the exporter driven by the mock NVML
// delivers every GPU's readings, each series carrying its GPU's UUID, and
// the daemon's own metrics, to a real OTLP/gRPC endpoint.
func TestNodeMetricsReceivedOverOTLP(t *testing.T) {
	inv := mockGPUs(t)
	gpus, err := inv.GPUs(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var uuids []string
	for _, g := range gpus {
		uuids = append(uuids, g.GetUuid())
	}
	slices.Sort(uuids)
	// A fault shows in the readings: GPU 3 runs hot with ECC errors.
	if err := inv.Faults().Inject(3, inventory.Fault{TemperatureCelsius: 91, CorrectableECC: 7, UncorrectableECC: 2}); err != nil {
		t.Fatal(err)
	}
	rcv := otlptest.New(t)
	tel := newTelemetry(t, telemetry.Config{GPUs: inv, NodeID: "node-1", Hostname: "gpu-a"})
	tel.SessionUp(true)
	tel.SessionUp(false)
	tel.SessionUp(true)
	tel.SectionConverged("devices", "CONVERGED", 3*time.Millisecond)
	tel.CommandOutcome("SUCCEEDED", "")
	if err := tel.Configure("http://"+rcv.Addr, time.Hour); err != nil {
		t.Fatal(err)
	}
	req := nextWithGPUs(t, rcv)
	if ra := otlptest.Resource(req); ra["service.name"] != "bcd" || ra["bettercompute.node.id"] != "node-1" || ra["host.name"] != "gpu-a" {
		t.Errorf("resource attributes %v: want service.name bcd, the node id and host name", ra)
	}
	got := otlptest.ByName(req)
	for _, name := range []string{
		"gpu.utilization", "gpu.memory.utilization", "gpu.memory.used", "gpu.memory.total", "gpu.temperature", "gpu.power",
		"gpu.clock.sm", "gpu.clock.memory", "gpu.throttle.reasons", "gpu.xid.events", "gpu.pcie.replays",
	} {
		var seen []string
		for _, p := range got[name] {
			seen = append(seen, p.Attrs["gpu.uuid"])
		}
		slices.Sort(seen)
		if !slices.Equal(seen, uuids) {
			t.Errorf("%s: series for GPUs %v, want one per GPU %v", name, seen, uuids)
		}
	}
	if n := len(got["gpu.ecc.errors"]); n != 2*len(uuids) {
		t.Errorf("gpu.ecc.errors: %d series, want corrected and uncorrected per GPU (%d)", n, 2*len(uuids))
	}
	hot := uuids[0]
	for _, g := range gpus {
		if g.GetIndex() == 3 {
			hot = g.GetUuid()
		}
	}
	for _, p := range got["gpu.temperature"] {
		if p.Attrs["gpu.uuid"] == hot && p.Value != 91 {
			t.Errorf("gpu.temperature of the hot GPU: %v, want 91", p.Value)
		}
	}
	for _, p := range got["gpu.ecc.errors"] {
		if p.Attrs["gpu.uuid"] == hot && p.Attrs["ecc.type"] == "uncorrected" && p.Value != 2 {
			t.Errorf("uncorrected ECC errors of the faulty GPU: %v, want 2", p.Value)
		}
	}
	for _, p := range got["gpu.memory.total"] {
		if p.Value <= 0 {
			t.Errorf("gpu.memory.total %v for %s", p.Value, p.Attrs["gpu.uuid"])
		}
	}
	own := map[string]float64{}
	for _, n := range []string{"bcd.session.up", "bcd.session.reconnects", "bcd.converge.duration", "bcd.commands"} {
		if len(got[n]) != 1 {
			t.Errorf("%s: %d series, want 1", n, len(got[n]))
			continue
		}
		own[n] = got[n][0].Value
	}
	if own["bcd.session.up"] != 1 || own["bcd.session.reconnects"] != 1 || own["bcd.converge.duration"] != 1 || own["bcd.commands"] != 1 {
		t.Errorf("own metrics %v: want session up, one reconnect, one converge, one command", own)
	}
	if a := got["bcd.converge.duration"]; len(a) == 1 && a[0].Attrs["section"] != "devices" {
		t.Errorf("converge duration attributes %v: want section devices", a[0].Attrs)
	}
}

// TestTelemetryOffWithoutEndpoint: with no endpoint nothing is exported (no
// export loop runs: Flush has none to ask), a bad endpoint or interval is
// refused naming it, and removing the endpoint stops the export.
func TestTelemetryOffWithoutEndpoint(t *testing.T) {
	rcv := otlptest.New(t)
	var mu sync.Mutex
	exports := 0
	tel := newTelemetry(t, telemetry.Config{GPUs: mockGPUs(t), OnExport: func(error) { mu.Lock(); exports++; mu.Unlock() }})
	if err := tel.Configure("", 0); err != nil {
		t.Fatal(err)
	}
	if ep, iv := tel.Settings(); ep != "" || iv != telemetry.DefaultInterval {
		t.Errorf("settings %q %s: want off at the default interval", ep, iv)
	}
	if err := tel.Flush(t.Context()); err == nil {
		t.Error("Flush without an endpoint exported")
	}
	for _, tc := range []struct {
		endpoint string
		interval time.Duration
		want     string
	}{
		{"ftp://" + rcv.Addr, 0, "endpoint"},
		{"http://", 0, "endpoint"},
		{"http://127.0.0.1:99999", 0, "endpoint"},
		{"http://" + strings.Repeat("a", 3000) + ":1", 0, "endpoint"},
		{"http://" + rcv.Addr, time.Millisecond, "interval"},
		{"http://" + rcv.Addr, 2 * time.Hour, "interval"},
	} {
		if err := tel.Configure(tc.endpoint, tc.interval); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Configure(%.40q, %s): %v, want an error naming the %s", tc.endpoint, tc.interval, err, tc.want)
		}
	}
	// On, one export arrives; off again, the loop is gone (Configure
	// waits for it) and no export is counted after.
	if err := tel.Configure("http://"+rcv.Addr, time.Hour); err != nil {
		t.Fatal(err)
	}
	nextWithGPUs(t, rcv)
	if err := tel.Configure("", 0); err != nil {
		t.Fatal(err)
	}
	if err := tel.Flush(t.Context()); err == nil {
		t.Error("Flush after the endpoint was removed exported")
	}
	mu.Lock()
	before := exports
	mu.Unlock()
	// Nothing runs that could export: the receiver's queue stays as is.
	if n := len(rcv.Reqs); n != 0 {
		t.Errorf("%d exports queued after the endpoint was removed", n)
	}
	if before > 1 {
		t.Errorf("%d export attempts for one hour-long interval, want at most the first", before)
	}
}

// TestTelemetryEndpointChangeSwitchesExporter: a new endpoint at run time
// moves the export there; the old endpoint hears nothing more.
func TestTelemetryEndpointChangeSwitchesExporter(t *testing.T) {
	a, b := otlptest.New(t), otlptest.New(t)
	tel := newTelemetry(t, telemetry.Config{GPUs: mockGPUs(t)})
	if err := tel.Configure("http://"+a.Addr, time.Hour); err != nil {
		t.Fatal(err)
	}
	nextWithGPUs(t, a)
	// The same settings again: no new loop, no new export.
	if err := tel.Configure("http://"+a.Addr, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := tel.Configure("http://"+b.Addr, time.Hour); err != nil {
		t.Fatal(err)
	}
	nextWithGPUs(t, b)
	if ep, _ := tel.Settings(); ep != "http://"+b.Addr {
		t.Errorf("settings name %q, want the new endpoint", ep)
	}
	// Configure returned after the old loop ended, so a's queue is final.
	if n := len(a.Reqs); n != 0 {
		t.Errorf("the old endpoint got %d more exports after the switch", n)
	}
}

// intervalOf is the bcd.telemetry.interval req carries, in seconds (-1
// when absent).
func intervalOf(req *collectorpb.ExportMetricsServiceRequest) float64 {
	if p := otlptest.ByName(req)["bcd.telemetry.interval"]; len(p) == 1 {
		return p[0].Value
	}
	return -1
}

// TestFollowerSiteIntervalAndBack: the site's interval replaces the daemon's
// (an hour here, so only the first export of a loop would come without it):
// three exports arrive at the site's second, each saying so; removed, the
// export loop starts again at the daemon's hour. The same for the
// endpoint: the site's wins, removed the daemon's returns.
func TestFollowerSiteIntervalAndBack(t *testing.T) {
	own, site := otlptest.New(t), otlptest.New(t)
	tel := newTelemetry(t, telemetry.Config{GPUs: mockGPUs(t)})
	f := tel.Follow("http://"+own.Addr, time.Hour)
	t.Cleanup(f.Stop)
	f.Set("", 0)
	if got := intervalOf(nextWithGPUs(t, own)); got != 3600 {
		t.Errorf("first export says interval %v s, want the daemon's 3600", got)
	}
	f.Set("", time.Second)
	for n := 0; n < 3; {
		if intervalOf(own.Next(t)) == 1 {
			n++
		}
	}
	if ep, iv := tel.Settings(); ep != "http://"+own.Addr || iv != time.Second {
		t.Errorf("settings %s %s, want the daemon's endpoint at the site's 1s", ep, iv)
	}
	f.Set("", 0) // the field removed
	own.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool { return intervalOf(req) == 3600 })
	f.Set("http://"+site.Addr, 0)
	if got := intervalOf(nextWithGPUs(t, site)); got != 3600 {
		t.Errorf("export to the site's endpoint says interval %v s, want the daemon's 3600", got)
	}
	f.Set("", 0)
	own.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool { return intervalOf(req) == 3600 })
	if ep, iv := tel.Settings(); ep != "http://"+own.Addr || iv != time.Hour {
		t.Errorf("settings %s %s after the site's were removed, want the daemon's endpoint and 1h", ep, iv)
	}
}

// TestFollowerRefusesBadInterval: an interval outside 1 s to 1 h that
// reaches the exporter anyway leaves the export as it was.
func TestFollowerRefusesBadInterval(t *testing.T) {
	rcv := otlptest.New(t)
	tel := newTelemetry(t, telemetry.Config{GPUs: mockGPUs(t)})
	if err := tel.Configure("http://"+rcv.Addr, 500*time.Millisecond); err == nil {
		t.Error("Configure took an interval of 500ms")
	}
	if err := tel.Configure("http://"+rcv.Addr, 2*time.Hour); err == nil {
		t.Error("Configure took an interval of 2h")
	}
	if ep, _ := tel.Settings(); ep != "" {
		t.Errorf("export on at %q after refused settings", ep)
	}
}

// TestPrometheusEndpoint: the local scrape endpoint serves the same
// metrics, named as Prometheus's OTLP receiver names them.
func TestPrometheusEndpoint(t *testing.T) {
	tel := newTelemetry(t, telemetry.Config{GPUs: mockGPUs(t)})
	tel.SectionConverged("site", "FAILED", 2*time.Second)
	srv := httptest.NewServer(tel.Handler())
	defer srv.Close()
	res, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	body := string(b)
	for _, want := range []string{
		"# TYPE gpu_temperature_celsius gauge", "gpu_memory_used_bytes{gpu_index=\"0\",gpu_uuid=\"GPU-",
		"# TYPE gpu_ecc_errors_total counter", "gpu_power_watts{", "gpu_clock_sm_megahertz{", "gpu_utilization_percent{",
		"gpu_xid_events_total{", "gpu_pcie_replays_total{", "gpu_throttle_reasons{",
		"bcd_session_up 0", `bcd_converge_duration_seconds_bucket{section="site",state="FAILED",le="5"} 1`,
		`bcd_converge_duration_seconds_count{section="site",state="FAILED"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("scrape lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("scrape:\n%s", body)
	}
}

// BenchmarkExport8GPUs is one node's cost per interval at 8 GPUs: an NVML
// collection and an OTLP export to a loopback receiver. It reports the
// bytes of one export request (protobuf, uncompressed).
func BenchmarkExport8GPUs(b *testing.B) {
	rcv := otlptest.New(b)
	tel := newTelemetry(b, telemetry.Config{GPUs: mockGPUs(b), OnExport: func(err error) {
		if err != nil {
			b.Error(err)
		}
	}})
	// Flush runs the loop's own step (collect, export) on the open
	// connection.
	if err := tel.Configure("http://"+rcv.Addr, time.Hour); err != nil {
		b.Fatal(err)
	}
	first := <-rcv.Reqs
	size := proto.Size(first)
	raw, err := proto.Marshal(first)
	if err != nil {
		b.Fatal(err)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(raw); err != nil || zw.Close() != nil {
		b.Fatal(err)
	}
	cpu0 := cpuTime(b)
	for b.Loop() {
		if err := tel.Flush(b.Context()); err != nil {
			b.Fatal(err)
		}
		<-rcv.Reqs
	}
	// The process's CPU time covers the receiver's decoding too: an upper
	// bound for the node's side.
	b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/export")
	b.ReportMetric(float64(size), "bytes/export")
	b.ReportMetric(float64(gz.Len()), "gzip-bytes/export")
	b.ReportMetric(float64(gz.Len())/telemetry.DefaultInterval.Seconds(), "gzip-bytes/s@10s")
}

// cpuTime is the process's user and system CPU time.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkReceiverFleet is one receiver's side of a fleet: export requests
// of 8 GPUs each (as a node sends them, gzip) arriving in parallel over one
// connection per client goroutine. At 10,000 nodes and the 10 s default the
// receiver takes 1,000 of them a second; cpu-µs/request × 1,000 is the
// cores that takes (client and receiver both counted: an upper bound).
func BenchmarkReceiverFleet(b *testing.B) {
	rcv := otlptest.New(b)
	tel := newTelemetry(b, telemetry.Config{GPUs: mockGPUs(b)})
	if err := tel.Configure("http://"+rcv.Addr, time.Hour); err != nil {
		b.Fatal(err)
	}
	req := <-rcv.Reqs
	if err := tel.Configure("", 0); err != nil {
		b.Fatal(err)
	}
	conn, err := grpc.NewClient(rcv.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	client := collectorpb.NewMetricsServiceClient(conn)
	// The receiver drops requests beyond its queue (answering them).
	cpu0 := cpuTime(b)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := client.Export(context.Background(), req, grpc.UseCompressor("gzip")); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/request")
	b.ReportMetric(1000*float64((cpuTime(b)-cpu0).Microseconds())/float64(b.N)/1e6, "cores@10k-nodes")
}
