// Command otlpsink is a minimal OTLP/gRPC metrics receiver for measuring
// what a fleet's telemetry costs the one receiving it: it decodes every
// export request (as any receiver must) and keeps nothing, and prints, every
// --every, the requests, bytes and data points per second it took in and
// the CPU it spent (getrusage: its own user and system time).
//
//	otlpsink --listen 127.0.0.1:4317 --every 10s
//	bcsim … --otlp-endpoint http://127.0.0.1:4317
//
// "TCP bytes" are what the connections carried in (HTTP/2 framing and
// headers included); "payload" is the gRPC messages as sent (gzip from bcd)
// and "decoded" their protobuf size. With --for it stops after that long and
// prints the totals over the whole run after the first report (the warm-up
// of connections and joins left out).
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	metricspb "go.opentelemetry.io/proto/otlp/metrics/v1"
	"google.golang.org/grpc"
	_ "google.golang.org/grpc/encoding/gzip" // bcd sends gzip
	"google.golang.org/grpc/stats"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "otlpsink:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:4317", "address to serve OTLP/gRPC on")
	every := flag.Duration("every", 10*time.Second, "how often to print the rates")
	runFor := flag.Duration("for", 0, "stop after this long and print the totals since the first report (0: until interrupted)")
	flag.Parse()
	raiseFileLimit()
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	var c counters
	srv := grpc.NewServer(grpc.StatsHandler(&c), grpc.MaxRecvMsgSize(64<<20))
	collectorpb.RegisterMetricsServiceServer(srv, &c)
	go func() { _ = srv.Serve(countingListener{lis, &c}) }()
	defer srv.Stop()
	fmt.Printf("otlpsink: OTLP/gRPC on %s\n", lis.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *runFor > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *runFor)
		defer cancel()
	}
	t := time.NewTicker(*every)
	defer t.Stop()
	prev, first := c.snapshot(), snap{}
	for {
		select {
		case <-ctx.Done():
			if first.at.IsZero() {
				return nil
			}
			fmt.Println("total since the first report: " + c.snapshot().since(first))
			return nil
		case <-t.C:
			now := c.snapshot()
			fmt.Println(now.since(prev))
			if first.at.IsZero() {
				first = now
			}
			prev = now
		}
	}
}

// counters are the receiver's counts; it is the MetricsService and the
// gRPC stats handler.
type counters struct {
	collectorpb.UnimplementedMetricsServiceServer
	requests, payload, decoded, points, tcp, conns atomic.Int64
}

// Export counts the request's data points and answers it received.
func (c *counters) Export(_ context.Context, req *collectorpb.ExportMetricsServiceRequest) (*collectorpb.ExportMetricsServiceResponse, error) {
	var n int64
	for _, rm := range req.GetResourceMetrics() {
		for _, sm := range rm.GetScopeMetrics() {
			for _, m := range sm.GetMetrics() {
				n += points(m)
			}
		}
	}
	c.requests.Add(1)
	c.points.Add(n)
	return &collectorpb.ExportMetricsServiceResponse{}, nil
}

func points(m *metricspb.Metric) int64 {
	switch d := m.GetData().(type) {
	case *metricspb.Metric_Gauge:
		return int64(len(d.Gauge.GetDataPoints()))
	case *metricspb.Metric_Sum:
		return int64(len(d.Sum.GetDataPoints()))
	case *metricspb.Metric_Histogram:
		return int64(len(d.Histogram.GetDataPoints()))
	}
	return 0
}

func (c *counters) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (c *counters) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (c *counters) HandleConn(_ context.Context, s stats.ConnStats) {
	switch s.(type) {
	case *stats.ConnBegin:
		c.conns.Add(1)
	case *stats.ConnEnd:
		c.conns.Add(-1)
	}
}

func (c *counters) HandleRPC(_ context.Context, s stats.RPCStats) {
	if p, ok := s.(*stats.InPayload); ok {
		c.payload.Add(int64(p.CompressedLength))
		c.decoded.Add(int64(p.Length))
	}
}

// countingListener counts the bytes its connections read.
type countingListener struct {
	net.Listener
	c *counters
}

func (l countingListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return countingConn{conn, l.c}, nil
}

type countingConn struct {
	net.Conn
	c *counters
}

func (c countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.c.tcp.Add(int64(n))
	return n, err
}

// snap is the counters and the process's CPU time at one moment.
type snap struct {
	at                                      time.Time
	cpu                                     time.Duration
	requests, payload, decoded, points, tcp int64
	conns                                   int64
}

func (c *counters) snapshot() snap {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return snap{at: time.Now(), cpu: time.Duration(ru.Utime.Nano() + ru.Stime.Nano()),
		requests: c.requests.Load(), payload: c.payload.Load(), decoded: c.decoded.Load(), points: c.points.Load(),
		tcp: c.tcp.Load(), conns: c.conns.Load()}
}

// since is the rates from p to s.
func (s snap) since(p snap) string {
	sec := s.at.Sub(p.at).Seconds()
	rate := func(a, b int64) float64 { return float64(a-b) / sec }
	per := 0.0
	if d := s.requests - p.requests; d > 0 {
		per = float64((s.cpu - p.cpu).Microseconds()) / float64(d)
	}
	return fmt.Sprintf("%.0fs  conns %d  requests/s %.1f  TCP bytes/s %.0f  payload bytes/s %.0f  decoded bytes/s %.0f  points/s %.0f  cpu %.3f cores (%.0f µs/request)",
		sec, s.conns, rate(s.requests, p.requests), rate(s.tcp, p.tcp), rate(s.payload, p.payload), rate(s.decoded, p.decoded),
		rate(s.points, p.points), (s.cpu-p.cpu).Seconds()/sec, per)
}

// raiseFileLimit lifts the open-files limit to the hard one: every node
// holds a connection.
func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) != nil {
		return
	}
	if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 1 << 20, Max: max(l.Max, 1<<20)}) == nil {
		return
	}
	l.Cur = l.Max
	_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
}
