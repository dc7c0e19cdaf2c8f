package api_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"math/big"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/fieldmaskpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// metalTenant is a tenant "acme" with an admin allowed everything, a site,
// a production pool and a lab pool, and a lab enroller allowed
// metal.enroll into the lab pool only (and reads of the tenant).
type metalTenant struct {
	h                 *harness
	admin, lab        string
	site, site2       string
	prodPool, labPool string
	c                 computev1.MetalServiceClient
}

func newMetalTenant(t *testing.T) *metalTenant {
	t.Helper()
	h, _ := setupLogged(t, true)
	mt := &metalTenant{h: h, c: computev1.NewMetalServiceClient(h.conn)}
	_, mt.admin = h.member(t, "acme", "admin")
	labID, lab := h.member(t, "acme", "lab")
	mt.lab = lab
	h.policy(t, "acme", "admins", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme") unless { principal == Identity::"`+labID+`" };`)
	sites := computev1.NewSitesServiceClient(h.conn)
	for name, s := range map[string]*string{"fra1": &mt.site, "ams1": &mt.site2} {
		r, err := sites.Create(as(mt.admin), &computev1.SitesServiceCreateRequest{TenantId: "acme", Name: name})
		if err != nil {
			t.Fatal(err)
		}
		*s = r.GetSite().GetId()
	}
	pools := computev1.NewPoolsServiceClient(h.conn)
	for name, p := range map[string]*string{"prod": &mt.prodPool, "lab": &mt.labPool} {
		r, err := pools.Create(as(mt.admin), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: name, Class: "gpu"})
		if err != nil {
			t.Fatal(err)
		}
		*p = r.GetPool().GetId()
	}
	h.policy(t, "acme", "lab", `permit (principal == Identity::"`+labID+`", action == Action::"compute:metal:enroll", resource in Pool::"`+mt.labPool+`");
permit (principal == Identity::"`+labID+`", action in [Action::"compute:metal:get", Action::"compute:metal:list", Action::"compute:events:list"], resource in Tenant::"acme");`)
	return mt
}

func (mt *metalTenant) enroll(t *testing.T, key, site, pool, name string, bmc *computev1.MachineBMC) (*computev1.Machine, error) {
	t.Helper()
	r, err := mt.c.Enroll(as(key), &computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: site, PoolId: pool, Name: name, Bmc: bmc})
	return r.GetMachine(), err
}

// TestEnrollWithAnotherMachinesSecretRefused: an identity allowed to
// enroll into the lab pool only names a production machine's BMC secret:
// with its own BMC address (the password would go there) it is refused,
// the secret being bound to the production BMC; with the production BMC's
// address it is refused, not being allowed metal.enroll on the machine
// using the secret. Nothing is stored. The admin, allowed on the
// production machine, may name it for the same BMC at another site.
func TestEnrollWithAnotherMachinesSecretRefused(t *testing.T) {
	t.Parallel()
	mt := newMetalTenant(t)
	prod, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "prod-1",
		&computev1.MachineBMC{Address: "https://10.0.0.1", Username: "root", Password: "prod-password"})
	if err != nil {
		t.Fatal(err)
	}
	ref := prod.GetBmcCredentialsRef()
	// The lab enroller may enroll into its pool with its own credentials.
	if _, err := mt.enroll(t, mt.lab, mt.site, mt.labPool, "lab-1",
		&computev1.MachineBMC{Address: "https://10.9.9.1", Username: "u", Password: "lab-password"}); err != nil {
		t.Fatal(err)
	}
	before := mt.h.count(t, `SELECT count(*) FROM machines`)

	_, err = mt.enroll(t, mt.lab, mt.site, mt.labPool, "stolen", &computev1.MachineBMC{Address: "https://10.9.9.9", CredentialsRef: ref})
	wantCode(t, err, fault.AccessDenied, "bmc.credentialsRef")
	_, err = mt.enroll(t, mt.lab, mt.site2, mt.labPool, "stolen", &computev1.MachineBMC{Address: "https://10.0.0.1", CredentialsRef: ref})
	wantCode(t, err, fault.AccessDenied, "bmc.credentialsRef")
	// The admin too cannot send it to another address.
	_, err = mt.enroll(t, mt.admin, mt.site, mt.prodPool, "moved", &computev1.MachineBMC{Address: "https://10.0.0.2", CredentialsRef: ref})
	wantCode(t, err, fault.AccessDenied, "bmc.credentialsRef")
	if n := mt.h.count(t, `SELECT count(*) FROM machines`); n != before {
		t.Fatalf("%d machines after the refusals, want %d", n, before)
	}

	// Allowed on every machine using it, the same BMC: taken.
	again, err := mt.enroll(t, mt.admin, mt.site2, mt.prodPool, "prod-1-ams", &computev1.MachineBMC{Address: "https://10.0.0.1/", CredentialsRef: ref})
	if err != nil || again.GetBmcCredentialsRef() != ref {
		t.Fatalf("the admin naming the secret for its BMC: %v %v", again, err)
	}
}

