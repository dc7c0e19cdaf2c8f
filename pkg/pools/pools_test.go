package pools_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestPoolSharing: a pool is its tenant's alone unless it says so; sharing
// and the default quota are stored, changed and kept by other updates.
func TestPoolSharing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	p, err := pools.Create(ctx, db, pools.Pool{ID: "pool_a", TenantID: "root", Name: "a", Class: pools.ClassGPU})
	if err != nil {
		t.Fatal(err)
	}
	if p.Sharing != pools.SharingNone || p.DefaultQuota != 0 {
		t.Fatalf("a new pool is shared: %q, default quota %d", p.Sharing, p.DefaultQuota)
	}
	b, err := pools.Create(ctx, db, pools.Pool{ID: "pool_b", TenantID: "root", Name: "b", Class: pools.ClassGPU, Sharing: pools.SharingDescendants, DefaultQuota: 4})
	if err != nil || b.Sharing != pools.SharingDescendants || b.DefaultQuota != 4 {
		t.Fatalf("create shared: %+v %v", b, err)
	}
	d := "changed"
	b, err = pools.Apply(ctx, db, "root", "pool_b", pools.Update{Description: &d})
	if err != nil || b.Sharing != pools.SharingDescendants || b.DefaultQuota != 4 {
		t.Fatalf("another update changed the sharing: %+v %v", b, err)
	}
	none, zero := pools.SharingNone, 0
	b, err = pools.Apply(ctx, db, "root", "pool_b", pools.Update{Sharing: &none, DefaultQuota: &zero})
	if err != nil || b.Sharing != pools.SharingNone || b.DefaultQuota != 0 {
		t.Fatalf("unshare: %+v %v", b, err)
	}
	// The database refuses what the API validates.
	bad := "everyone"
	if _, err := pools.Apply(ctx, db, "root", "pool_b", pools.Update{Sharing: &bad}); err == nil {
		t.Fatal("stored sharing \"everyone\"")
	}
	neg := -1
	if _, err := pools.Apply(ctx, db, "root", "pool_b", pools.Update{DefaultQuota: &neg}); err == nil {
		t.Fatal("stored a negative default quota")
	}
}
