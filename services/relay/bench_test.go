package relay_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
	"github.com/bettercompute/bettercompute/services/relay"
)

// insertEvents commits n node.updated events for acme in one statement.
func insertEvents(b *testing.B, e *env, n int) {
	b.Helper()
	_, err := e.pool.Exec(b.Context(), `
		INSERT INTO outbox (tenant_id, type, subject, resource_id, payload)
		SELECT 'acme', 'node.updated', 'bc.events.acme.node.updated', 'node_' || g, jsonb_build_object('i', g)
		FROM generate_series(1, $1) g`, n)
	if err != nil {
		b.Fatal(err)
	}
}

// benchEnv is setup for a benchmark.
func benchEnv(b *testing.B) *env { return setupTB(b) }

// BenchmarkRelayToJetStream: b.N committed events, sequenced and published
// with acks by one running relay.
func BenchmarkRelayToJetStream(b *testing.B) {
	e := benchEnv(b)
	r, err := relay.New(e.cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := r.Start(b.Context()); err != nil {
		b.Fatal(err)
	}
	defer r.Stop()
	waitForB(b, "leading", r.Leading)
	insertEvents(b, e, b.N)
	b.ResetTimer()
	start := time.Now()
	waitForB(b, "all published", func() bool {
		st, err := events.ReadStats(b.Context(), e.pool)
		return err == nil && st.Unsequenced == 0 && st.Unpublished == 0
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
}

// BenchmarkRelayToWebhook: b.N committed events to one webhook on a local
// receiver, until every delivery succeeded.
func BenchmarkRelayToWebhook(b *testing.B) {
	e := benchEnv(b)
	var mu sync.Mutex
	got := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		got++
		mu.Unlock()
	}))
	defer srv.Close()
	_, key := webhooks.NewSecret()
	if _, err := webhooks.Create(b.Context(), e.pool, webhooks.Webhook{ID: webhooks.NewID(), TenantID: "acme", URL: srv.URL, EventTypes: []string{"*"}, Secret: key}); err != nil {
		b.Fatal(err)
	}
	cfg := e.cfg
	cfg.Webhooks.PerEndpoint = 64
	r, err := relay.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := r.Start(b.Context()); err != nil {
		b.Fatal(err)
	}
	defer r.Stop()
	waitForB(b, "leading", r.Leading)
	insertEvents(b, e, b.N)
	b.ResetTimer()
	start := time.Now()
	waitForB(b, "all delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return got >= b.N
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
}

// BenchmarkCommitToWebhook: latency from an event's commit to its arrival
// at a local receiver, one event every 5 ms, with the bus up and down.
func BenchmarkCommitToWebhook(b *testing.B) {
	for _, mode := range []string{"bus=up", "bus=down"} {
		b.Run(mode, func(b *testing.B) {
			e := benchEnv(b)
			var mu sync.Mutex
			arrived := map[string]time.Time{}
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				arrived[r.Header.Get(webhooks.HeaderID)] = time.Now()
				mu.Unlock()
			}))
			defer srv.Close()
			_, key := webhooks.NewSecret()
			if _, err := webhooks.Create(b.Context(), e.pool, webhooks.Webhook{ID: webhooks.NewID(), TenantID: "acme", URL: srv.URL, EventTypes: []string{"*"}, Secret: key}); err != nil {
				b.Fatal(err)
			}
			r, err := relay.New(e.cfg)
			if err != nil {
				b.Fatal(err)
			}
			if err := r.Start(b.Context()); err != nil {
				b.Fatal(err)
			}
			defer r.Stop()
			waitForB(b, "leading", r.Leading)
			if mode == "bus=down" {
				e.ns.Stop()
				waitForB(b, "disconnected", func() bool { return !e.nc.IsConnected() })
			}
			committed := map[string]time.Time{}
			b.ResetTimer()
			for i := range b.N {
				var id int64
				err := db.InTx(b.Context(), e.pool, db.TxOptions{}, func(tx pgx.Tx) error {
					var err error
					id, err = outbox.Write(b.Context(), tx, outbox.Event{TenantID: "acme", Type: "node.updated", Resource: "node_" + strconv.Itoa(i)})
					return err
				})
				if err != nil {
					b.Fatal(err)
				}
				committed[events.EventID(id)] = time.Now()
				time.Sleep(5 * time.Millisecond)
			}
			waitForB(b, "all arrived", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(arrived) >= b.N
			})
			b.StopTimer()
			var lat []time.Duration
			mu.Lock()
			for id, c := range committed {
				lat = append(lat, arrived[id].Sub(c))
			}
			mu.Unlock()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
		})
	}
}

func waitForB(b *testing.B, what string, cond func() bool) {
	b.Helper()
	ctx, cancel := context.WithTimeout(b.Context(), 5*time.Minute)
	defer cancel()
	for !cond() {
		if ctx.Err() != nil {
			b.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
