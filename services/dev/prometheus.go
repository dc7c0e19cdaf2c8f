package dev

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// PrometheusListen is where dev's Prometheus serves, unless taken (then a
// free loopback port).
const PrometheusListen = "127.0.0.1:9090"

// PrometheusHint is the banner's line when Prometheus is not installed.
const PrometheusHint = "install Prometheus (Debian: apt-get install prometheus) and `make run` starts it, scraping the simulated nodes' GPU telemetry (docs/node-telemetry.md)"

// devPrometheus is the Prometheus dev started: it scrapes each simulated
// node's metrics (the fleet's MetricsHandler, one target per node, as
// `bcd node --prometheus-listen` would serve them on each machine) and the
// control plane's /metrics.
//
// It scrapes rather than receiving OTLP: Debian 12's Prometheus is 2.42,
// and the OTLP receiver came in 2.47 (--enable-feature=otlp-write-receiver,
// OTLP over HTTP only, while bcd exports OTLP/gRPC).
type devPrometheus struct {
	URL  string
	cmd  *exec.Cmd
	srv  *http.Server
	done chan struct{}
}

// startPrometheus starts the prometheus binary on PATH under dir, serving
// on listen ("": PrometheusListen, or a free loopback port when taken), or
// returns nil, nil when there is none. It does not wait for Prometheus to
// be ready.
func startPrometheus(env *Env, dir, listen string, logger *slog.Logger) (*devPrometheus, error) {
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		return nil, nil //nolint:nilerr // not installed: the banner says how to get it
	}
	if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
		return nil, err
	}
	p := &devPrometheus{done: make(chan struct{})}
	// The simulated nodes' metrics, on one loopback port: /nodes/<n>/metrics.
	type group struct {
		Targets []string          `json:"targets"`
		Labels  map[string]string `json:"labels"`
	}
	groups := []group{}
	if env.Fleet != nil {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		p.srv = &http.Server{Handler: env.Fleet.MetricsHandler(), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = p.srv.Serve(lis) }()
		for i, id := range env.Fleet.Nodes() {
			// job and instance as Prometheus's OTLP receiver would make them
			// of bcd's service.name and service.instance.id.
			groups = append(groups, group{Targets: []string{lis.Addr().String()},
				Labels: map[string]string{"__metrics_path__": "/nodes/" + strconv.Itoa(i) + "/metrics", "instance": id}})
		}
	}
	targets, err := json.MarshalIndent(groups, "", "  ")
	if err != nil {
		p.stopServer()
		return nil, err
	}
	sdFile := filepath.Join(dir, "bcd-targets.json")
	cfg := fmt.Sprintf(`# Written by better-compute dev on every start.
global:
  scrape_interval: 10s
scrape_configs:
  - job_name: bcd
    file_sd_configs:
      - files: [%q]
  - job_name: better-compute
    static_configs:
      - targets: [%q]
`, sdFile, metricsTarget(env))
	if err := os.WriteFile(sdFile, targets, 0o644); err != nil {
		p.stopServer()
		return nil, err
	}
	cfgFile := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		p.stopServer()
		return nil, err
	}
	if listen == "" {
		listen = PrometheusListen
		if l, err := net.Listen("tcp", listen); err == nil {
			_ = l.Close()
		} else if l, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
			listen = l.Addr().String()
			_ = l.Close()
		}
	}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		p.stopServer()
		return nil, err
	}
	p.cmd = exec.Command(bin, "--config.file="+cfgFile, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--storage.tsdb.retention.time=2d", "--web.listen-address="+listen)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	// It dies with dev, however dev ends.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := p.cmd.Start(); err != nil {
		_ = log.Close()
		p.stopServer()
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() {
		defer close(p.done)
		defer func() { _ = log.Close() }()
		if err := p.cmd.Wait(); err != nil {
			logger.Warn("prometheus exited", "err", err, "log", log.Name())
		}
	}()
	p.URL = "http://" + listen
	logger.Info("prometheus", "url", p.URL, "config", cfgFile)
	return p, nil
}

// metricsTarget is the control plane's /metrics host:port.
func metricsTarget(env *Env) string {
	if a := env.App.AdminAddr(); a != "" {
		return a
	}
	return env.App.Addr()
}

func (p *devPrometheus) stopServer() {
	if p.srv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = p.srv.Shutdown(ctx)
	}
}

// stop ends Prometheus (SIGTERM, then SIGKILL after 10 s) and the scrape
// endpoint.
func (p *devPrometheus) stop() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	p.stopServer()
}