// TestEnrollSameBMCAddressTwiceRefused: a BMC already enrolled at a site
// (written differently: case, a trailing slash) is CONFLICT on
// "bmc.address", with new credentials or the machine's own; another site
// may have a BMC at that address.
func TestEnrollSameBMCAddressTwiceRefused(t *testing.T) {
	t.Parallel()
	mt := newMetalTenant(t)
	first, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "m1", &computev1.MachineBMC{Address: "https://bmc-1.example:8443", Username: "u", Password: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = mt.enroll(t, mt.admin, mt.site, mt.prodPool, "m1-copy", &computev1.MachineBMC{Address: "https://BMC-1.example:8443/", Username: "u", Password: "p2"})
	wantCode(t, err, fault.Conflict, "bmc.address")
	_, err = mt.enroll(t, mt.admin, mt.site, mt.labPool, "m1-copy", &computev1.MachineBMC{Address: "https://bmc-1.example:8443", CredentialsRef: first.GetBmcCredentialsRef()})
	wantCode(t, err, fault.Conflict, "bmc.address")
	if n := mt.h.count(t, `SELECT count(*) FROM machines`); n != 1 {
		t.Fatalf("%d machines, want 1", n)
	}
	if n := mt.h.count(t, `SELECT count(*) FROM secrets`); n != 1 {
		t.Fatalf("%d secrets after the refusals, want 1 (a refused enroll stores none)", n)
	}
	if _, err := mt.enroll(t, mt.admin, mt.site2, mt.prodPool, "m1-other-site", &computev1.MachineBMC{Address: "https://bmc-1.example:8443", Username: "u", Password: "p1"}); err != nil {
		t.Fatal(err)
	}
}

// TestMachineEnrolledEventOmitsCredentialsRef: an identity that may read
// events (events.list, webhooks, events.watch) learns no machine's secret
// id from them: the outbox rows of machine.enrolled and machine.deleted
// (what every reader gets) carry the machine without bmcCredentialsRef,
// while the answers still show it.
func TestMachineEnrolledEventOmitsCredentialsRef(t *testing.T) {
	t.Parallel()
	mt := newMetalTenant(t)
	m, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "prod-1", &computev1.MachineBMC{Address: "https://10.0.0.1", Username: "root", Password: "pw"})
	if err != nil {
		t.Fatal(err)
	}
	ref := m.GetBmcCredentialsRef()
	if !strings.HasPrefix(ref, "sec_") {
		t.Fatalf("enrolled %v", m)
	}
	if got, err := mt.c.Get(as(mt.admin), &computev1.MetalServiceGetRequest{TenantId: "acme", MachineId: m.GetId()}); err != nil ||
		got.GetMachine().GetBmcCredentialsRef() != ref {
		t.Fatalf("metal.get: %v %v", got, err)
	}
	if _, err := mt.c.Delete(as(mt.admin), &computev1.MetalServiceDeleteRequest{TenantId: "acme", MachineId: m.GetId()}); err != nil {
		t.Fatal(err)
	}
	if n := mt.h.count(t, `SELECT count(*) FROM outbox WHERE resource_id = $1 AND type IN ('machine.enrolled', 'machine.deleted')`, m.GetId()); n != 2 {
		t.Fatalf("%d events of the machine, want 2: the search proves nothing", n)
	}
	if n := mt.h.count(t, `SELECT count(*) FROM outbox WHERE resource_id = $1 AND payload->'machine'->>'id' = $1`, m.GetId()); n != 2 {
		t.Fatalf("%d events carry the machine, want 2", n)
	}
	if n := mt.h.count(t, `SELECT count(*) FROM outbox WHERE payload::text LIKE '%' || $1 || '%'`, ref); n != 0 {
		t.Fatalf("%d events name the secret %s", n, ref)
	}
}

