package joinservice_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// logBuffer is a slog handler's output, safe for concurrent writes.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Security review 13 #11: the gateway was handed the raw Service, so a
// refused Join reached the (unauthenticated) caller as codes.Unknown with
// the error's text. Through NewJoiner, what the gateway is handed, a
// refusal has its code.
func TestJoinMalformedRequestGetsItsCodeNotUnknown(t *testing.T) {
	t.Parallel()
	f := setup(t)
	j := joinservice.NewJoiner(f.svc)
	ctx := context.Background()

	_, err := j.Join(ctx, &agentv1.JoinRequest{})
	if env := api.FromStatus(status.Convert(err)); status.Code(err) != codes.InvalidArgument || env.Code != fault.InvalidInput || env.Field != "sealedToken" {
		t.Fatalf("empty Join: %v (%+v), want InvalidArgument, INVALID_INPUT on sealedToken", err, env)
	}
	req := f.request(t, f.token(t, jointoken.Token{}), "SN-M", newKey(t))
	req.SealedToken[3] ^= 0xff
	if _, err := j.Join(ctx, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("tampered token: %v, want Unauthenticated", err)
	}
	_, err = j.Join(ctx, f.request(t, f.token(t, jointoken.Token{Expect: attest.Expect{GPUCount: 1}}), "SN-E", newKey(t)))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("join failing expectations: %v, want PermissionDenied", err)
	}
	if _, err := j.Renew(ctx, nil, &agentv1.RenewRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("Renew without a certificate: %v, want Unauthenticated", err)
	}
}

// An internal failure (here the database pool closed under joinservice)
// is INTERNAL or UNAVAILABLE with a generic message: the raw error is
// logged, never returned.
func TestJoinWithTheDatabaseGoneGetsAGenericError(t *testing.T) {
	t.Parallel()
	f := setup(t)
	closed, err := pgxpool.New(context.Background(), f.db.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	var logs logBuffer
	svc, err := joinservice.New(joinservice.Config{DB: closed, CA: f.ca, Key: f.key, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	_, err = joinservice.NewJoiner(svc).Join(context.Background(), f.request(t, f.token(t, jointoken.Token{}), "SN-D", newKey(t)))
	st, _ := status.FromError(err)
	if st.Code() != codes.Internal && st.Code() != codes.Unavailable {
		t.Fatalf("Join with the pool closed: %v, want Internal or Unavailable", err)
	}
	if strings.Contains(st.Message(), "closed") || strings.Contains(st.Message(), "pool") || strings.Contains(st.Message(), "tx") {
		t.Fatalf("the caller sees the raw error: %q", st.Message())
	}
	if !strings.Contains(logs.String(), "closed pool") || !strings.Contains(logs.String(), "method=Join") {
		t.Fatalf("the raw error is not logged: %s", logs.String())
	}
}

// Security review 13 #17: Renew had no limit per node, and each one
// writes a certificate row. A node is issued one certificate per
// RenewInterval; a second Renew within it is RATE_LIMITED
// (ResourceExhausted), other nodes unaffected.
func TestRenewFloodIsRateLimited(t *testing.T) {
	t.Parallel()
	f := setup(t)
	svc, err := joinservice.New(joinservice.Config{DB: f.db, CA: f.ca, Key: f.key, Now: f.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tok := f.token(t, jointoken.Token{Uses: 2})
	ka, kb := newKey(t), newKey(t)
	a, err := svc.Join(ctx, f.request(t, tok, "SN-RA", ka))
	if err != nil {
		t.Fatal(err)
	}
	b, err := svc.Join(ctx, f.request(t, tok, "SN-RB", kb))
	if err != nil {
		t.Fatal(err)
	}
	chainA, chainB := parseChain(t, a.GetCertificateChain()), parseChain(t, b.GetCertificateChain())
	certs := func() int {
		var n int
		if err := f.db.QueryRow(ctx, `SELECT count(*) FROM node_certificates`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	if _, err := svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, ka)}); err != nil {
		t.Fatal(err)
	}
	before := certs()
	j := joinservice.NewJoiner(svc)
	for range 50 {
		_, err := svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, ka)})
		wantFault(t, err, fault.RateLimited, "")
	}
	if _, err := j.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, ka)}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("mapped: %v, want ResourceExhausted", err)
	}
	if n := certs(); n != before {
		t.Fatalf("refused renewals wrote %d certificate rows", n-before)
	}
	if _, err := svc.Renew(ctx, chainB, &agentv1.RenewRequest{Csr: csrFor(t, kb)}); err != nil {
		t.Fatalf("another node: %v", err)
	}
	f.clock.Advance(joinservice.DefaultRenewInterval + time.Second)
	if _, err := svc.Renew(ctx, chainA, &agentv1.RenewRequest{Csr: csrFor(t, ka)}); err != nil {
		t.Fatalf("after the interval: %v", err)
	}
}
