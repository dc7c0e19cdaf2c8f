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

// TestPoolNodeSettings: the site, health and runtime sections a pool gives
// its nodes are stored and read back; each is kept by an update that does
// not name it, and a new pool sets none.
func TestPoolNodeSettings(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	for _, id := range []string{"pool_a", "pool_b"} {
		if _, err := pools.Create(ctx, db, pools.Pool{ID: id, TenantID: "root", Name: id[5:], Class: pools.ClassGPU}); err != nil {
			t.Fatal(err)
		}
	}
	settings := func() map[string]pools.NodeSettings {
		t.Helper()
		got, err := pools.NodeSettingsOf(ctx, db, []string{"pool_a", "pool_b", "pool_nope"})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]pools.NodeSettings{}
		for _, s := range got {
			out[s.ID] = s
		}
		return out
	}
	if s := settings(); len(s) != 2 || string(s["pool_a"].Runtime) != "{}" || string(s["pool_a"].Site) != "{}" {
		t.Fatalf("a new pool's settings: %+v", s)
	}
	rt := []byte(`{"engines": ["containerd"], "cdiSpecDirs": ["/var/run/cdi"]}`)
	if _, err := pools.Apply(ctx, db, "root", "pool_a", pools.Update{Runtime: rt, Site: []byte(`{"logLevel": "debug"}`)}); err != nil {
		t.Fatal(err)
	}
	d := "changed"
	if _, err := pools.Apply(ctx, db, "root", "pool_a", pools.Update{Description: &d, Health: []byte(`{"checkInterval": "30s"}`)}); err != nil {
		t.Fatal(err)
	}
	s := settings()
	if string(s["pool_a"].Runtime) != `{"engines": ["containerd"], "cdiSpecDirs": ["/var/run/cdi"]}` ||
		string(s["pool_a"].Site) != `{"logLevel": "debug"}` || string(s["pool_a"].Health) != `{"checkInterval": "30s"}` {
		t.Fatalf("pool_a's settings: runtime %s site %s health %s", s["pool_a"].Runtime, s["pool_a"].Site, s["pool_a"].Health)
	}
	if string(s["pool_b"].Runtime) != "{}" {
		t.Fatalf("pool_b's runtime changed with pool_a's: %s", s["pool_b"].Runtime)
	}
	if _, err := pools.Apply(ctx, db, "root", "pool_a", pools.Update{Runtime: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	if s := settings(); string(s["pool_a"].Runtime) != "{}" || string(s["pool_a"].Site) != `{"logLevel": "debug"}` {
		t.Fatalf("clearing the runtime: runtime %s site %s", s["pool_a"].Runtime, s["pool_a"].Site)
	}
}

// TestPoolAgentSettings: the agent section a pool gives its nodes is
// stored, kept by an update that does not name it, and cleared with '{}'.
func TestPoolAgentSettings(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := pools.Create(ctx, db, pools.Pool{ID: "pool_a", TenantID: "root", Name: "a", Class: pools.ClassGPU}); err != nil {
		t.Fatal(err)
	}
	agent := func() string {
		t.Helper()
		got, err := pools.NodeSettingsOf(ctx, db, []string{"pool_a"})
		if err != nil || len(got) != 1 {
			t.Fatalf("settings %+v %v", got, err)
		}
		return string(got[0].Agent)
	}
	if a := agent(); a != "{}" {
		t.Fatalf("a new pool's agent section: %s", a)
	}
	if _, err := pools.Apply(ctx, db, "root", "pool_a", pools.Update{Agent: []byte(`{"releaseManifest": "eyJ9"}`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := pools.Apply(ctx, db, "root", "pool_a", pools.Update{Site: []byte(`{"logLevel": "debug"}`)}); err != nil {
		t.Fatal(err)
	}
	if a := agent(); a != `{"releaseManifest": "eyJ9"}` {
		t.Fatalf("agent section after an update of site: %s", a)
	}
	if _, err := pools.Apply(ctx, db, "root", "pool_a", pools.Update{Agent: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if a := agent(); a != "{}" {
		t.Fatalf("cleared agent section: %s", a)
	}
}
