// Package telemetry sets up what every Better Compute process reports about
// itself: the slog logger, Prometheus metrics and OpenTelemetry tracing.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"

	"github.com/bettercompute/bettercompute/pkg/version"
)

// NewLogger returns the process logger writing to w in format "json" or
// "text" at level "debug", "info", "warn" or "error" (validated by config).
func NewLogger(w io.Writer, format, level string) *slog.Logger {
	var lv slog.Level
	_ = lv.UnmarshalText([]byte(level)) // unknown levels stay at info
	opts := &slog.HandlerOptions{Level: lv}
	if format == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

// NewRegistry returns a Prometheus registry with the Go runtime and process
// collectors and a bettercompute_build_info gauge.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	v := version.Get()
	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "bettercompute_build_info",
		Help: "Always 1; labels say which build this process runs.",
	}, []string{"version", "commit", "goversion"})
	build.WithLabelValues(v.Version, v.Commit, v.GoVersion).Set(1)
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		build,
	)
	return reg
}

// SetupTracing installs a global tracer provider exporting over OTLP/gRPC to
// endpoint (host:port, or an http(s):// URL; http means no TLS). With an empty
// endpoint it installs nothing and returns a no-op shutdown. The returned
// function flushes and stops the exporter.
func SetupTracing(ctx context.Context, endpoint, serviceName string) (shutdown func(context.Context) error, err error) {
	noop := func(context.Context) error { return nil }
	if endpoint == "" {
		return noop, nil
	}
	opts := []otlptracegrpc.Option{}
	switch {
	case strings.HasPrefix(endpoint, "http://"):
		opts = append(opts, otlptracegrpc.WithEndpoint(strings.TrimPrefix(endpoint, "http://")), otlptracegrpc.WithInsecure())
	case strings.HasPrefix(endpoint, "https://"):
		opts = append(opts, otlptracegrpc.WithEndpoint(strings.TrimPrefix(endpoint, "https://")))
	default:
		opts = append(opts, otlptracegrpc.WithEndpoint(endpoint), otlptracegrpc.WithInsecure())
	}
	exp, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return noop, fmt.Errorf("otlp trace exporter: %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(
		semconv.ServiceName(serviceName),
		semconv.ServiceVersion(version.Get().Version),
	))
	if err != nil {
		return noop, errors.Join(fmt.Errorf("trace resource: %w", err), exp.Shutdown(ctx))
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp.Shutdown, nil
}