// TestPoolsUpdateWithAnotherPoolsSecretRefused: an identity allowed to
// update the lab provider pool only names the production provider pool's
// credentials: ACCESS_DENIED on provider.credentialsRef (the token would
// go to the endpoint it names); the admin may.
func TestPoolsUpdateWithAnotherPoolsSecretRefused(t *testing.T) {
	t.Parallel()
	h, _ := setupLogged(t, true)
	_, admin := h.member(t, "acme", "admin")
	labID, lab := h.member(t, "acme", "lab")
	h.policy(t, "acme", "admins", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme") unless { principal == Identity::"`+labID+`" };`)
	pc := computev1.NewPoolsServiceClient(h.conn)
	mk := func(name string) string {
		r, err := pc.Create(as(admin), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: name, Class: "provider"})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetPool().GetId()
	}
	prod, labPool, other := mk("prod"), mk("lab"), mk("other")
	h.policy(t, "acme", "lab", `permit (principal == Identity::"`+labID+`", action == Action::"compute:pools:update", resource == Pool::"`+labPool+`");`)
	update := func(key, pool string, ps *computev1.ProviderSettings) error {
		_, err := pc.Update(as(key), &computev1.PoolsServiceUpdateRequest{TenantId: "acme", PoolId: pool,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"provider"}}, Provider: ps})
		return err
	}
	if err := update(admin, prod, &computev1.ProviderSettings{Endpoint: "https://api.example.com", Token: poolProviderToken}); err != nil {
		t.Fatal(err)
	}
	if err := update(lab, labPool, &computev1.ProviderSettings{Endpoint: "https://lab.example.com", Token: "lab-token-0123456789"}); err != nil {
		t.Fatal(err)
	}
	var ref string
	if err := h.db.QueryRow(t.Context(), `SELECT credentials_ref FROM provider_pool_settings WHERE pool_id = $1`, prod).Scan(&ref); err != nil {
		t.Fatal(err)
	}
	err := update(lab, labPool, &computev1.ProviderSettings{Endpoint: "https://collector.example.net", CredentialsRef: ref})
	wantCode(t, err, fault.AccessDenied, "provider.credentialsRef")
	if n := h.count(t, `SELECT count(*) FROM provider_pool_settings WHERE credentials_ref = $1`, ref); n != 1 {
		t.Fatalf("%d pools name the production secret after the refusal, want 1", n)
	}
	if err := update(admin, other, &computev1.ProviderSettings{Endpoint: "https://api.example.com", CredentialsRef: ref}); err != nil {
		t.Fatalf("the admin naming the production secret: %v", err)
	}
}

// selfSignedPEM is a certificate in PEM and its SHA-256.
func selfSignedPEM(t *testing.T) (string, string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "bmc"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(der)
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})), hex.EncodeToString(sum[:])
}

// TestEnrollBMCVerification: bmc.caPem, bmc.certificateSha256 and
// bmc.insecureSkipVerify are checked and stored; insecure is an explicit
// opt-in alone; without any, the machine verifies (trust on first use).
func TestEnrollBMCVerification(t *testing.T) {
	t.Parallel()
	mt := newMetalTenant(t)
	caPEM, sum := selfSignedPEM(t)
	bmc := func(addr string) *computev1.MachineBMC {
		return &computev1.MachineBMC{Address: addr, Username: "u", Password: "p"}
	}
	for _, bad := range []struct {
		name  string
		edit  func(*computev1.MachineBMC)
		field string
	}{
		{"a CA that is no PEM", func(b *computev1.MachineBMC) { b.CaPem = "not a pem" }, "bmc.caPem"},
		{"a key in the CA", func(b *computev1.MachineBMC) {
			b.CaPem = string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte{1}}))
		}, "bmc.caPem"},
		{"a CA too long", func(b *computev1.MachineBMC) { b.CaPem = strings.Repeat(caPEM, 64<<10/len(caPEM)+1) }, "bmc.caPem"},
		{"a short digest", func(b *computev1.MachineBMC) { b.CertificateSha256 = "abcd" }, "bmc.certificateSha256"},
		{"a digest not hex", func(b *computev1.MachineBMC) { b.CertificateSha256 = strings.Repeat("zz", 32) }, "bmc.certificateSha256"},
		{"insecure with a pin", func(b *computev1.MachineBMC) { b.InsecureSkipVerify, b.CertificateSha256 = true, sum }, "bmc.insecureSkipVerify"},
		{"insecure with a CA", func(b *computev1.MachineBMC) { b.InsecureSkipVerify, b.CaPem = true, caPEM }, "bmc.insecureSkipVerify"},
	} {
		b := bmc("https://10.1.1.1")
		bad.edit(b)
		_, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "x", b)
		if code, field := envelope(err); code != fault.InvalidInput || field != bad.field {
			t.Errorf("%s: %v, want INVALID_INPUT on %s", bad.name, err, bad.field)
		}
	}
	tofu, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "tofu", bmc("https://10.1.1.1"))
	if err != nil || tofu.GetBmcInsecureSkipVerify() || tofu.GetBmcCaPinned() || tofu.GetBmcCertificateSha256() != "" {
		t.Fatalf("a machine without TLS options: %v %v", tofu, err)
	}
	b := bmc("https://10.1.1.2")
	b.CertificateSha256 = strings.ToUpper(sum)
	pinned, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "pinned", b)
	if err != nil || pinned.GetBmcCertificateSha256() != sum {
		t.Fatalf("a pinned machine: %v %v", pinned, err)
	}
	b = bmc("https://10.1.1.3")
	b.CaPem = caPEM
	withCA, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "with-ca", b)
	if err != nil || !withCA.GetBmcCaPinned() {
		t.Fatalf("a machine with a CA: %v %v", withCA, err)
	}
	b = bmc("https://10.1.1.4")
	b.InsecureSkipVerify = true
	insecure, err := mt.enroll(t, mt.admin, mt.site, mt.prodPool, "insecure", b)
	if err != nil || !insecure.GetBmcInsecureSkipVerify() {
		t.Fatalf("an insecure machine: %v %v", insecure, err)
	}
}
