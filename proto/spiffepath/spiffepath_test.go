package spiffepath_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/proto/spiffepath"
)

func TestNode(t *testing.T) {
	t.Parallel()
	if p := spiffepath.Node("node_1"); p != "/node/node_1" {
		t.Fatalf("Node = %q", p)
	}
	for path, want := range map[string]string{"/node/node_1": "node_1", "/node/": "", "/node/a/b": "", "/gateway/gw": "", "node/x": ""} {
		if got, ok := spiffepath.NodeID(path); got != want || ok != (want != "") {
			t.Errorf("NodeID(%q) = %q, %v; want %q", path, got, ok, want)
		}
	}
}

func TestSiteAgent(t *testing.T) {
	t.Parallel()
	p := spiffepath.SiteAgent("site_1", "sag_1")
	if p != "/site/site_1/agent/sag_1" {
		t.Fatalf("SiteAgent = %q", p)
	}
	if s, a, ok := spiffepath.SiteAgentIDs(p); !ok || s != "site_1" || a != "sag_1" {
		t.Fatalf("SiteAgentIDs(%q) = %q, %q, %v", p, s, a, ok)
	}
	for _, bad := range []string{"/site//agent/a", "/site/s/agent/", "/site/s/node/a", "/site/s/agent/a/b", "/node/n", "/site/s"} {
		if s, a, ok := spiffepath.SiteAgentIDs(bad); ok {
			t.Errorf("SiteAgentIDs(%q) = %q, %q, true", bad, s, a)
		}
	}
}
