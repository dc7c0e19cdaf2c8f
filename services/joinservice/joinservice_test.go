package joinservice_test

import (
	"context"
	"crypto"
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hpke"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/shard"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// clock is a clock the test moves.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

const trustDomain = "fleet.test"

type harness struct {
	db    *pgxpool.Pool
	clock *clock
	ca    *nodeca.CA
	key   *joinservice.Key
	svc   *joinservice.Service
	pool  string
}

func setup(t *testing.T) *harness {
	t.Helper()
	f := &harness{db: pgtest.New(t), clock: &clock{t: time.Now()}}
	var err error
	if f.ca, err = nodeca.Open(nodeca.Config{TrustDomain: trustDomain, Dir: t.TempDir(), Now: f.clock.Now}); err != nil {
		t.Fatal(err)
	}
	if f.key, err = joinservice.NewKey(); err != nil {
		t.Fatal(err)
	}
	if f.svc, err = joinservice.New(joinservice.Config{DB: f.db, CA: f.ca, Key: f.key}); err != nil {
		t.Fatal(err)
	}
	p, err := pools.Create(context.Background(), f.db, pools.Pool{ID: "pool_gpu", TenantID: "root", Name: "gpu", Class: pools.ClassGPU})
	if err != nil {
		t.Fatal(err)
	}
	f.pool = p.ID
	return f
}

// token mints a token in the harness's pool.
func (f *harness) token(t *testing.T, tok jointoken.Token) string {
	t.Helper()
	s := jointoken.Mint()
	tok.ID, tok.TenantID, tok.PoolID = s.ID, "root", f.pool
	if tok.Uses == 0 {
		tok.Uses = 1
	}
	if _, err := jointoken.Create(context.Background(), f.db, tok, s.Hash); err != nil {
		t.Fatal(err)
	}
	return s.Token
}

// seal seals token to pub the way bcd does.
func seal(t *testing.T, pub []byte, token string, csr []byte) (enc, sealed []byte) {
	t.Helper()
	pk, err := ecdh.X25519().NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	hpk, err := hpke.NewDHKEMPublicKey(pk)
	if err != nil {
		t.Fatal(err)
	}
	enc, s, err := hpke.NewSender(hpk, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte("bettercompute join v1"))
	if err != nil {
		t.Fatal(err)
	}
	if sealed, err = s.Seal(joinservice.SealAAD(csr), []byte(token)); err != nil {
		t.Fatal(err)
	}
	return enc, sealed
}

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func csrFor(t *testing.T, k crypto.Signer) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "node"}}, k)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// claims are a node's hardware claims with n H200 GPUs.
func claims(serial string, n int) *agentv1.HardwareClaims {
	c := &agentv1.HardwareClaims{Hostname: "gpu-" + serial, MachineId: "machine-" + serial, SystemSerial: serial}
	for i := range n {
		c.Gpus = append(c.Gpus, &agentv1.GPU{Index: uint32(i), Uuid: fmt.Sprintf("GPU-%s-%d", serial, i), Model: "NVIDIA H200"})
	}
	return c
}

// request is a well-formed join request for token from the hardware of
// serial, for key k.
func (f *harness) request(t *testing.T, token, serial string, k crypto.Signer) *agentv1.JoinRequest {
	t.Helper()
	csr := csrFor(t, k)
	enc, sealed := seal(t, f.key.PublicKey(), token, csr)
	return &agentv1.JoinRequest{SealedToken: sealed, EncapsulatedKey: enc, JoinserviceKeyId: f.key.ID(), Csr: csr, Claims: claims(serial, 8)}
}

func wantFault(t *testing.T, err error, code fault.Code, field string) {
	t.Helper()
	fe, ok := fault.As(err)
	if !ok || fe.Code != code || fe.Field != field {
		t.Fatalf("got %v, want %s on %q", err, code, field)
	}
}

func parseChain(t *testing.T, der [][]byte) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for _, b := range der {
		c, err := x509.ParseCertificate(b)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
	return out
}

