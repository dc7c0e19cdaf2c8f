package api_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
)

// logBuffer is a slog sink tests search.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// setupLogged is setupWith with the process's log (every level) captured
// and, when withKey, a secrets key configured.
func setupLogged(t *testing.T, withKey bool) (*harness, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	url := pgtest.NewDB(t)
	h := &harness{clock: &clock{t: time.Now()}}
	port := 0
	// The api role alone: the metal role would move the machines this
	// test puts in each state (services/metal tests the workflow).
	cfg := &config.Config{Database: config.Database{URL: url}, Server: config.Server{Host: "127.0.0.1", Port: &port, NoMigrate: true},
		Roles: []string{"api"}}
	if withKey {
		cfg.Secrets.KeyFile = filepath.Join(t.TempDir(), "secrets.key")
		if err := os.WriteFile(cfg.Secrets.KeyFile, secrets.NewKey(), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg.Defaults()
	logger := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	a, err := app.New(cfg, app.Options{Logger: logger, API: api.Tuning{Now: h.clock.Now}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	h.base = "http://" + a.Addr()
	if h.db, err = pgxpool.New(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.db.Close)
	cred, err := bootstrap.Run(context.Background(), h.db)
	if err != nil {
		t.Fatal(err)
	}
	h.root = cred.Token
	if h.conn, err = grpc.NewClient(a.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.conn.Close() })
	return h, logs
}

// force moves a machine as the metal workflow would (it is not built yet).
func (h *harness) force(t *testing.T, id string, from, to machines.State) {
	t.Helper()
	if _, err := machines.SetState(context.Background(), h.db, id, []machines.State{from}, to, machines.Change{}); err != nil {
		t.Fatalf("%s → %s: %v", from, to, err)
	}
}

// TestMetal: enroll, get and list; idempotent enroll; the BMC password in
// no answer, event, audit row, idempotency record, log line or column of
// any table (the secret's ciphertext included); every bad input names its
// field; deploy, release, retry, rescue and delete only from their states
// (CONFLICT on "state" otherwise), each an event with the workflow
// enqueued and the generation grown; another tenant sees nothing.
func TestMetal(t *testing.T) {
	t.Parallel()
	h, logs := setupLogged(t, true)
	ctx := context.Background()
	_, acme := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, other := h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
	c := computev1.NewMetalServiceClient(h.conn)
	actx := as(acme)

	site, err := computev1.NewSitesServiceClient(h.conn).Create(actx, &computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "fra1"})
	if err != nil {
		t.Fatal(err)
	}
	siteID := site.GetSite().GetId()
	poolClient := computev1.NewPoolsServiceClient(h.conn)
	pool, err := poolClient.Create(actx, &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "metal", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	poolID := pool.GetPool().GetId()
	otherPool, err := poolClient.Create(as(other), &computev1.PoolsServiceCreateRequest{TenantId: "other", Name: "theirs", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}

	const password = "Pw-7f3a9c-never-shown"
	var answers []string // every answer, to search for the password
	enrollReq := func(name, key string) *computev1.MetalServiceEnrollRequest {
		return &computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: name,
			Labels: map[string]string{"rack": "r1"}, IdempotencyKey: key,
			Bmc: &computev1.MachineBMC{Address: "https://BMC-1.example:8443/", Username: "admin", Password: password}}
	}
	enrolled, err := c.Enroll(actx, enrollReq("m1", "e1"))
	if err != nil {
		t.Fatal(err)
	}
	m1 := enrolled.GetMachine()
	answers = append(answers, enrolled.String())
	if !strings.HasPrefix(m1.GetId(), "mach_") || m1.GetState() != "enrolled" || m1.GetPurpose() != "commission" ||
		!strings.HasPrefix(m1.GetBmcCredentialsRef(), "sec_") || !strings.HasPrefix(m1.GetNodeId(), "node_") ||
		m1.GetBmcAddress() != "https://bmc-1.example:8443" || m1.GetSiteId() != siteID || m1.GetPoolId() != poolID || m1.GetGeneration() != 1 {
		t.Fatalf("enrolled %v", m1)
	}

	// Idempotent: the same request answers the same machine; another under
	// the same key (a different password) is CONFLICT.
	again, err := c.Enroll(actx, enrollReq("m1", "e1"))
	if err != nil || again.GetMachine().GetId() != m1.GetId() || again.GetMachine().GetBmcCredentialsRef() != m1.GetBmcCredentialsRef() {
		t.Fatalf("a replay: %v %v, want machine %s", again, err, m1.GetId())
	}
	changed := enrollReq("m1", "e1")
	changed.Bmc.Password = password + "-other"
	_, err = c.Enroll(actx, changed)
	wantCode(t, err, fault.Conflict, "idempotencyKey")
	_, err = c.Enroll(actx, enrollReq("m1", ""))
	wantCode(t, err, fault.Conflict, "name")
	if n := h.count(t, `SELECT count(*) FROM secrets`); n != 1 {
		t.Fatalf("%d secrets after a replay and two refusals, want 1", n)
	}

	// A second machine with the first one's credentials: the same BMC
	// address (the secret is bound to it), at another site.
	site2, err := computev1.NewSitesServiceClient(h.conn).Create(actx, &computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "ams1"})
	if err != nil {
		t.Fatal(err)
	}
	m2resp, err := c.Enroll(actx, &computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: site2.GetSite().GetId(), PoolId: poolID, Name: "m2",
		Bmc: &computev1.MachineBMC{Address: "https://bmc-1.example:8443", CredentialsRef: m1.GetBmcCredentialsRef()}})
	if err != nil {
		t.Fatal(err)
	}
	m2 := m2resp.GetMachine()
	answers = append(answers, m2resp.String())
	if m2.GetBmcCredentialsRef() != m1.GetBmcCredentialsRef() || m2.GetNodeId() == m1.GetNodeId() {
		t.Fatalf("m2 %v", m2)
	}

	// Get and list, with filters.
	got, err := c.Get(actx, &computev1.MetalServiceGetRequest{TenantId: "acme", MachineId: m1.GetId()})
	if err != nil || got.GetMachine().GetName() != "m1" || got.GetMachine().GetLabels()["rack"] != "r1" {
		t.Fatalf("get: %v %v", got, err)
	}
	answers = append(answers, got.String())
	list, err := c.List(actx, &computev1.MetalServiceListRequest{TenantId: "acme", State: "enrolled"})
	if err != nil || len(list.GetMachines()) != 2 {
		t.Fatalf("list: %v %v", list, err)
	}
	answers = append(answers, list.String())
	if l, err := c.List(actx, &computev1.MetalServiceListRequest{TenantId: "acme", State: "ready"}); err != nil || len(l.GetMachines()) != 0 {
		t.Fatalf("list ready: %v %v", l, err)
	}
	if l, err := c.List(actx, &computev1.MetalServiceListRequest{TenantId: "acme", SiteId: siteID}); err != nil || len(l.GetMachines()) != 1 {
		t.Fatalf("list of one site: %v %v", l, err)
	}
	if l, err := c.List(actx, &computev1.MetalServiceListRequest{TenantId: "acme", SiteId: "site_other"}); err != nil || len(l.GetMachines()) != 0 {
		t.Fatalf("list of another site: %v %v", l, err)
	}
	if l, err := c.List(actx, &computev1.MetalServiceListRequest{TenantId: "acme", PageSize: 1}); err != nil || len(l.GetMachines()) != 1 || l.GetNextPageToken() == "" {
		t.Fatalf("a page of 1: %v %v", l, err)
	}
	_, err = c.List(actx, &computev1.MetalServiceListRequest{TenantId: "acme", State: "sleeping"})
	wantCode(t, err, fault.InvalidInput, "state")
	status, body := h.rest(t, acme, "metal/get", `{"tenantId":"acme","machineId":"`+m1.GetId()+`"}`)
	if status != 200 || body["machine"].(map[string]any)["state"] != "enrolled" {
		t.Fatalf("REST metal/get: %d %v", status, body)
	}

	// The workflow is enqueued for each machine.
	if n := h.count(t, `SELECT count(*) FROM work_queue WHERE kind = 'metal' AND key = ANY($1)`, []string{m1.GetId(), m2.GetId()}); n != 2 {
		t.Fatalf("%d metal jobs queued, want 2", n)
	}

	// Every bad input names its field.
	bmc := func(addr string) *computev1.MachineBMC {
		return &computev1.MachineBMC{Address: addr, Username: "u", Password: "p"}
	}
	for _, bad := range []struct {
		req   *computev1.MetalServiceEnrollRequest
		code  fault.Code
		field string
	}{
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", PoolId: poolID, Name: "x", Bmc: bmc("https://h")}, fault.InvalidInput, "siteId"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, Name: "x", Bmc: bmc("https://h")}, fault.InvalidInput, "poolId"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Bmc: bmc("https://h")}, fault.InvalidInput, "name"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "Bad_Name", Bmc: bmc("https://h")}, fault.InvalidInput, "name"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: strings.Repeat("a", 64), Bmc: bmc("https://h")}, fault.InvalidInput, "name"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("https://h"), Labels: map[string]string{"bc:site": "x"}}, fault.InvalidInput, "labels"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x"}, fault.InvalidInput, "bmc"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("http://h")}, fault.InvalidInput, "bmc.address"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("")}, fault.InvalidInput, "bmc.address"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("https://h/redfish/v1")}, fault.InvalidInput, "bmc.address"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("https://u:p@h")}, fault.InvalidInput, "bmc.address"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("https://h:99999")}, fault.InvalidInput, "bmc.address"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: bmc("https://" + strings.Repeat("h", 300))}, fault.InvalidInput, "bmc.address"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: &computev1.MachineBMC{Address: "https://h", Password: "p"}}, fault.InvalidInput, "bmc.username"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: &computev1.MachineBMC{Address: "https://h", Username: "u"}}, fault.InvalidInput, "bmc.password"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: &computev1.MachineBMC{Address: "https://h", Username: "u", Password: strings.Repeat("p", 1025)}}, fault.InvalidInput, "bmc.password"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: &computev1.MachineBMC{Address: "https://h", Username: "u", CredentialsRef: m1.GetBmcCredentialsRef()}}, fault.InvalidInput, "bmc.username"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: &computev1.MachineBMC{Address: "https://h", CredentialsRef: "nope"}}, fault.InvalidInput, "bmc.credentialsRef"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: poolID, Name: "x", Bmc: &computev1.MachineBMC{Address: "https://h", CredentialsRef: "sec_nope"}}, fault.NotFound, "bmc.credentialsRef"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: "site_nope", PoolId: poolID, Name: "x", Bmc: bmc("https://h")}, fault.NotFound, "siteId"},
		{&computev1.MetalServiceEnrollRequest{TenantId: "acme", SiteId: siteID, PoolId: otherPool.GetPool().GetId(), Name: "x", Bmc: bmc("https://h")}, fault.NotFound, "poolId"},
	} {
		_, err := c.Enroll(actx, bad.req)
		wantCode(t, err, bad.code, bad.field)
	}

	// Deploy only from ready.
	image := &computev1.MachineImage{Url: "https://images.example/ubuntu-24.04.raw", Sha256: strings.Repeat("ab", 32), SizeBytes: 4 << 30}
	_, err = c.Deploy(actx, &computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: image})
	wantCode(t, err, fault.Conflict, "state")
	for _, bad := range []struct {
		req   *computev1.MetalServiceDeployRequest
		code  fault.Code
		field string
	}{
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", Image: image}, fault.InvalidInput, "machineId"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId()}, fault.InvalidInput, "image"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: &computev1.MachineImage{Url: "http://x/i", Sha256: image.Sha256, SizeBytes: 1}}, fault.InvalidInput, "image.url"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: &computev1.MachineImage{Url: image.Url, Sha256: "abc", SizeBytes: 1}}, fault.InvalidInput, "image.sha256"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: &computev1.MachineImage{Url: image.Url, Sha256: strings.Repeat("zz", 32), SizeBytes: 1}}, fault.InvalidInput, "image.sha256"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: &computev1.MachineImage{Url: image.Url, Sha256: image.Sha256}}, fault.InvalidInput, "image.sizeBytes"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: image, CloudInit: strings.Repeat("c", 64<<10+1)}, fault.InvalidInput, "cloudInit"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: image, PoolId: otherPool.GetPool().GetId()}, fault.NotFound, "poolId"},
		{&computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: "mach_nope", Image: image}, fault.NotFound, "machineId"},
	} {
		_, err := c.Deploy(actx, bad.req)
		wantCode(t, err, bad.code, bad.field)
	}
	for _, step := range [][2]machines.State{{"enrolled", "inspecting"}, {"inspecting", "booting-ramdisk"}, {"booting-ramdisk", "diagnosing"},
		{"diagnosing", "wiping"}, {"wiping", "ready"}} {
		h.force(t, m1.GetId(), step[0], step[1])
	}
	before, _ := c.Get(actx, &computev1.MetalServiceGetRequest{TenantId: "acme", MachineId: m1.GetId()})
	cloudInit := "#cloud-config\nusers: []\n"
	dep, err := c.Deploy(actx, &computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: image, CloudInit: cloudInit})
	if err != nil {
		t.Fatal(err)
	}
	answers = append(answers, dep.String())
	dm := dep.GetMachine()
	if dm.GetState() != "deploying" || dm.GetPurpose() != "deploy" || dm.GetImage().GetSha256() != image.Sha256 ||
		dm.GetCloudInitBytes() != int32(len(cloudInit)) || dm.GetGeneration() <= before.GetMachine().GetGeneration() {
		t.Fatalf("deployed %v (before: generation %d)", dm, before.GetMachine().GetGeneration())
	}
	if strings.Contains(dep.String(), "cloud-config") {
		t.Fatal("the deploy's answer shows the cloud-init user data")
	}
	_, err = c.Deploy(actx, &computev1.MetalServiceDeployRequest{TenantId: "acme", MachineId: m1.GetId(), Image: image})
	wantCode(t, err, fault.Conflict, "state")

	// Release: not while deploying, yes once joined.
	_, err = c.Release(actx, &computev1.MetalServiceReleaseRequest{TenantId: "acme", MachineId: m1.GetId()})
	wantCode(t, err, fault.Conflict, "state")
	h.force(t, m1.GetId(), "deploying", "rebooting")
	h.force(t, m1.GetId(), "rebooting", "joined")
	rel, err := c.Release(actx, &computev1.MetalServiceReleaseRequest{TenantId: "acme", MachineId: m1.GetId()})
	if err != nil || rel.GetMachine().GetState() != "booting-ramdisk" || rel.GetMachine().GetPurpose() != "release" {
		t.Fatalf("release: %v %v", rel, err)
	}
	// Delete: not while the flow runs.
	_, err = c.Delete(actx, &computev1.MetalServiceDeleteRequest{TenantId: "acme", MachineId: m1.GetId()})
	wantCode(t, err, fault.Conflict, "state")

	// Retry: only from failed, back to the failed step.
	_, err = c.Retry(actx, &computev1.MetalServiceRetryRequest{TenantId: "acme", MachineId: m1.GetId()})
	wantCode(t, err, fault.Conflict, "state")
	if _, err := machines.Fail(ctx, h.db, m1.GetId(), machines.StateBootingRamdisk, "no PXE request within 10m"); err != nil {
		t.Fatal(err)
	}
	ret, err := c.Retry(actx, &computev1.MetalServiceRetryRequest{TenantId: "acme", MachineId: m1.GetId()})
	if err != nil || ret.GetMachine().GetState() != "booting-ramdisk" || ret.GetMachine().GetFailedStep() != "" || ret.GetMachine().GetStepAttempts() != 0 {
		t.Fatalf("retry: %v %v", ret, err)
	}

	// Rescue: not from enrolled; yes from ready.
	_, err = c.Rescue(actx, &computev1.MetalServiceRescueRequest{TenantId: "acme", MachineId: m2.GetId()})
	wantCode(t, err, fault.Conflict, "state")
	// A machine that failed while commissioning is not released.
	if _, err := machines.Fail(ctx, h.db, m2.GetId(), machines.StateEnrolled, "redfish: 401"); err != nil {
		t.Fatal(err)
	}
	_, err = c.Release(actx, &computev1.MetalServiceReleaseRequest{TenantId: "acme", MachineId: m2.GetId()})
	wantCode(t, err, fault.Conflict, "state")
	h.force(t, m2.GetId(), "failed", "inspecting")
	h.force(t, m2.GetId(), "inspecting", "booting-ramdisk")
	h.force(t, m2.GetId(), "booting-ramdisk", "diagnosing")
	h.force(t, m2.GetId(), "diagnosing", "wiping")
	h.force(t, m2.GetId(), "wiping", "ready")
	res, err := c.Rescue(actx, &computev1.MetalServiceRescueRequest{TenantId: "acme", MachineId: m2.GetId()})
	if err != nil || res.GetMachine().GetState() != "booting-ramdisk" || res.GetMachine().GetPurpose() != "rescue" {
		t.Fatalf("rescue: %v %v", res, err)
	}

	// Another tenant sees nothing.
	_, err = c.Get(as(other), &computev1.MetalServiceGetRequest{TenantId: "other", MachineId: m1.GetId()})
	wantCode(t, err, fault.NotFound, "machineId")
	_, err = c.Get(as(other), &computev1.MetalServiceGetRequest{TenantId: "acme", MachineId: m1.GetId()})
	if code, _ := envelope(err); code != fault.AccessDenied && code != fault.NotFound {
		t.Fatalf("another tenant reading acme's machine: %v", err)
	}
	if l, err := c.List(as(other), &computev1.MetalServiceListRequest{TenantId: "other"}); err != nil || len(l.GetMachines()) != 0 {
		t.Fatalf("other's list: %v %v", l, err)
	}
	_, err = c.Enroll(as(other), &computev1.MetalServiceEnrollRequest{TenantId: "other", SiteId: siteID, PoolId: otherPool.GetPool().GetId(), Name: "x", Bmc: bmc("https://h")})
	wantCode(t, err, fault.NotFound, "siteId")
	_, err = c.Enroll(as(other), &computev1.MetalServiceEnrollRequest{TenantId: "other", SiteId: "site_x", PoolId: otherPool.GetPool().GetId(), Name: "x",
		Bmc: &computev1.MachineBMC{Address: "https://h", CredentialsRef: m1.GetBmcCredentialsRef()}})
	if code, _ := envelope(err); code != fault.NotFound {
		t.Fatalf("another tenant naming acme's credentials: %v", err)
	}
	for _, call := range []func() error{
		func() error {
			_, err := c.Deploy(as(other), &computev1.MetalServiceDeployRequest{TenantId: "other", MachineId: m2.GetId(), Image: image})
			return err
		},
		func() error {
			_, err := c.Delete(as(other), &computev1.MetalServiceDeleteRequest{TenantId: "other", MachineId: m2.GetId()})
			return err
		},
	} {
		wantCode(t, call(), fault.NotFound, "machineId")
	}

	// Delete: the shared secret stays until its last machine goes.
	h.force(t, m2.GetId(), "booting-ramdisk", "rescue")
	if _, err := machines.Fail(ctx, h.db, m2.GetId(), machines.StateRescue, "operator gave up"); err != nil {
		t.Fatal(err)
	}
	del, err := c.Delete(actx, &computev1.MetalServiceDeleteRequest{TenantId: "acme", MachineId: m2.GetId()})
	if err != nil || del.GetMachine().GetId() != m2.GetId() {
		t.Fatalf("delete m2: %v %v", del, err)
	}
	answers = append(answers, del.String())
	if n := h.count(t, `SELECT count(*) FROM secrets WHERE id = $1`, m1.GetBmcCredentialsRef()); n != 1 {
		t.Fatal("deleting m2 deleted the secret m1 still uses")
	}
	if _, err := machines.Fail(ctx, h.db, m1.GetId(), machines.StateBootingRamdisk, "gave up"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Delete(actx, &computev1.MetalServiceDeleteRequest{TenantId: "acme", MachineId: m1.GetId()}); err != nil {
		t.Fatal(err)
	}
	if n := h.count(t, `SELECT count(*) FROM secrets`); n != 0 {
		t.Fatalf("%d secrets after the last machine went, want 0", n)
	}
	_, err = c.Get(actx, &computev1.MetalServiceGetRequest{TenantId: "acme", MachineId: m1.GetId()})
	wantCode(t, err, fault.NotFound, "machineId")

	// Each mutation is an event.
	for typ, want := range map[string]int{"machine.enrolled": 2, "machine.deploy_requested": 1, "machine.release_requested": 1,
		"machine.retried": 1, "machine.rescue_requested": 1, "machine.deleted": 2} {
		if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = $1`, typ); n != want {
			t.Errorf("%d %s events, want %d", n, typ, want)
		}
	}

	// The password is nowhere: not in an answer, a log line, or any column
	// of any table (as text, and as hex, which is how bytea reads).
	for _, a := range answers {
		if strings.Contains(a, password) {
			t.Fatalf("an answer holds the password: %s", a)
		}
	}
	if strings.Contains(logs.String(), password) {
		t.Fatal("the log holds the password")
	}
	if !strings.Contains(logs.String(), `"msg"`) {
		t.Fatal("the captured log is empty: the search proved nothing")
	}
	hexPW := hex.EncodeToString([]byte(password))
	tables, err := h.db.Query(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'`)
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(tables, pgx.RowTo[string])
	if err != nil || len(names) < 20 {
		t.Fatalf("tables: %v %v", names, err)
	}
	found := 0 // the same search finds the site's id, or it proves nothing
	for _, name := range names {
		ident := pgx.Identifier{name}.Sanitize()
		var n int
		if err := h.db.QueryRow(ctx, `SELECT count(*) FROM `+ident+` t WHERE t::text LIKE '%' || $1 || '%'`, siteID).Scan(&n); err != nil {
			t.Fatalf("search %s: %v", name, err)
		}
		found += n
		if err := h.db.QueryRow(ctx, `SELECT count(*) FROM `+ident+` t WHERE t::text LIKE '%' || $1 || '%' OR t::text LIKE '%' || $2 || '%'`,
			password, hexPW).Scan(&n); err != nil {
			t.Fatalf("search %s: %v", name, err)
		}
		if n != 0 {
			t.Errorf("table %s: %d rows hold the password", name, n)
		}
	}
	if found < 3 {
		t.Fatalf("the search found the site's id in %d rows (sites, projection, outbox at least): it does not search", found)
	}
	if n := h.count(t, `SELECT count(*) FROM audit WHERE action LIKE 'compute:metal:%'`); n < 8 {
		t.Errorf("%d metal audit rows, want one per mutation", n)
	}
}

