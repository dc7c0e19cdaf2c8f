package bcd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/agent/telemetry"
)

// startTelemetry builds the node's telemetry over inv, exports to endpoint
// every interval (none while endpoint is empty; the site section can
// change both with Configure), and serves /metrics on promListen when set.
// The returned func stops all of it.
func startTelemetry(ctx context.Context, store *state.Store, inv *inventory.Collector, logger *slog.Logger,
	endpoint string, interval time.Duration, promListen string,
) (*telemetry.Telemetry, func(), error) {
	var nodeID string
	if id, err := store.Identity(); err == nil {
		nodeID = id.NodeID
	}
	host, _ := os.Hostname()
	tel, err := telemetry.New(telemetry.Config{GPUs: inv, NodeID: nodeID, Hostname: host, ServiceVersion: version(), Logger: logger})
	if err != nil {
		return nil, nil, err
	}
	if err := tel.Configure(endpoint, interval); err != nil {
		_ = tel.Close(context.Background())
		return nil, nil, usageError{fmt.Errorf("--otlp-endpoint: %w", err)}
	}
	var srv *http.Server
	var wg sync.WaitGroup
	if promListen != "" {
		lis, err := (&net.ListenConfig{}).Listen(ctx, "tcp", promListen)
		if err != nil {
			_ = tel.Close(context.Background())
			return nil, nil, fmt.Errorf("--prometheus-listen: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", tel.Handler())
		srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second}
		logger.Info("telemetry: serving Prometheus metrics", "addr", lis.Addr().String()+"/metrics")
		wg.Go(func() {
			if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error("telemetry: Prometheus endpoint", "err", err)
			}
		})
	}
	return tel, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if srv != nil {
			_ = srv.Shutdown(sctx)
			wg.Wait()
		}
		_ = tel.Close(sctx)
	}, nil
}
