package dev_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// TestDevPrometheus: `better-compute dev` (dev.Run) asked for Prometheus.
// Where prometheus is installed it starts it and names its URL in the
// banner, and Prometheus scrapes every simulated node's eight GPUs (one
// instance per node) and the control plane; where it is not, the banner
// says how to get it.
func TestDevPrometheus(t *testing.T) {
	t.Parallel()
	port, nodes, machines, no := 0, 2, 0, false
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &nodes, SimMachines: &machines, SimInstances: &no},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	// A port of its own: other tests' dev may hold 9090.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	promAddr := lis.Addr().String()
	_ = lis.Close()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- dev.Run(ctx, cfg, slog.New(slog.DiscardHandler), pw, dev.RunOptions{Prometheus: true, PrometheusListen: promAddr})
		_ = pw.Close()
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("dev.Run: %v", err)
		}
	})
	var banner strings.Builder
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		banner.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "Postgres") {
			break
		}
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	if _, err := exec.LookPath("prometheus"); err != nil {
		if !strings.Contains(banner.String(), "Telemetry "+dev.PrometheusHint) {
			t.Fatalf("no prometheus installed and the banner does not say how to get it:\n%s", banner.String())
		}
		t.Skip("prometheus is not installed: checked the banner's hint only")
	}
	m := regexp.MustCompile(`Telemetry Prometheus (http://\S+) scrapes the 2 simulated nodes`).FindStringSubmatch(banner.String())
	if m == nil || m[1] != "http://"+promAddr {
		t.Fatalf("prometheus is installed and the banner names none:\n%s", banner.String())
	}
	query := func(q string) (map[string]string, error) {
		res, err := http.Get(m[1] + "/api/v1/query?query=" + url.QueryEscape(q))
		if err != nil {
			return nil, err
		}
		defer res.Body.Close()
		var out struct {
			Data struct {
				Result []struct {
					Metric map[string]string
					Value  [2]any
				}
			}
		}
		if err := json.NewDecoder(res.Body).Decode(&out); err != nil {
			return nil, err
		}
		got := map[string]string{}
		for _, r := range out.Data.Result {
			got[r.Metric["instance"]+r.Metric["job"]] = fmt.Sprint(r.Value[1])
		}
		return got, nil
	}
	// Prometheus scrapes every 10 s, the first time at a jittered moment.
	poll.UntilNil(t, 2*time.Minute, "Prometheus has every simulated node's eight GPUs", func() error {
		got, err := query(`count by (instance) (gpu_temperature_celsius{job="bcd"})`)
		if err != nil {
			return err
		}
		if len(got) != 2 {
			return fmt.Errorf("GPU series by instance %v, want two nodes", got)
		}
		for inst, n := range got {
			if n != "8" || !strings.HasPrefix(inst, "node_") {
				return fmt.Errorf("GPU series by instance %v, want 8 for each node id", got)
			}
		}
		return nil
	})
	poll.UntilNil(t, time.Minute, "Prometheus scrapes the control plane", func() error {
		got, err := query(`up{job="better-compute"}`)
		if err != nil {
			return err
		}
		for _, v := range got {
			if v == "1" {
				return nil
			}
		}
		return fmt.Errorf("up %v", got)
	})
}
