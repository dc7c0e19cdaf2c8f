package bcd_test

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/bcd"
)

func TestMain_Commands(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args     []string
		code     int
		out, err string
	}{
		{[]string{"version"}, 0, "bcd ", ""},
		{[]string{"site"}, 2, "", "expected join or run"},
		{[]string{"site", "join", "--gateway", "x:1"}, 2, "", "--token and --gateway are required"},
		{[]string{"site", "run"}, 2, "", "--gateway is required"},
		{[]string{"site", "run", "--gateway", "x:1", "--lease-ttl", "1h"}, 2, "", "--lease-ttl"},
		{[]string{"site", "run", "--gateway", "x:1", "--root", "/nonexistent-bcd-site", "--boot-ip", "fe80::1"}, 2, "", "--boot-ip"},
		{[]string{"site", "bogus"}, 2, "", `unknown command "bogus"`},
		{[]string{"ramdisk", "--cmdline", "/dev/null"}, 2, "", "--token and --gateway are required"},
		{[]string{"ramdisk", "--cmdline", "/nonexistent/cmdline"}, 1, "", "kernel command line"},
		{[]string{"node"}, 2, "", "--gateway is required"},
		{[]string{"join", "--gateway", "x:1"}, 2, "", "--token and --gateway are required"},
		{[]string{"node", "--bogus"}, 2, "", "flag provided but not defined"},
		{[]string{"node", "--gateway", "x:1", "--log-level", "loud"}, 2, "", "--log-level"},
		{[]string{"node", "--gateway", "x:1", "--site-root", ""}, 2, "", "--site-root"},
		{[]string{"node", "--gateway", "x:1", "--telemetry-interval", "10ms"}, 2, "", "--telemetry-interval"},
		{[]string{"join", "-h"}, 0, "", "-joinservice-key"},
		{[]string{"bogus"}, 2, "", `unknown command "bogus"`},
		{nil, 0, "usage: bcd", ""},
	}
	for _, tc := range cases {
		var out, errb bytes.Buffer
		if code := bcd.Main(tc.args, &out, &errb); code != tc.code {
			t.Errorf("%v: exit %d, want %d", tc.args, code, tc.code)
		}
		if !strings.Contains(out.String(), tc.out) || !strings.Contains(errb.String(), tc.err) {
			t.Errorf("%v: stdout %q stderr %q", tc.args, out.String(), errb.String())
		}
	}
}

// TestDependencies guards the agent's dependency list: the daemon runs on
// every node and never links the database driver or control-plane code.
func TestDependencies(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/bettercompute/bettercompute/agent/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	forbidden := []string{
		"github.com/jackc/",
		"github.com/bettercompute/bettercompute/pkg",
		"github.com/bettercompute/bettercompute/services",
		"github.com/pressly/goose",
		"github.com/nats-io/nats-server",
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, f := range forbidden {
			if strings.HasPrefix(dep, f) {
				t.Errorf("the agent depends on %s", dep)
			}
		}
	}
}
