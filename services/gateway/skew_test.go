package gateway_test

import (
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestSkewWindowRefusesAgentsOutside: with gateway.agentVersions set, a
// Hello from a bcd older than the oldest is refused AGENT_TOO_OLD, newer
// than the newest AGENT_TOO_NEW (FAILED_PRECONDITION with the code and the
// field hello.agent_version as ErrorInfo), a version that is not a release
// AGENT_TOO_OLD, before any session opens; one inside is welcomed.
func TestSkewWindowRefusesAgentsOutside(t *testing.T) {
	t.Parallel()
	f := &harness{ca: newCA(t), db: pgtest.New(t), joiner: &joiner{}, revoked: map[string]bool{},
		tune: func(c *gateway.Config) { c.OldestAgent, c.NewestAgent = "v0.3.0", "v0.4.0" }}
	_, addr := f.serve(t, "gw-skew")
	f.addNode(t, "node_s")
	cert := f.ca.node(t, "node_s")
	c := f.client(t, addr, &cert)

	session := func(version string) error {
		stream, err := c.Session(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Hello{Hello: &agentv1.Hello{
			NodeId: "node_s", BootId: "boot-1", JournalId: "journal-1", AgentVersion: version}}}); err != nil {
			t.Fatal(err)
		}
		m, err := stream.Recv()
		if err == nil && m.GetWelcome() == nil {
			t.Fatalf("%s: first message %v", version, m)
		}
		return err
	}
	for version, want := range map[string]fault.Code{
		"v0.2.9": fault.AgentTooOld, "v0.3.0-rc.1": fault.AgentTooOld, "dev": fault.AgentTooOld,
		"v0.4.1": fault.AgentTooNew, "v1.0.0": fault.AgentTooNew,
	} {
		err := session(version)
		st, _ := status.FromError(err)
		var info *errdetails.ErrorInfo
		for _, d := range st.Details() {
			if i, ok := d.(*errdetails.ErrorInfo); ok {
				info = i
			}
		}
		if st.Code() != codes.FailedPrecondition || info == nil || info.GetReason() != string(want) || info.GetMetadata()["field"] != "hello.agent_version" {
			t.Errorf("%s: %v (%v), want %s", version, err, info, want)
		}
	}
	var gw string
	if err := f.db.QueryRow(t.Context(), `SELECT coalesce(gateway_id, '') FROM nodes WHERE id = 'node_s'`).Scan(&gw); err != nil {
		t.Fatal(err)
	}
	if gw != "" {
		t.Fatalf("a refused agent opened a session: gateway %q", gw)
	}
	for _, version := range []string{"v0.3.0", "v0.3.7", "v0.4.0", "v0.4.0+build.9"} {
		if err := session(version); err != nil {
			t.Errorf("%s: %v, want a Welcome", version, err)
		}
	}
}
