// Package otlptest is a real OTLP/gRPC metrics receiver on a loopback port
// for tests: it implements the collector's MetricsService and hands every
// export request to the test.
package otlptest

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	metricspb "go.opentelemetry.io/proto/otlp/metrics/v1"
	"google.golang.org/grpc"
)

// Receiver is an OTLP/gRPC metrics endpoint on 127.0.0.1.
type Receiver struct {
	collectorpb.UnimplementedMetricsServiceServer
	// Addr is its host:port; "http://"+Addr is the exporter's endpoint.
	Addr string
	// Reqs receives every export request (buffered; requests beyond its
	// room are dropped, answered as received).
	Reqs chan *collectorpb.ExportMetricsServiceRequest
}

// New starts a Receiver, stopped when t ends.
func New(t testing.TB) *Receiver {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Receiver{Addr: lis.Addr().String(), Reqs: make(chan *collectorpb.ExportMetricsServiceRequest, 64)}
	srv := grpc.NewServer()
	collectorpb.RegisterMetricsServiceServer(srv, r)
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(lis) })
	t.Cleanup(func() { srv.Stop(); wg.Wait() })
	return r
}

// Export implements the MetricsService.
func (r *Receiver) Export(_ context.Context, req *collectorpb.ExportMetricsServiceRequest) (*collectorpb.ExportMetricsServiceResponse, error) {
	select {
	case r.Reqs <- req:
	default:
	}
	return &collectorpb.ExportMetricsServiceResponse{}, nil
}

// Next is the next export request; the test fails when its context ends
// first.
func (r *Receiver) Next(t *testing.T) *collectorpb.ExportMetricsServiceRequest {
	t.Helper()
	select {
	case req := <-r.Reqs:
		return req
	case <-time.After(time.Minute):
		t.Fatal("no OTLP export arrived within a minute")
		return nil
	case <-t.Context().Done():
		t.Fatal("no OTLP export arrived")
		return nil
	}
}

// Until returns the first export request ok accepts.
func (r *Receiver) Until(t *testing.T, ok func(*collectorpb.ExportMetricsServiceRequest) bool) *collectorpb.ExportMetricsServiceRequest {
	t.Helper()
	for {
		if req := r.Next(t); ok(req) {
			return req
		}
	}
}

// Point is one data point: its attributes and value (a histogram's count).
type Point struct {
	Attrs map[string]string
	Value float64
}

// ByName maps each metric in req to its data points.
func ByName(req *collectorpb.ExportMetricsServiceRequest) map[string][]Point {
	out := map[string][]Point{}
	for _, rm := range req.GetResourceMetrics() {
		for _, sm := range rm.GetScopeMetrics() {
			for _, m := range sm.GetMetrics() {
				var dps []*metricspb.NumberDataPoint
				switch {
				case m.GetGauge() != nil:
					dps = m.GetGauge().GetDataPoints()
				case m.GetSum() != nil:
					dps = m.GetSum().GetDataPoints()
				case m.GetHistogram() != nil:
					for _, h := range m.GetHistogram().GetDataPoints() {
						out[m.GetName()] = append(out[m.GetName()], Point{Attrs: Attrs(h.GetAttributes()), Value: float64(h.GetCount())})
					}
				}
				for _, dp := range dps {
					v := dp.GetAsDouble()
					if _, ok := dp.GetValue().(*metricspb.NumberDataPoint_AsInt); ok {
						v = float64(dp.GetAsInt())
					}
					out[m.GetName()] = append(out[m.GetName()], Point{Attrs: Attrs(dp.GetAttributes()), Value: v})
				}
			}
		}
	}
	return out
}

// Attrs are string and int attributes as strings.
func Attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := map[string]string{}
	for _, kv := range kvs {
		switch x := kv.GetValue().GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.GetKey()] = x.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.GetKey()] = strconv.FormatInt(x.IntValue, 10)
		}
	}
	return m
}

// Resource is the first resource's attributes in req.
func Resource(req *collectorpb.ExportMetricsServiceRequest) map[string]string {
	for _, rm := range req.GetResourceMetrics() {
		return Attrs(rm.GetResource().GetAttributes())
	}
	return nil
}
