package gateway

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Ready reports whether this gateway holds a session of nodeID that has
// been sent what was due at its start (its desired state, its in-flight and
// pending commands) and now reads the daemon's messages.
func (g *Gateway) Ready(nodeID string) bool {
	g.mu.Lock()
	s, ok := g.sessions[nodeID]
	g.mu.Unlock()
	return ok && s.ready.Load()
}

// Submit stores a report through the batch writer, as a session does.
func (g *Gateway) Submit(ctx context.Context, nodeID string, store func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error) error {
	return g.submit(ctx, nodeID, store)
}

// QueuedReports is how many reports wait for the batch writer.
func (g *Gateway) QueuedReports() int { return len(g.reports) }
