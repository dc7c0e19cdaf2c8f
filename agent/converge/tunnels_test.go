package converge_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/bettercompute/bettercompute/agent/converge"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

func TestTunnels_AllowlistAppliedPersistedAndInvalidAllowsNothing(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ctx := context.Background()
	if err := c.AllowsTunnel("127.0.0.1:2222"); err == nil {
		t.Fatal("an empty section allowed a target")
	}
	allow := &agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32", PortMin: 1024, PortMax: 65535}}}
	ss, obs := c.Converge(ctx, &agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Tunnels: allow}})
	if obs != 1 || states(ss)["tunnels"].GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("observed %d: %v", obs, states(ss)["tunnels"])
	}
	if err := c.AllowsTunnel("127.0.0.1:2222"); err != nil {
		t.Errorf("allowed target refused: %v", err)
	}
	if err := c.AllowsTunnel("127.0.0.1:22"); err == nil {
		t.Error("a port outside the range was allowed")
	}
	if _, err := os.Stat(filepath.Join(root, converge.TunnelsFile)); err != nil {
		t.Fatal(err)
	}
	// A restarted daemon loads the applied allowlist.
	c2 := newConverger(t, root)
	if err := c2.AllowsTunnel("127.0.0.1:2222"); err != nil {
		t.Errorf("after restart: %v", err)
	}

	// An invalid section is terminal and allows nothing, not the old list.
	bad := &agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32"}}}
	ss, _ = c.Converge(ctx, &agentv1.DesiredState{Generation: 2, Spec: &agentv1.NodeSpec{Tunnels: bad}})
	if s := states(ss)["tunnels"]; s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL {
		t.Errorf("invalid section: %v", s)
	}
	if err := c.AllowsTunnel("127.0.0.1:2222"); err == nil {
		t.Error("an invalid section left the old allowlist in force")
	}
	if _, err := os.Stat(filepath.Join(root, converge.TunnelsFile)); !os.IsNotExist(err) {
		t.Errorf("the file stayed: %v", err)
	}
}
