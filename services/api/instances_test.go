package api_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"google.golang.org/protobuf/types/known/fieldmaskpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// apiOnly runs only the api role, so the work a call enqueues stays in the
// queue for the test to see.
func apiOnly(c *config.Config) { c.Roles = []string{"api"} }

// vpsPool creates a vps-host pool of root whose hosts each have 8 vCPUs,
// 16384 MiB and 100 GiB for instances (host size minus reserve, set through
// pools.update vps), with hosts adopted, schedulable and live, each with
// gpus H200s; it returns the pool's id.
func (h *harness) vpsPool(t testing.TB, name string, hosts, gpus int) string {
	t.Helper()
	pc := computev1.NewPoolsServiceClient(h.conn)
	p, err := pc.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: name, Class: "vps-host"})
	if err != nil {
		t.Fatal(err)
	}
	id := p.GetPool().GetId()
	for i := range hosts {
		h.node(t, id, fmt.Sprintf("node_%s_%02d", name, i), 1, gpus)
	}
	if _, err := h.db.Exec(t.Context(), `UPDATE devices SET pci_bus_id = '0000:' || lpad((24 + index)::text, 2, '0') || ':00.0'
		WHERE node_id IN (SELECT id FROM nodes WHERE pool_id = $1)`, id); err != nil {
		t.Fatal(err)
	}
	_, err = pc.Update(as(h.root), &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: id,
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vps"}},
		Vps: &computev1.VpsSettings{
			Host:    &computev1.VpsSize{Vcpus: 9, MemoryMib: 16384 + 1024, DiskGib: 110},
			Reserve: &computev1.VpsSize{Vcpus: 1, MemoryMib: 1024, DiskGib: 10},
		}})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func small(pool string) *computev1.InstancesServiceCreateRequest {
	return &computev1.InstancesServiceCreateRequest{TenantId: "root", PoolId: pool, Vcpus: 2, MemoryMib: 2048, DiskGib: 20,
		Image: "ubuntu-24.04", SshKeys: []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI test@example"}}
}

func TestInstancesCreate(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{}, apiOnly)
	pool := h.vpsPool(t, "v", 2, 2)
	c := computev1.NewInstancesServiceClient(h.conn)
	ctx := as(h.root)

	t.Run("every bad input names its field", func(t *testing.T) {
		gp := h.gpuPool(t, "g", 0, 0)
		prov, err := computev1.NewPoolsServiceClient(h.conn).Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "p", Class: "provider"})
		if err != nil {
			t.Fatal(err)
		}
		with := func(f func(r *computev1.InstancesServiceCreateRequest)) *computev1.InstancesServiceCreateRequest {
			r := small(pool)
			f(r)
			return r
		}
		for _, tc := range []struct {
			name  string
			req   *computev1.InstancesServiceCreateRequest
			code  fault.Code
			field string
		}{
			{"no pool", with(func(r *computev1.InstancesServiceCreateRequest) { r.PoolId = "" }), fault.InvalidInput, "poolId"},
			{"no vCPUs", with(func(r *computev1.InstancesServiceCreateRequest) { r.Vcpus = 0 }), fault.InvalidInput, "vcpus"},
			{"no memory", with(func(r *computev1.InstancesServiceCreateRequest) { r.MemoryMib = 0 }), fault.InvalidInput, "memoryMiB"},
			{"disk too big", with(func(r *computev1.InstancesServiceCreateRequest) { r.DiskGib = 1 << 20 }), fault.InvalidInput, "diskGiB"},
			{"too many GPUs", with(func(r *computev1.InstancesServiceCreateRequest) { r.GpuCount = 17 }), fault.InvalidInput, "gpuCount"},
			{"model without GPUs", with(func(r *computev1.InstancesServiceCreateRequest) { r.GpuModel = "NVIDIA H200" }), fault.InvalidInput, "gpuModel"},
			{"no image", with(func(r *computev1.InstancesServiceCreateRequest) { r.Image = "" }), fault.InvalidInput, "image"},
			{"bad key", with(func(r *computev1.InstancesServiceCreateRequest) { r.SshKeys = []string{"hello"} }), fault.InvalidInput, "sshKeys"},
			{"user data over 64 KiB", with(func(r *computev1.InstancesServiceCreateRequest) { r.UserData = strings.Repeat("x", 64<<10+1) }), fault.InvalidInput, "userData"},
			{"unknown pool", with(func(r *computev1.InstancesServiceCreateRequest) { r.PoolId = "pool_nope" }), fault.NotFound, "poolId"},
			{"gpu pool", with(func(r *computev1.InstancesServiceCreateRequest) { r.PoolId = gp }), fault.InvalidInput, "poolId"},
			{"provider pool without a provider", with(func(r *computev1.InstancesServiceCreateRequest) { r.PoolId = prov.GetPool().GetId() }), fault.InvalidInput, "poolId"},
		} {
			_, err := c.Create(ctx, tc.req)
			if code, field := envelope(err); code != tc.code || field != tc.field {
				t.Errorf("%s: got %s on %q (%v), want %s on %q", tc.name, code, field, err, tc.code, tc.field)
			}
		}
		if n := h.count(t, `SELECT count(*) FROM instances`); n != 0 {
			t.Fatalf("refused creates left %d instances", n)
		}
	})

	var first *computev1.Instance
	t.Run("places, enqueues the host's spec and writes the event", func(t *testing.T) {
		req := small(pool)
		req.GpuCount, req.IdempotencyKey = 1, "k1"
		resp, err := c.Create(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		first = resp.GetInstance()
		if !strings.HasPrefix(first.GetId(), "inst_") || first.GetState() != "placed" || first.GetNodeId() == "" || first.GetPowerState() != "running" ||
			first.GetGeneration() != 1 || len(first.GetGpus()) != 1 || first.GetGpus()[0].GetPciBusId() == "" {
			t.Fatalf("created %v", first)
		}
		if n := h.count(t, `SELECT count(*) FROM work_queue WHERE kind = 'nodespec' AND key = $1`, first.GetNodeId()); n != 1 {
			t.Fatalf("host's nodespec job queued %d times, want 1", n)
		}
		if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'instance.placed' AND resource_id = $1`, first.GetId()); n != 1 {
			t.Fatalf("%d instance.placed events", n)
		}
	})
	t.Run("an idempotency key replays; another request under it conflicts", func(t *testing.T) {
		req := small(pool)
		req.GpuCount, req.IdempotencyKey = 1, "k1"
		again, err := c.Create(ctx, req)
		if err != nil || again.GetInstance().GetId() != first.GetId() {
			t.Fatalf("replay: %v %v", again, err)
		}
		req.Vcpus = 3
		_, err = c.Create(ctx, req)
		wantCode(t, err, fault.Conflict, "idempotencyKey")
		if n := h.count(t, `SELECT count(*) FROM instances`); n != 1 {
			t.Fatalf("%d instances, want 1", n)
		}
	})
	t.Run("REST uses memoryMiB and diskGiB", func(t *testing.T) {
		code, body := h.rest(t, h.root, "instances/create", fmt.Sprintf(
			`{"tenantId":"root","poolId":%q,"vcpus":1,"memoryMiB":"512","diskGiB":"5","image":"debian-12"}`, pool))
		inst, _ := body["instance"].(map[string]any)
		if code != 200 || inst["memoryMiB"] != "512" || inst["diskGiB"] != "5" {
			t.Fatalf("%d %v", code, body)
		}
		code, body = h.rest(t, h.root, "instances/create", fmt.Sprintf(`{"tenantId":"root","poolId":%q,"vcpus":99,"memoryMiB":"1","diskGiB":"1","image":"x"}`, pool))
		wantREST(t, code, body, fault.NoCapacity, "vcpus")
	})
	t.Run("capacity.get shows the free vCPUs, memory, disk and GPUs", func(t *testing.T) {
		got, err := computev1.NewCapacityServiceClient(h.conn).Get(ctx, &computev1.CapacityServiceGetRequest{TenantId: "root", PoolId: pool})
		if err != nil {
			t.Fatal(err)
		}
		hs := got.GetHosts()
		if hs.GetHosts() != 2 || hs.GetVcpusTotal() != 16 || hs.GetVcpusFree() != 16-2-1 || hs.GetMemoryMibFree() != 2*16384-2048-512 ||
			hs.GetDiskGibFree() != 200-20-5 || hs.GetGpusTotal() != 4 || hs.GetGpusFree() != 3 {
			t.Fatalf("hosts %v", hs)
		}
	})
}

func TestInstancesConcurrentCreatesNeverOversubscribe(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{RatePerSecond: 1000, RateBurst: 1000}, apiOnly)
	pool := h.vpsPool(t, "v", 2, 0)
	c := computev1.NewInstancesServiceClient(h.conn)
	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range errs {
		wg.Go(func() {
			req := small(pool)
			req.Vcpus = 3 // two fit on a host of 8
			_, errs[i] = c.Create(as(h.root), req)
		})
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		if err == nil {
			won++
		} else if code, field := envelope(err); code != fault.NoCapacity || field != "vcpus" {
			t.Errorf("got %v, want NO_CAPACITY on vcpus", err)
		}
	}
	if won != 4 {
		t.Fatalf("%d won, want 4", won)
	}
	if n := h.count(t, `SELECT count(*) FROM host_capacity WHERE vcpus_used > vcpus_total OR vcpus_used <> 6`); n != 0 {
		t.Fatalf("%d hosts not at 6 of 8 vCPUs", n)
	}
}

func TestInstancesDesiredState(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{}, apiOnly)
	pool := h.vpsPool(t, "v", 1, 2)
	c := computev1.NewInstancesServiceClient(h.conn)
	ctx := as(h.root)
	created, err := c.Create(ctx, small(pool))
	if err != nil {
		t.Fatal(err)
	}
	in := created.GetInstance()
	ref := &computev1.InstancesServiceGetRequest{TenantId: "root", InstanceId: in.GetId()}
	// queued reports how many nodespec jobs of the host are queued, then
	// empties the queue.
	queued := func() int {
		n := h.count(t, `SELECT count(*) FROM work_queue WHERE kind = 'nodespec' AND key = $1`, in.GetNodeId())
		if _, err := h.db.Exec(t.Context(), `DELETE FROM work_queue WHERE kind = 'nodespec'`); err != nil {
			t.Fatal(err)
		}
		return n
	}
	queued()

	t.Run("stop and start change only desired state", func(t *testing.T) {
		s, err := c.Stop(ctx, &computev1.InstancesServiceStopRequest{TenantId: "root", InstanceId: in.GetId()})
		if err != nil || s.GetInstance().GetPowerState() != "stopped" || s.GetInstance().GetGeneration() != 2 || s.GetInstance().GetState() != "placed" {
			t.Fatalf("stop: %v %v", s, err)
		}
		if n := queued(); n != 1 {
			t.Fatalf("stop queued the host's spec %d times", n)
		}
		if n := h.count(t, `SELECT vcpus_used FROM host_capacity`); n != 2 {
			t.Fatalf("stop changed the host's capacity: %d vCPUs used", n)
		}
		s2, err := c.Stop(ctx, &computev1.InstancesServiceStopRequest{TenantId: "root", InstanceId: in.GetId()})
		if err != nil || s2.GetInstance().GetGeneration() != 2 || queued() != 0 {
			t.Fatalf("a second stop changed it: %v %v", s2, err)
		}
		st, err := c.Start(ctx, &computev1.InstancesServiceStartRequest{TenantId: "root", InstanceId: in.GetId()})
		if err != nil || st.GetInstance().GetPowerState() != "running" || st.GetInstance().GetGeneration() != 3 || queued() != 1 {
			t.Fatalf("start: %v %v", st, err)
		}
	})
	t.Run("resize up and down", func(t *testing.T) {
		r, err := c.Resize(ctx, &computev1.InstancesServiceResizeRequest{TenantId: "root", InstanceId: in.GetId(), Vcpus: 8, MemoryMib: 16384, DiskGib: 100, GpuCount: 2})
		if err != nil || r.GetInstance().GetVcpus() != 8 || len(r.GetInstance().GetGpus()) != 2 || queued() != 1 {
			t.Fatalf("resize up: %v %v", r, err)
		}
		_, err = c.Resize(ctx, &computev1.InstancesServiceResizeRequest{TenantId: "root", InstanceId: in.GetId(), Vcpus: 8, MemoryMib: 16385, DiskGib: 100, GpuCount: 2})
		wantCode(t, err, fault.NoCapacity, "memoryMiB")
		_, err = c.Resize(ctx, &computev1.InstancesServiceResizeRequest{TenantId: "root", InstanceId: in.GetId(), Vcpus: 0, MemoryMib: 1, DiskGib: 100})
		wantCode(t, err, fault.InvalidInput, "vcpus")
		r, err = c.Resize(ctx, &computev1.InstancesServiceResizeRequest{TenantId: "root", InstanceId: in.GetId(), Vcpus: 1, MemoryMib: 1024, DiskGib: 100})
		if err != nil || r.GetInstance().GetVcpus() != 1 || len(r.GetInstance().GetGpus()) != 0 {
			t.Fatalf("resize down: %v %v", r, err)
		}
		if n := h.count(t, `SELECT vcpus_used FROM host_capacity`); n != 1 {
			t.Fatalf("after resize down %d vCPUs used", n)
		}
	})
	t.Run("another tenant sees nothing", func(t *testing.T) {
		_, otherKey := h.member(t, "other", "ops")
		h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
		oc := computev1.NewInstancesServiceClient(h.conn)
		_, err := oc.Get(as(otherKey), &computev1.InstancesServiceGetRequest{TenantId: "other", InstanceId: in.GetId()})
		wantCode(t, err, fault.NotFound, "instanceId")
		_, err = oc.Get(as(otherKey), ref)
		if code, _ := envelope(err); code != fault.AccessDenied {
			t.Fatalf("get as another tenant in root: %v", err)
		}
		_, err = oc.Delete(as(otherKey), &computev1.InstancesServiceDeleteRequest{TenantId: "other", InstanceId: in.GetId()})
		wantCode(t, err, fault.NotFound, "instanceId")
		l, err := oc.List(as(otherKey), &computev1.InstancesServiceListRequest{TenantId: "other"})
		if err != nil || len(l.GetInstances()) != 0 {
			t.Fatalf("list as other: %v %v", l, err)
		}
		mine, err := c.List(ctx, &computev1.InstancesServiceListRequest{TenantId: "root"})
		if err != nil || len(mine.GetInstances()) != 1 {
			t.Fatalf("list as root: %v %v", mine, err)
		}
	})
	t.Run("quota in each dimension", func(t *testing.T) {
		i64 := func(v int64) *int64 { return &v }
		qc := computev1.NewInstancesServiceClient(h.conn)
		for _, tc := range []struct {
			field string
			req   *computev1.InstancesServiceSetQuotaRequest
		}{
			{"vcpus", &computev1.InstancesServiceSetQuotaRequest{Vcpus: i64(2)}},
			{"memoryMiB", &computev1.InstancesServiceSetQuotaRequest{MemoryMib: i64(2048)}},
			{"diskGiB", &computev1.InstancesServiceSetQuotaRequest{DiskGib: i64(110)}},
			{"gpuCount", &computev1.InstancesServiceSetQuotaRequest{Gpus: i64(0)}},
		} {
			tc.req.TenantId, tc.req.PoolId, tc.req.ForTenantId = "root", pool, "root"
			if _, err := qc.SetQuota(ctx, tc.req); err != nil {
				t.Fatal(err)
			}
			req := small(pool)
			req.GpuCount = 1
			_, err := c.Create(ctx, req)
			wantCode(t, err, fault.QuotaExceeded, tc.field)
		}
		l, err := qc.ListQuotas(ctx, &computev1.InstancesServiceListQuotasRequest{TenantId: "root", PoolId: pool})
		if err != nil || len(l.GetQuotas()) != 1 || l.GetQuotas()[0].Gpus == nil || l.GetQuotas()[0].Vcpus != nil {
			t.Fatalf("quotas %v %v", l, err)
		}
		if r, err := qc.SetQuota(ctx, &computev1.InstancesServiceSetQuotaRequest{TenantId: "root", PoolId: pool, ForTenantId: "root"}); err != nil || r.GetQuota() != nil {
			t.Fatalf("remove quota: %v %v", r, err)
		}
		_, err = qc.SetQuota(ctx, &computev1.InstancesServiceSetQuotaRequest{TenantId: "root", PoolId: pool, ForTenantId: "root", DiskGib: i64(-1)})
		wantCode(t, err, fault.InvalidInput, "diskGiB")
	})
	t.Run("delete releases capacity and queues the host", func(t *testing.T) {
		d, err := c.Delete(ctx, &computev1.InstancesServiceDeleteRequest{TenantId: "root", InstanceId: in.GetId()})
		if err != nil || d.GetInstance().GetState() != "deleting" || queued() != 1 {
			t.Fatalf("delete: %v %v", d, err)
		}
		if n := h.count(t, `SELECT vcpus_used + memory_mib_used + disk_gib_used + instances FROM host_capacity`); n != 0 {
			t.Fatalf("after delete the host still holds %d", n)
		}
		full := small(pool)
		full.Vcpus, full.MemoryMib, full.DiskGib, full.GpuCount = 8, 16384, 100, 2
		if _, err := c.Create(ctx, full); err != nil {
			t.Fatalf("the whole host after delete: %v", err)
		}
		_, err = c.Stop(ctx, &computev1.InstancesServiceStopRequest{TenantId: "root", InstanceId: in.GetId()})
		wantCode(t, err, fault.Conflict, "instanceId")
	})
}
