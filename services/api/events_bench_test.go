package api_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// BenchmarkWatchIdleStatements holds n watches open (on one connection,
// whose HTTP/2 stream limit is 250) and idle for a while
// and reports the statements their calls ran per second (stmts/s: the
// watches' own, in their RPC's context) and the reads of the event log
// per second by anyone (reads/s: the watches, their tailer, and the
// relay's fan-out, which is the same with or without watches).
func BenchmarkWatchIdleStatements(b *testing.B) {
	for _, n := range []int{1, 100, 240} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			h := benchWatchSetup(b, n)
			openWatches(b, h, n)
			const idle = 4 * time.Second
			b.ResetTimer()
			for range b.N {
				q, r := h.queries.Load(), h.eventReads.Load()
				time.Sleep(idle) // the measurement window, not a synchronisation
				b.ReportMetric(float64(h.queries.Load()-q)/idle.Seconds(), "stmts/s")
				b.ReportMetric(float64(h.eventReads.Load()-r)/idle.Seconds(), "reads/s")
			}
		})
	}
}

// BenchmarkWatchReplayLargeLog keeps one watch whose filter matches
// nothing, from the start of a 300,000-event log, and reports the database
// time the watch spends reading the log per wake (ms/wake), over 10 wakes
// by events of another tenant, once the relay's fan-out has caught up: a tenant's watch (its index walks the
// tenant's events) and root's with includeDescendants (every event).
func BenchmarkWatchReplayLargeLog(b *testing.B) {
	for _, c := range []struct {
		name, tenant string
		subtree      bool
	}{{"tenant", "beta", false}, {"root-subtree", "root", true}} {
		b.Run(c.name, func(b *testing.B) {
			h := benchWatchSetup(b, 1)
			h.member(b, "beta", "bob")
			h.member(b, "gamma", "gil")
			if _, err := h.db.Exec(context.Background(), `INSERT INTO outbox (tenant_id, type, subject, seq, sent_at)
				SELECT 'beta', 'node.updated', 'bc.events.beta.node.updated', nextval('events_seq'), now() FROM generate_series(1, 300000)`); err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(as(h.root))
			defer cancel()
			w, err := computev1.NewEventsServiceClient(h.conn).Watch(ctx, &computev1.EventsServiceWatchRequest{
				TenantId: c.tenant, IncludeDescendants: c.subtree, Types: []string{"pool.deleted"}, After: "0",
			})
			if err != nil {
				b.Fatal(err)
			}
			_ = w
			// The relay's fan-out works through the new log too: wait for
			// it, so only the watch's reads are timed.
			poll.UntilNil(b, 5*time.Minute, "fan-out caught up", func() error {
				if n := h.count(b, `SELECT count(*) FROM event_cursors WHERE name = 'fanout' AND seq < (SELECT max(seq) FROM outbox)`); n != 0 {
					time.Sleep(100 * time.Millisecond) // between reads
					return fmt.Errorf("behind")
				}
				return nil
			})
			b.ResetTimer()
			for range b.N {
				ns := h.eventReadNanos.Load()
				for range 10 {
					h.rawEvent(b, "gamma", "node.updated")
					time.Sleep(200 * time.Millisecond) // one wake each, not a synchronisation
				}
				b.ReportMetric(float64(h.eventReadNanos.Load()-ns)/1e6/10, "ms/wake")
			}
		})
	}
}

func benchWatchSetup(b *testing.B, n int) *harness {
	ns := natstest.New(b)
	return setupWith(b, api.Tuning{RatePerSecond: 1000, RateBurst: 2000}, func(c *config.Config) {
		c.NATS.URL = ns.URL()
		c.Events.Poll = config.Duration(5 * time.Millisecond)
		c.Events.MaxWatchesPerIdentity = max(n, 16)
		c.Events.MaxWatches = max(n, 2048)
	})
}
