package api_test

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"google.golang.org/grpc/metadata"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

func TestIdempotentCreate(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pools := computev1.NewPoolsServiceClient(h.conn)
	req := &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "gpus", Class: "gpu", IdempotencyKey: "k1"}

	first, err := pools.Create(as(h.root), req)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("a repeat over gRPC replays the stored result", func(t *testing.T) {
		again, err := pools.Create(as(h.root), req)
		if err != nil {
			t.Fatal(err)
		}
		if again.GetPool().GetId() != first.GetPool().GetId() || !again.GetPool().GetCreateTime().AsTime().Equal(first.GetPool().GetCreateTime().AsTime()) {
			t.Fatalf("replay %v, first %v", again, first)
		}
	})

	t.Run("a repeat over REST is the same request", func(t *testing.T) {
		code, body := h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"gpus","idempotencyKey":"k1"}`)
		if code != http.StatusOK || body["pool"].(map[string]any)["id"] != first.GetPool().GetId() {
			t.Fatalf("%d %v", code, body)
		}
	})

	t.Run("a different request under the key is CONFLICT", func(t *testing.T) {
		_, err := pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "other", Class: "gpu", IdempotencyKey: "k1"})
		wantCode(t, err, fault.Conflict, "idempotencyKey")
		code, body := h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"vps-host","name":"gpus","idempotencyKey":"k1"}`)
		wantREST(t, code, body, fault.Conflict, "idempotencyKey")
	})

	t.Run("the key is scoped to the identity", func(t *testing.T) {
		who, err := computev1.NewSystemServiceClient(h.conn).WhoAmI(as(h.root), &computev1.WhoAmIRequest{})
		if err != nil {
			t.Fatal(err)
		}
		other, err := computev1.NewIdentitiesServiceClient(h.conn).Create(as(h.root), &computev1.IdentitiesServiceCreateRequest{TenantId: "root", Name: "second"})
		if err != nil {
			t.Fatal(err)
		}
		key, err := computev1.NewApiKeysServiceClient(h.conn).Create(as(h.root), &computev1.ApiKeysServiceCreateRequest{TenantId: "root", IdentityId: other.GetIdentity().GetId()})
		if err != nil || other.GetIdentity().GetId() == who.GetIdentityId() {
			t.Fatal(err)
		}
		// Another identity's "k1" is its own: the name is taken, so its create
		// fails on the name rather than replaying root-admin's pool.
		_, err = pools.Create(as(key.GetSecret()), req)
		wantCode(t, err, fault.Conflict, "name")
	})

	if n := h.count(t, `SELECT count(*) FROM pools`); n != 1 {
		t.Fatalf("pools = %d, want 1", n)
	}
	if n := h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:pools:create' AND decision = 'allow'`); n != 1 {
		t.Fatalf("allow audit rows = %d, want 1", n)
	}
	if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'pool.created'`); n != 1 {
		t.Fatalf("outbox rows = %d, want 1", n)
	}
}

func TestConcurrentIdenticalCreatesMakeOneResource(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pools := computev1.NewPoolsServiceClient(h.conn)
	const n = 16
	ids := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			resp, err := pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "race", Class: "gpu", IdempotencyKey: "same"})
			ids[i], errs[i] = resp.GetPool().GetId(), err
		})
	}
	close(start)
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if ids[i] != ids[0] {
			t.Fatalf("call %d made %s, call 0 %s", i, ids[i], ids[0])
		}
	}
	if c := h.count(t, `SELECT count(*) FROM pools`); c != 1 {
		t.Fatalf("pools = %d", c)
	}
	if c := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'pool.created'`); c != 1 {
		t.Fatalf("outbox rows = %d", c)
	}
}

func TestAuditAndOutboxShareTheTransaction(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pools := computev1.NewPoolsServiceClient(h.conn)

	t.Run("a create writes its audit and outbox rows", func(t *testing.T) {
		code, body := h.rest(t, h.root, "pools/create", `{"tenantId":"root","name":"a","class":"gpu"}`)
		if code != http.StatusOK {
			t.Fatalf("%d %v", code, body)
		}
		id := body["pool"].(map[string]any)["id"].(string)
		if n := h.count(t, `SELECT count(*) FROM audit WHERE resource = $1 AND decision = 'allow' AND request_id <> '' AND method = $2`,
			`Pool::"`+id+`"`, computev1.PoolsService_Create_FullMethodName); n != 1 {
			t.Fatalf("audit rows for %s = %d", id, n)
		}
		if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'pool.created' AND subject = 'bc.events.root.pool.created' AND payload->'pool'->>'id' = $1`, id); n != 1 {
			t.Fatalf("outbox rows for %s = %d", id, n)
		}
	})

	t.Run("the request id travels into the audit row", func(t *testing.T) {
		ctx := metadata.AppendToOutgoingContext(as(h.root), "x-request-id", "req-42")
		if _, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "b", Class: "gpu"}); err != nil {
			t.Fatal(err)
		}
		if n := h.count(t, `SELECT count(*) FROM audit WHERE request_id = 'req-42'`); n != 1 {
			t.Fatalf("audit rows with the request id = %d", n)
		}
	})

	t.Run("a failed work leaves neither row, no draft and no key", func(t *testing.T) {
		before := h.rows(t)
		_, err := pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu", IdempotencyKey: "dup"})
		wantCode(t, err, fault.Conflict, "name")
		if after := h.rows(t); after != before {
			t.Fatalf("rows (pools, audit, outbox, idempotency, projection) %v → %v", before, after)
		}
	})

	t.Run("a transaction failing after its audit and outbox writes keeps neither", func(t *testing.T) {
		// The last statement of transaction 2 stores the idempotent result;
		// make it fail after the pool, audit and outbox rows were written.
		_, err := h.db.Exec(context.Background(), `
			CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN IF NEW.key = 'boom' THEN RAISE EXCEPTION 'boom'; END IF; RETURN NEW; END $$;
			CREATE TRIGGER boom BEFORE UPDATE ON idempotency FOR EACH ROW EXECUTE FUNCTION boom();`)
		if err != nil {
			t.Fatal(err)
		}
		before := h.rows(t)
		_, err = pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "c", Class: "gpu", IdempotencyKey: "boom"})
		wantCode(t, err, fault.Internal, "")
		if after := h.rows(t); after != before {
			t.Fatalf("rows (pools, audit, outbox, idempotency, projection) %v → %v", before, after)
		}
	})
}