func TestJoin(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	k := newKey(t)
	tok := f.token(t, jointoken.Token{Uses: 2, Labels: map[string]string{"rack": "r1"}})
	resp, err := f.svc.Join(ctx, f.request(t, tok, "SN1", k))
	if err != nil {
		t.Fatal(err)
	}

	t.Run("the node is adopting in its shard", func(t *testing.T) {
		n, err := nodes.Get(ctx, f.db, "root", resp.GetNodeId())
		if err != nil {
			t.Fatal(err)
		}
		if n.State != nodes.StateAdopting || n.Shard != shard.Of(n.ID) || n.PoolID != f.pool || n.Labels["rack"] != "r1" || n.Hostname != "gpu-SN1" {
			t.Fatalf("node %+v", n)
		}
		if n.HardwareKey != attest.HardwareKey(attest.Claims{SystemSerial: "SN1", GPUs: []attest.GPU{
			{UUID: "GPU-SN1-7"}, {UUID: "GPU-SN1-0"}, {UUID: "GPU-SN1-1"}, {UUID: "GPU-SN1-2"}, {UUID: "GPU-SN1-3"}, {UUID: "GPU-SN1-4"}, {UUID: "GPU-SN1-5"}, {UUID: "GPU-SN1-6"},
		}}) {
			t.Fatalf("hardware key %s", n.HardwareKey)
		}
		var left int
		if err := f.db.QueryRow(ctx, `SELECT uses_left FROM join_tokens`).Scan(&left); err != nil || left != 1 {
			t.Fatalf("uses left %d %v", left, err)
		}
		var projected int
		if err := f.db.QueryRow(ctx, `SELECT count(*) FROM authz_projection WHERE type = 'Node' AND id = $1 AND pool_id = $2 AND NOT draft`, n.ID, f.pool).Scan(&projected); err != nil || projected != 1 {
			t.Fatalf("projection %d %v", projected, err)
		}
	})

	t.Run("the certificate is a 24 h SVID for the node's key chaining to the CA", func(t *testing.T) {
		chain := parseChain(t, resp.GetCertificateChain())
		leaf := chain[0]
		want := "spiffe://" + trustDomain + "/node/" + resp.GetNodeId()
		if resp.GetSpiffeId() != want || len(leaf.URIs) != 1 || leaf.URIs[0].String() != want {
			t.Fatalf("SPIFFE id %q, URIs %v, want %s", resp.GetSpiffeId(), leaf.URIs, want)
		}
		if d := leaf.NotAfter.Sub(f.clock.Now()); d < 24*time.Hour-time.Second || d > 24*time.Hour {
			t.Fatalf("valid for %s more, want 24h", d)
		}
		if !leaf.PublicKey.(*ecdsa.PublicKey).Equal(k.Public()) {
			t.Fatal("certificate is not for the CSR's key")
		}
		roots := x509.NewCertPool()
		for _, b := range parseChain(t, resp.GetTrustBundle()) {
			roots.AddCert(b)
		}
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, CurrentTime: f.clock.Now()}); err != nil {
			t.Fatal(err)
		}
		id, err := f.ca.VerifyNode(ctx, f.db, chain)
		if err != nil || id != resp.GetNodeId() {
			t.Fatalf("VerifyNode %q %v", id, err)
		}
	})

	t.Run("a second join of the same hardware without reclaim is CONFLICT and spends nothing", func(t *testing.T) {
		_, err := f.svc.Join(ctx, f.request(t, tok, "SN1", newKey(t)))
		wantFault(t, err, fault.Conflict, "claims")
		var left int
		if err := f.db.QueryRow(ctx, `SELECT uses_left FROM join_tokens`).Scan(&left); err != nil || left != 1 {
			t.Fatalf("uses left %d %v", left, err)
		}
	})
}