// TestMetalSecretAtRest: the stored secret is ciphertext under the
// configured key and opens to the enrolled credentials.
func TestMetalSecretAtRest(t *testing.T) {
	t.Parallel()
	h, _ := setupLogged(t, true)
	ctx := as(h.root)
	site, err := computev1.NewSitesServiceClient(h.conn).Create(ctx, &computev1.SitesServiceCreateRequest{TenantId: "root", Name: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := computev1.NewPoolsServiceClient(h.conn).Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "p1", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := computev1.NewMetalServiceClient(h.conn).Enroll(ctx, &computev1.MetalServiceEnrollRequest{TenantId: "root", SiteId: site.GetSite().GetId(),
		PoolId: pool.GetPool().GetId(), Name: "m1", Bmc: &computev1.MachineBMC{Address: "https://10.1.1.1", Username: "root", Password: "calvin-XYZ-123"}})
	if err != nil {
		t.Fatal(err)
	}
	var ct, nonce []byte
	var keyID, kind string
	if err := h.db.QueryRow(context.Background(), `SELECT kind, key_id, nonce, ciphertext FROM secrets WHERE id = $1`, resp.GetMachine().GetBmcCredentialsRef()).
		Scan(&kind, &keyID, &nonce, &ct); err != nil {
		t.Fatal(err)
	}
	if kind != "bmc" || len(keyID) != 16 || len(nonce) != 12 || bytes.Contains(ct, []byte("calvin")) {
		t.Fatalf("stored kind %s key %s nonce %d bytes; ciphertext holds the password: %v", kind, keyID, len(nonce), bytes.Contains(ct, []byte("calvin")))
	}
}

// TestMetalWithoutSecretsKey: a control plane with no secrets.keyFile
// starts and serves, and refuses metal.enroll UNSUPPORTED naming the
// setting, storing nothing.
func TestMetalWithoutSecretsKey(t *testing.T) {
	t.Parallel()
	h, _ := setupLogged(t, false)
	ctx := as(h.root)
	_, err := computev1.NewMetalServiceClient(h.conn).Enroll(ctx, &computev1.MetalServiceEnrollRequest{TenantId: "root", SiteId: "site_x", PoolId: "pool_x",
		Name: "m1", Bmc: &computev1.MachineBMC{Address: "https://10.1.1.1", Username: "root", Password: "calvin"}})
	wantCode(t, err, fault.Unsupported, "secrets.keyFile")
	if l, err := computev1.NewMetalServiceClient(h.conn).List(ctx, &computev1.MetalServiceListRequest{TenantId: "root"}); err != nil || len(l.GetMachines()) != 0 {
		t.Fatalf("list without a key: %v %v", l, err)
	}
	if n := h.count(t, `SELECT count(*) FROM secrets`); n != 0 {
		t.Fatalf("%d secrets stored", n)
	}
}
