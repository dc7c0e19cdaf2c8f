package gateway_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// admissionFixture is a gateway that admits one session a second, a burst
// of burst, each waiting up to wait.
func admissionFixture(t *testing.T, burst int, wait time.Duration) *harness {
	t.Helper()
	_, key, _ := ed25519.GenerateKey(rand.Reader)
	f := &harness{ca: newCA(t), db: pgtest.New(t), joiner: &joiner{}, revoked: map[string]bool{}, signer: commands.NewSigner(key)}
	f.tune = func(c *gateway.Config) { c.AdmitRate, c.AdmitBurst, c.AdmitWait = 1, burst, wait }
	f.gw, f.addr = f.serve(t, "gw-1")
	return f
}

// TestReconnectStormIsAdmittedAtTheGatewaysRate: with a burst of 2 and one
// session a second, three nodes dialling at once get two sessions; the
// third, which would wait longer than admitWait, is refused
// RESOURCE_EXHAUSTED with a retry delay around the wait it would have had,
// and nothing of it reached the database (its session epoch did not move).
func TestReconnectStormIsAdmittedAtTheGatewaysRate(t *testing.T) {
	t.Parallel()
	f := admissionFixture(t, 2, 100*time.Millisecond)
	for i := range 3 {
		f.addNode(t, fmt.Sprintf("node_%d", i))
	}
	for i := range 2 {
		id := fmt.Sprintf("node_%d", i)
		cert := f.ca.node(t, id)
		open(t, f.client(t, f.addr, &cert), id)
	}
	cert := f.ca.node(t, "node_2")
	stream, err := f.client(t, f.addr, &cert).Session(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// The refusal may come before the Hello is read: Send then sees the
	// ended stream (EOF) and Recv says why.
	if err := stream.Send(hello("node_2")); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	_, err = stream.Recv()
	st, _ := status.FromError(err)
	if st.Code() != codes.ResourceExhausted {
		t.Fatalf("third session: %v, want RESOURCE_EXHAUSTED", err)
	}
	var delay time.Duration
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			delay = ri.GetRetryDelay().AsDuration()
		}
	}
	// The bucket refills in a second: the jittered delay is [0.5, 1.5) of
	// the wait the session would have had (at most a second).
	if delay <= 0 || delay > 1500*time.Millisecond {
		t.Fatalf("retry delay %s, want (0, 1.5s]", delay)
	}
	var epoch int64
	if err := f.db.QueryRow(t.Context(), `SELECT session_epoch FROM nodes WHERE id = 'node_2'`).Scan(&epoch); err != nil || epoch != 0 {
		t.Fatalf("refused node's session epoch %d (%v), want 0: a refused session touches nothing", epoch, err)
	}
}

// TestASessionWaitsForItsTurn: with a burst of 1 and a wait long enough, a
// second session dialled at once waits for the bucket and is welcomed.
func TestASessionWaitsForItsTurn(t *testing.T) {
	t.Parallel()
	f := admissionFixture(t, 1, 5*time.Second)
	for i := range 2 {
		f.addNode(t, fmt.Sprintf("node_%d", i))
	}
	start := time.Now()
	for i := range 2 {
		id := fmt.Sprintf("node_%d", i)
		cert := f.ca.node(t, id)
		if _, w := open(t, f.client(t, f.addr, &cert), id); w.GetSessionEpoch() != 1 {
			t.Fatalf("%s welcomed at epoch %d", id, w.GetSessionEpoch())
		}
	}
	// Not a timing assertion on speed: the second session cannot have
	// been admitted before the bucket held a token again.
	if waited := time.Since(start); waited < 500*time.Millisecond {
		t.Fatalf("both sessions opened in %s at one a second with a burst of 1", waited)
	}
}
