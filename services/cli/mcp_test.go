package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/cli/serve"
	"github.com/bettercompute/bettercompute/services/dev"
	"github.com/bettercompute/bettercompute/services/mcpserver"
)

// syncBuffer is a bytes.Buffer safe for the command's goroutine and the
// test's.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// stdioMCP runs `better-compute mcp args…` in process with its stdin and
// stdout on pipes, and connects the SDK's client to them. Closing the
// session ends the command; the returned func waits for it and returns its
// exit code.
func stdioMCP(t *testing.T, args ...string) (*mcp.ClientSession, func() int, *syncBuffer) {
	t.Helper()
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	stderr := &syncBuffer{}
	root := cli.NewRoot(outW, stderr)
	root.SetIn(inR)
	root.SetArgs(append([]string{"mcp"}, args...))
	code := make(chan int, 1)
	go func() {
		c := serve.Report(stderr, root.ExecuteContext(context.Background()))
		_ = outW.Close()
		_ = inR.Close()
		code <- c
	}()
	c := mcp.NewClient(&mcp.Implementation{Name: "cli-test", Version: "1"}, nil)
	cs, err := c.Connect(t.Context(), &mcp.IOTransport{Reader: outR, Writer: inW}, nil)
	if err != nil {
		_ = inW.Close()
		t.Fatalf("connect: %v (stderr: %s)", err, stderr)
	}
	wait := func() int {
		_ = cs.Close()
		return <-code
	}
	return cs, wait, stderr
}

// TestMCPStdio runs `better-compute mcp` against a real control plane with
// a simulated node, lists its tools and calls nodes_list as the root key.
func TestMCPStdio(t *testing.T) {
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("BETTER_COMPUTE_CONFIG", "")
	t.Setenv("BETTER_COMPUTE_TOKEN", "")
	port, nodes, machines, vps := 0, 1, 0, false
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &nodes, SimMachines: &machines, SimInstances: &vps},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond), LivenessInterval: config.Duration(200 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop(context.Background())
	t.Setenv("BETTER_COMPUTE_URL", env.BaseURL())

	cs, wait, stderr := stdioMCP(t, "--token", env.Credential)
	res, err := cs.ListTools(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tool := range res.Tools {
		names = append(names, tool.Name)
	}
	want := slices.Concat(mcpserver.ReadTools, mcpserver.MutatingTools)
	slices.Sort(names)
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Fatalf("tools %v, want %v", names, want)
	}
	var listed struct {
		Nodes []struct{ ID, TenantID string }
	}
	poll.Until(t, 2*time.Minute, "nodes_list sees the simulated node", func() bool {
		r, err := cs.CallTool(t.Context(), &mcp.CallToolParams{Name: "nodes_list", Arguments: map[string]any{}})
		if err != nil || r.IsError {
			t.Fatalf("nodes_list: %v %+v", err, r)
		}
		b, _ := json.Marshal(r.StructuredContent)
		if err := json.Unmarshal(b, &listed); err != nil {
			t.Fatal(err)
		}
		return len(listed.Nodes) == 1
	})
	if !strings.HasPrefix(listed.Nodes[0].ID, "node") || listed.Nodes[0].TenantID != "root" {
		t.Fatalf("nodes_list %+v", listed)
	}
	// A destructive tool is refused without confirm over stdio as well.
	r, err := cs.CallTool(t.Context(), &mcp.CallToolParams{Name: "nodes_drain", Arguments: map[string]any{"nodeId": listed.Nodes[0].ID}})
	if err != nil || !r.IsError {
		t.Fatalf("nodes_drain without confirm: %v %+v", err, r)
	}
	if code := wait(); code != serve.ExitOK {
		t.Fatalf("better-compute mcp exited %d: %s", code, stderr)
	}
	if !strings.Contains(stderr.String(), "serving on stdio as") {
		t.Fatalf("stderr %q", stderr)
	}

	// --read-only offers only the read tools.
	ro, wait, stderr := stdioMCP(t, "--token", env.Credential, "--read-only")
	res, err = ro.ListTools(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	names = names[:0]
	for _, tool := range res.Tools {
		names = append(names, tool.Name)
	}
	slices.Sort(names)
	want = slices.Clone(mcpserver.ReadTools)
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Fatalf("read-only tools %v, want %v", names, want)
	}
	if code := wait(); code != serve.ExitOK {
		t.Fatalf("better-compute mcp --read-only exited %d: %s", code, stderr)
	}

	// A key the API does not accept fails at start, naming the problem.
	code, _, errOut := run(t, "mcp", "--token", "bck_nope.nope")
	if code != serve.ExitError || !strings.Contains(errOut, "UNAUTHENTICATED") {
		t.Fatalf("bad key: exit %d, %q", code, errOut)
	}
}

// TestMCPCommandNeedsAToken refuses to start without an API key.
func TestMCPCommandNeedsAToken(t *testing.T) {
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("BETTER_COMPUTE_CONFIG", "")
	t.Setenv("BETTER_COMPUTE_TOKEN", "")
	code, _, errOut := run(t, "mcp", "--url", "http://127.0.0.1:1")
	if code != serve.ExitConfig || !strings.Contains(errOut, "client.token") || !strings.Contains(errOut, "--token") {
		t.Fatalf("exit %d, %q", code, errOut)
	}
}