func TestJoinRefusals(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	past := time.Now().Add(-time.Hour)

	good := f.token(t, jointoken.Token{Uses: 100})
	expired := f.token(t, jointoken.Token{ExpiresAt: &past})
	exhausted := f.token(t, jointoken.Token{})
	if _, err := f.svc.Join(ctx, f.request(t, exhausted, "SN-E", newKey(t))); err != nil {
		t.Fatal(err)
	}
	revoked := f.token(t, jointoken.Token{})
	id, _, _ := jointoken.Parse(revoked)
	if _, err := jointoken.Revoke(ctx, f.db, "root", id); err != nil {
		t.Fatal(err)
	}
	wrongSecret := good[:len(good)-4] + "aaaa"
	if wrongSecret == good {
		wrongSecret = good[:len(good)-4] + "bbbb"
	}
	otherKey, err := joinservice.NewKey()
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name   string
		token  string
		edit   func(*agentv1.JoinRequest)
		code   fault.Code
		field  string
		reason error
	}{
		{name: "unknown token", token: "bcjt_aaaaaaaaaaaaaaaa." + good[22:], code: fault.Unauthenticated, field: "sealedToken", reason: jointoken.ErrUnknown},
		{name: "wrong secret", token: wrongSecret, code: fault.Unauthenticated, field: "sealedToken", reason: jointoken.ErrUnknown},
		{name: "malformed token", token: "hello", code: fault.Unauthenticated, field: "sealedToken", reason: jointoken.ErrMalformed},
		{name: "expired token", token: expired, code: fault.Unauthenticated, field: "sealedToken", reason: jointoken.ErrExpired},
		{name: "exhausted token", token: exhausted, code: fault.Unauthenticated, field: "sealedToken", reason: jointoken.ErrExhausted},
		{name: "revoked token", token: revoked, code: fault.Unauthenticated, field: "sealedToken", reason: jointoken.ErrRevoked},
		{name: "token not sealed", token: good, edit: func(r *agentv1.JoinRequest) { r.SealedToken = []byte(good) }, code: fault.Unauthenticated, field: "sealedToken"},
		{name: "no sealed token", token: good, edit: func(r *agentv1.JoinRequest) { r.SealedToken = nil }, code: fault.InvalidInput, field: "sealedToken"},
		{name: "no encapsulated key", token: good, edit: func(r *agentv1.JoinRequest) { r.EncapsulatedKey = nil }, code: fault.InvalidInput, field: "encapsulatedKey"},
		{name: "token sealed to another key", token: good, edit: func(r *agentv1.JoinRequest) {
			r.EncapsulatedKey, r.SealedToken = seal(t, otherKey.PublicKey(), good, r.Csr)
		}, code: fault.Unauthenticated, field: "sealedToken"},
		{name: "token sealed to another key id", token: good, edit: func(r *agentv1.JoinRequest) {
			r.EncapsulatedKey, r.SealedToken = seal(t, otherKey.PublicKey(), good, r.Csr)
			r.JoinserviceKeyId = otherKey.ID()
		}, code: fault.InvalidInput, field: "joinserviceKeyId"},
		{name: "CSR with a bad signature", token: good, edit: func(r *agentv1.JoinRequest) {
			r.Csr[len(r.Csr)-3] ^= 0xff
			r.EncapsulatedKey, r.SealedToken = seal(t, f.key.PublicKey(), good, r.Csr)
		}, code: fault.InvalidInput, field: "csr"},
		{name: "CSR missing", token: good, edit: func(r *agentv1.JoinRequest) {
			r.Csr = nil
			r.EncapsulatedKey, r.SealedToken = seal(t, f.key.PublicKey(), good, r.Csr)
		}, code: fault.InvalidInput, field: "csr"},
		{name: "CSR swapped by a relaying gateway", token: good, edit: func(r *agentv1.JoinRequest) { r.Csr = csrFor(t, newKey(t)) }, code: fault.Unauthenticated, field: "sealedToken"},
		{name: "claims missing", token: good, edit: func(r *agentv1.JoinRequest) { r.Claims = nil }, code: fault.InvalidInput, field: "claims"},
		{name: "claims without a machine id", token: good, edit: func(r *agentv1.JoinRequest) { r.Claims.MachineId = "" }, code: fault.InvalidInput, field: "claims.machineId"},
		{name: "duplicate GPU UUIDs", token: good, edit: func(r *agentv1.JoinRequest) { r.Claims.Gpus[1].Uuid = r.Claims.Gpus[0].Uuid }, code: fault.InvalidInput, field: "claims.gpus"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := f.request(t, tc.token, "SN-R", newKey(t))
			if tc.edit != nil {
				tc.edit(req)
			}
			_, err := f.svc.Join(ctx, req)
			wantFault(t, err, tc.code, tc.field)
			if tc.reason != nil && !errors.Is(err, tc.reason) {
				t.Fatalf("%v is not %v", err, tc.reason)
			}
		})
	}

	t.Run("claims failing the token's expectations", func(t *testing.T) {
		for _, exp := range []attest.Expect{{GPUCount: 4}, {GPUModel: "B200"}, {SystemSerial: "OTHER"}} {
			tok := f.token(t, jointoken.Token{Expect: exp})
			_, err := f.svc.Join(ctx, f.request(t, tok, "SN-X", newKey(t)))
			wantFault(t, err, fault.AccessDenied, "claims")
		}
		tok := f.token(t, jointoken.Token{Expect: attest.Expect{GPUCount: 8, GPUModel: "h200", SystemSerial: "SN-X"}})
		if _, err := f.svc.Join(ctx, f.request(t, tok, "SN-X", newKey(t))); err != nil {
			t.Fatalf("claims meeting every expectation: %v", err)
		}
	})

	t.Run("refused joins leave no node behind", func(t *testing.T) {
		var n int
		if err := f.db.QueryRow(ctx, `SELECT count(*) FROM nodes`).Scan(&n); err != nil || n != 2 {
			t.Fatalf("%d nodes (%v), want the 2 good joins", n, err)
		}
	})
}

