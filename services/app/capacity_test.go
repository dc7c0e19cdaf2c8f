package app_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

// TestPlacerRoleHostsTheScheduler: the placer deployable runs the
// scheduler membership with the capacity reconcilers, and nothing else.
func TestPlacerRoleHostsTheScheduler(t *testing.T) {
	t.Parallel()
	u := pgtest.NewDB(t)
	cfg := testConfig(u)
	cfg.Roles = []string{"placer"}
	a := start(t, cfg)
	defer a.Stop(context.Background())
	pool, err := pgxpool.New(t.Context(), u)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var memberships []string
	rows, err := pool.Query(t.Context(), `SELECT membership FROM workers WHERE expires_at > now()`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var m string
		_ = rows.Scan(&m)
		memberships = append(memberships, m)
	}
	rows.Close()
	if !slices.Equal(memberships, []string{"scheduler"}) {
		t.Fatalf("workers = %v, want the scheduler membership only", memberships)
	}
	// The capacity singletons run under the scheduler's leases.
	var holder string
	if err := pool.QueryRow(t.Context(), `SELECT holder FROM leases WHERE name = 'singleton:capacity.tick'`).Scan(&holder); err != nil || !strings.HasPrefix(holder, "scheduler/") {
		t.Fatalf("capacity.tick's lease is held by %q (%v)", holder, err)
	}
}
