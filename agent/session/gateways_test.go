package session_test

import (
	"net"
	"testing"
	"time"
)

// TestNodeMovesToALiveGateway: a node given two gateways holds a session
// on one; when that one dies (stopped as a killed process is), the node's
// next session opens on the other, under the same identity. A dead address
// in the list is passed over.
func TestNodeMovesToALiveGateway(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	twin := f.cp.Twin(t)
	// A third entry nobody listens on.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := lis.Addr().String()
	_ = lis.Close()
	f.cfg.Gateway = f.cp.Addr + "," + dead + "," + twin.Addr
	f.start(t)

	first, other := f.cp, twin
	select {
	case h := <-f.cp.Hellos:
		if h.GetNodeId() != f.id.NodeID {
			t.Fatalf("hello from %q", h.GetNodeId())
		}
	case h := <-twin.Hellos:
		if h.GetNodeId() != f.id.NodeID {
			t.Fatalf("hello from %q", h.GetNodeId())
		}
		first, other = twin, f.cp
	case <-time.After(wait):
		t.Fatal("no session on either gateway")
	}
	first.Stop()
	h := recv(t, other.Hellos, "hello on the surviving gateway")
	if h.GetNodeId() != f.id.NodeID {
		t.Fatalf("hello on the survivor from %q, want %q", h.GetNodeId(), f.id.NodeID)
	}
	// It holds its session there (the other entries are dead now).
	deadline := time.Now().Add(500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if other.OpenSessions() == 1 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Errorf("the survivor holds %d sessions, want 1", other.OpenSessions())
}