func TestConcurrentJoinsNeverOverspend(t *testing.T) {
	t.Parallel()
	f := setup(t)
	tok := f.token(t, jointoken.Token{Uses: 3})
	const n = 12
	reqs := make([]*agentv1.JoinRequest, n)
	for i := range reqs {
		reqs[i] = f.request(t, tok, fmt.Sprintf("SN-C%d", i), newKey(t))
	}
	var ok, exhausted atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for _, req := range reqs {
		wg.Go(func() {
			<-start
			_, err := f.svc.Join(context.Background(), req)
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, jointoken.ErrExhausted):
				exhausted.Add(1)
			default:
				t.Errorf("join: %v", err)
			}
		})
	}
	close(start)
	wg.Wait()
	if ok.Load() != 3 || exhausted.Load() != n-3 {
		t.Fatalf("%d joins succeeded and %d were refused as exhausted; want 3 and %d", ok.Load(), exhausted.Load(), n-3)
	}
	var nodesN, left int
	if err := f.db.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM nodes), (SELECT uses_left FROM join_tokens)`).Scan(&nodesN, &left); err != nil || nodesN != 3 || left != 0 {
		t.Fatalf("%d nodes, %d uses left (%v)", nodesN, left, err)
	}
}

func TestReclaim(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	first, err := f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-RC", newKey(t)))
	if err != nil {
		t.Fatal(err)
	}
	oldChain := parseChain(t, first.GetCertificateChain())

	// The server is reinstalled: a new machine id and key, same chassis and
	// GPUs; the operator's token names the node it may take back.
	tok := f.token(t, jointoken.Token{Reclaim: true, ReclaimNodeIDs: []string{first.GetNodeId()}, Labels: map[string]string{"gen": "2"}})
	req := f.request(t, tok, "SN-RC", newKey(t))
	req.Claims.MachineId = "reinstalled"
	second, err := f.svc.Join(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if second.GetNodeId() != first.GetNodeId() {
		t.Fatalf("reclaimed as %s, want %s", second.GetNodeId(), first.GetNodeId())
	}
	n, err := nodes.Get(ctx, f.db, "root", first.GetNodeId())
	if err != nil || n.State != nodes.StateAdopting || n.Labels["gen"] != "2" {
		t.Fatalf("node %+v %v", n, err)
	}
	if _, err := f.ca.VerifyNode(ctx, f.db, oldChain); !errors.Is(err, nodeca.ErrRevoked) {
		t.Fatalf("the old installation's certificate: %v, want revoked", err)
	}
	if _, err := f.ca.VerifyNode(ctx, f.db, parseChain(t, second.GetCertificateChain())); err != nil {
		t.Fatal(err)
	}
}

// TestReclaimNeedsATokenNamingTheNode: hardware claims are self-asserted
// (a node's serial and GPU UUIDs are readable through nodes.get), so a
// reclaim token that does not name the node cannot take it over — the join
// is CONFLICT and the real node keeps its certificate — and one that names
// it can.
func TestReclaimNeedsATokenNamingTheNode(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	victim, err := f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-VICTIM", newKey(t)))
	if err != nil {
		t.Fatal(err)
	}
	other, err := f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-OTHER", newKey(t)))
	if err != nil {
		t.Fatal(err)
	}
	// The attacker copies the victim's claims and holds a reclaim token for
	// some other node.
	_, err = f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{Reclaim: true, ReclaimNodeIDs: []string{other.GetNodeId()}}), "SN-VICTIM", newKey(t)))
	wantFault(t, err, fault.Conflict, "claims")
	if _, err := f.ca.VerifyNode(ctx, f.db, parseChain(t, victim.GetCertificateChain())); err != nil {
		t.Fatalf("the victim's certificate after the attempt: %v, want still valid", err)
	}
	got, err := f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{Reclaim: true, ReclaimNodeIDs: []string{victim.GetNodeId()}}), "SN-VICTIM", newKey(t)))
	if err != nil || got.GetNodeId() != victim.GetNodeId() {
		t.Fatalf("a token naming the node: %v %v, want node %s back", got.GetNodeId(), err, victim.GetNodeId())
	}
}

// TestAnotherTenantCannotBlockAJoinWithCopiedClaims: hardware keys were
// unique across tenants, so a tenant that joined first with another
// tenant's hardware claims blocked that tenant's real join. Now both join,
// each in its own tenant, and the collision is a node.hardware_conflict
// event in the root tenant for the operator.
func TestAnotherTenantCannotBlockAJoinWithCopiedClaims(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	fixture.Tenant(t, f.db, fixture.TenantOpts{ID: "mallory"})
	mp := fixture.Pool(t, f.db, fixture.PoolOpts{ID: "pool_m", Tenant: "mallory"})
	s := jointoken.Mint()
	if _, err := jointoken.Create(ctx, f.db, jointoken.Token{ID: s.ID, TenantID: "mallory", PoolID: mp.ID, Uses: 1}, s.Hash); err != nil {
		t.Fatal(err)
	}
	squatter, err := f.svc.Join(ctx, f.request(t, s.Token, "SN-REAL", newKey(t)))
	if err != nil {
		t.Fatal(err)
	}
	genuine, err := f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-REAL", newKey(t)))
	if err != nil {
		t.Fatalf("the real machine's join into its own tenant: %v, want it to succeed", err)
	}
	var tenant, payload string
	err = f.db.QueryRow(ctx, `SELECT tenant_id, payload::text FROM outbox WHERE type = 'node.hardware_conflict' AND resource_id = $1`, genuine.GetNodeId()).Scan(&tenant, &payload)
	if err != nil || tenant != "root" || !strings.Contains(payload, squatter.GetNodeId()) || !strings.Contains(payload, "mallory") {
		t.Fatalf("conflict event: tenant %q payload %s (%v)", tenant, payload, err)
	}
	// The same tenant joining the same hardware twice is still CONFLICT.
	_, err = f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-REAL", newKey(t)))
	wantFault(t, err, fault.Conflict, "claims")
}

func TestRenew(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	tok := f.token(t, jointoken.Token{Uses: 5})
	ka, kb := newKey(t), newKey(t)
	a, err := f.svc.Join(ctx, f.request(t, tok, "SN-A", ka))
	if err != nil {
		t.Fatal(err)
	}
	b, err := f.svc.Join(ctx, f.request(t, tok, "SN-B", kb))
	if err != nil {
		t.Fatal(err)
	}
	chainA, chainB := parseChain(t, a.GetCertificateChain()), parseChain(t, b.GetCertificateChain())

	t.Run("a valid certificate and a CSR for its key get a fresh 24 h certificate", func(t *testing.T) {
		f.clock.Advance(20 * time.Hour)
		resp, err := f.svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, ka)})
		if err != nil {
			t.Fatal(err)
		}
		leaf := parseChain(t, resp.GetCertificateChain())[0]
		if d := leaf.NotAfter.Sub(f.clock.Now()); d < 24*time.Hour-time.Second || d > 24*time.Hour {
			t.Fatalf("valid for %s more, want 24h", d)
		}
		if id, err := f.ca.VerifyNode(ctx, f.db, []*x509.Certificate{leaf}); err != nil || id != a.GetNodeId() {
			t.Fatalf("renewed certificate: %q %v", id, err)
		}
		chainA = parseChain(t, resp.GetCertificateChain())
	})

	t.Run("a CSR for another node's key is refused", func(t *testing.T) {
		_, err := f.svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, kb)})
		wantFault(t, err, fault.InvalidInput, "csr")
	})

	t.Run("a CSR with a bad signature is refused", func(t *testing.T) {
		csr := csrFor(t, ka)
		csr[len(csr)-3] ^= 0xff
		_, err := f.svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csr})
		wantFault(t, err, fault.InvalidInput, "csr")
	})

	t.Run("no certificate is refused", func(t *testing.T) {
		_, err := f.svc.Renew(ctx, nil, &agentv1.RenewRequest{Csr: csrFor(t, ka)})
		wantFault(t, err, fault.Unauthenticated, "certificate")
	})

	t.Run("a certificate from another CA is refused", func(t *testing.T) {
		other, err := nodeca.Open(nodeca.Config{TrustDomain: trustDomain, Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := f.db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		forged, err := other.IssueNode(ctx, tx, a.GetNodeId(), ka.Public())
		if err != nil {
			t.Fatal(err)
		}
		_ = tx.Rollback(ctx)
		_, err = f.svc.Renew(ctx, forged, &agentv1.RenewRequest{Csr: csrFor(t, ka)})
		wantFault(t, err, fault.Unauthenticated, "certificate")
	})

	t.Run("a revoked certificate is refused", func(t *testing.T) {
		if _, err := nodeca.RevokeNode(ctx, f.db, b.GetNodeId()); err != nil {
			t.Fatal(err)
		}
		_, err := f.svc.Renew(ctx, chainB, &agentv1.RenewRequest{Csr: csrFor(t, kb)})
		wantFault(t, err, fault.Unauthenticated, "certificate")
		if !errors.Is(err, nodeca.ErrRevoked) {
			t.Fatalf("%v is not ErrRevoked", err)
		}
	})

	t.Run("an expired certificate is refused", func(t *testing.T) {
		f.clock.Advance(25 * time.Hour)
		_, err := f.svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, ka)})
		wantFault(t, err, fault.Unauthenticated, "certificate")
	})
}

// TestServer runs Join and Renew over real gRPC with mutual TLS, as the
// gateway will serve them.
func TestServer(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	serving, err := f.ca.ServingCertificate("gw-1", []string{"127.0.0.1", "localhost"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{serving},
		ClientAuth:   tls.VerifyClientCertIfGiven,
		ClientCAs:    f.ca.Pool(),
		MinVersion:   tls.VersionTLS13,
	})))
	agentv1.RegisterNodeServiceServer(gs, joinservice.NewServer(f.svc))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)

	dial := func(t *testing.T, certs ...tls.Certificate) agentv1.NodeServiceClient {
		t.Helper()
		conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
			RootCAs: f.ca.Pool(), ServerName: "localhost", Certificates: certs, MinVersion: tls.VersionTLS13,
		})))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return agentv1.NewNodeServiceClient(conn)
	}

	k := newKey(t)
	joined, err := dial(t).Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-S", k))
	if err != nil {
		t.Fatal(err)
	}
	_, err = dial(t).Join(ctx, f.request(t, f.token(t, jointoken.Token{Expect: attest.Expect{GPUCount: 1}}), "SN-T", newKey(t)))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("join failing expectations: %v, want PermissionDenied", err)
	}

	cert := tls.Certificate{Certificate: joined.GetCertificateChain(), PrivateKey: k}
	renewed, err := dial(t, cert).Renew(ctx, &agentv1.RenewRequest{Csr: csrFor(t, k)})
	if err != nil || len(renewed.GetCertificateChain()) == 0 {
		t.Fatalf("renew over mTLS: %v", err)
	}
	if _, err := dial(t).Renew(ctx, &agentv1.RenewRequest{Csr: csrFor(t, k)}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("renew without a client certificate: %v, want Unauthenticated", err)
	}
	stream, err := dial(t, cert).Session(ctx)
	if err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.Unimplemented {
		t.Fatalf("Session: %v, want Unimplemented", err)
	}
}

func TestOpenFromConfiguration(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	dir := t.TempDir()
	js := config.JoinService{TrustDomain: trustDomain, KeyDir: dir}
	first, err := joinservice.Open(js, db, nil)
	if err != nil {
		t.Fatal(err)
	}
	again, err := joinservice.Open(js, db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if first.Key().ID() != again.Key().ID() || !first.CA().Certificate().Equal(again.CA().Certificate()) {
		t.Fatal("keys generated into keyDir must be reused")
	}
	// The files the dev directory holds serve as configured files too.
	files := config.JoinService{TrustDomain: trustDomain, CACertFile: dir + "/" + nodeca.DevFile, CAKeyFile: dir + "/" + nodeca.DevFile,
		HPKEKeyFile: dir + "/" + joinservice.DevKeyFile}
	fromFiles, err := joinservice.Open(files, db, nil)
	if err != nil || fromFiles.Key().ID() != first.Key().ID() {
		t.Fatalf("from files: %v", err)
	}
	_, err = joinservice.Open(config.JoinService{TrustDomain: trustDomain, CACertFile: dir + "/missing.pem", CAKeyFile: dir + "/missing.pem"}, db, nil)
	wantFault(t, err, fault.InvalidConfig, "joinService.caCertFile")
}
