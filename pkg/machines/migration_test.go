package machines_test

import (
	"context"
	"io/fs"
	"path"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/secrets"
)

// bindingMigration returns the Up and Down SQL of the migration that binds
// BMC secrets and makes (site, bmc address) unique.
func bindingMigration(t *testing.T) (up, down string) {
	t.Helper()
	names, err := fs.Glob(migrate.Files(), "*_bmc_binding.sql")
	if err != nil || len(names) != 1 {
		t.Fatalf("the binding migration: %v %v", names, err)
	}
	b, err := fs.ReadFile(migrate.Files(), path.Clean(names[0]))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i, j := strings.Index(s, "-- +goose Up"), strings.Index(s, "-- +goose Down")
	if i < 0 || j < i {
		t.Fatal("no goose Up and Down sections")
	}
	return s[i:j], s[j:]
}

func execScript(t *testing.T, f fixture, sql string) error {
	t.Helper()
	conn, err := f.db.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	_, err = conn.Conn().PgConn().Exec(context.Background(), sql).ReadAll()
	return err
}

// TestBindingMigrationRefusesDuplicateBMCs: on a database where one BMC
// address was enrolled twice at a site, the migration fails naming both
// machines, and changes nothing; once the extra one is deleted it runs,
// binding each BMC secret to the one address its machines agree on (a
// secret shared by machines with different addresses stays unbound).
func TestBindingMigrationRefusesDuplicateBMCs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	up, down := bindingMigration(t)
	a := f.machine(t, "a")
	kr, err := secrets.NewKeyring(secrets.NewKey())
	if err != nil {
		t.Fatal(err)
	}
	own := secrets.NewID()
	if err := secrets.Put(ctx, f.db, kr, secrets.Secret{ID: own, TenantID: "root", Kind: secrets.KindBMC,
		Plain: secrets.BMCCredentials{Username: "u", Password: "p"}.Marshal()}); err != nil {
		t.Fatal(err)
	}
	if err := execScript(t, f, down); err != nil {
		t.Fatalf("down: %v", err)
	}
	insert := func(id, name, addr, ref string) {
		t.Helper()
		if _, err := f.db.Exec(ctx, `INSERT INTO machines (id, tenant_id, site_id, pool_id, name, bmc_address, bmc_credentials_ref, node_id)
			VALUES ($1, 'root', $2, $3, $4, $5, $6, $7)`, id, f.site, f.pool, name, addr, ref, iam.NewID("node")); err != nil {
			t.Fatal(err)
		}
	}
	insert("mach_twin", "twin", a.BMCAddress, f.secret)
	insert("mach_other", "other", "https://other.bmc.example", f.secret)
	insert("mach_own", "own", "https://own.bmc.example", own)

	err = execScript(t, f, up)
	if err == nil || !strings.Contains(err.Error(), "enrolled twice") || !strings.Contains(err.Error(), a.ID) ||
		!strings.Contains(err.Error(), "mach_twin") {
		t.Fatalf("up over a duplicate: %v, want a refusal naming %s and mach_twin", err, a.ID)
	}
	if n := countCols(t, f); n != 0 {
		t.Fatalf("the refused migration left %d of its columns", n)
	}
	if _, err := f.db.Exec(ctx, `DELETE FROM machines WHERE id = 'mach_twin'`); err != nil {
		t.Fatal(err)
	}
	if err := execScript(t, f, up); err != nil {
		t.Fatalf("up: %v", err)
	}
	for ref, want := range map[string]string{f.secret: "", own: "https://own.bmc.example"} {
		m, err := secrets.Get(ctx, f.db, "root", ref)
		if err != nil || m.BoundTo != want {
			t.Errorf("secret %s bound to %q (%v), want %q", ref, m.BoundTo, err, want)
		}
	}
}

func countCols(t *testing.T, f fixture) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(context.Background(), `SELECT count(*) FROM information_schema.columns
		WHERE table_schema = current_schema() AND column_name IN ('bound_to', 'bmc_ca_pem', 'bmc_certificate_sha256', 'bmc_insecure')`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
