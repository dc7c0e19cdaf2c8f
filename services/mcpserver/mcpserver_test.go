package mcpserver_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
	"github.com/bettercompute/bettercompute/services/mcpserver"
)

// simNodes is the size of the simulated fleet (8 mock H200s each).
const simNodes = 2

// startEnv starts a dev control plane (real PostgreSQL, embedded NATS) with
// a simulated fleet of simNodes in the root tenant's pool "sim" and returns
// it with a pool on its database.
func startEnv(t *testing.T) (*dev.Env, *pgxpool.Pool) {
	t.Helper()
	return startEnvRun(t, dev.RunOptions{})
}

// startEnvRun is startEnv with make run's additions (run.SimMig: node 0's
// GPU 0 gets a MIG layout).
func startEnvRun(t *testing.T, run dev.RunOptions) (*dev.Env, *pgxpool.Pool) {
	t.Helper()
	port, nodes, machines, vps := 0, simNodes, 0, false
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &nodes, SimMachines: &machines, SimInstances: &vps},
		Gateway: config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond),
			LivenessInterval: config.Duration(200 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
		Commands: config.Commands{SweepInterval: config.Duration(200 * time.Millisecond)},
		Capacity: config.Capacity{RollupEvery: config.Duration(300 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.StartRun(t.Context(), cfg, nil, run)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	db, err := pgxpool.New(context.Background(), env.Database)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return env, db
}

// bearer adds an Authorization header to every request.
type bearer struct {
	token string
	base  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.base.RoundTrip(r)
}

// connect opens an MCP session on endpoint as token, with the SDK's client.
func connect(t *testing.T, endpoint, token string) *mcp.ClientSession {
	t.Helper()
	cs, err := dial(t, endpoint, token)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func dial(t *testing.T, endpoint, token string) (*mcp.ClientSession, error) {
	c := mcp.NewClient(&mcp.Implementation{Name: "mcpserver-test", Version: "1"}, nil)
	cs, err := c.Connect(t.Context(), &mcp.StreamableClientTransport{
		Endpoint:   endpoint,
		HTTPClient: &http.Client{Transport: bearer{token: token, base: http.DefaultTransport}},
		MaxRetries: -1,
	}, nil)
	if err == nil {
		t.Cleanup(func() { _ = cs.Close() })
	}
	return cs, err
}

// call calls a tool that must succeed and decodes its structured answer.
func call[Out any](t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) Out {
	t.Helper()
	res, err := cs.CallTool(t.Context(), &mcp.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if res.IsError {
		t.Fatalf("%s(%v): tool error %s", name, args, text(res))
	}
	var out Out
	b, _ := json.Marshal(res.StructuredContent)
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("%s: %v: %s", name, err, b)
	}
	return out
}

// refused calls a tool that must answer a tool error and returns its text.
func refused(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) string {
	t.Helper()
	res, err := cs.CallTool(t.Context(), &mcp.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if !res.IsError {
		t.Fatalf("%s(%v) succeeded: %s", name, args, text(res))
	}
	return text(res)
}

func text(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

func toolNames(t *testing.T, cs *mcp.ClientSession) []string {
	t.Helper()
	res, err := cs.ListTools(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tool := range res.Tools {
		names = append(names, tool.Name)
	}
	slices.Sort(names)
	return names
}

// rest calls an API method over REST as token and decodes the answer.
func rest(t *testing.T, env *dev.Env, token, method string, body, out any) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, env.BaseURL()+"/api/compute/"+method, strings.NewReader(string(b)))
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", method, resp.StatusCode, raw)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s: %v: %s", method, err, raw)
		}
	}
}

// member makes an identity with an API key in tenant (made under root when
// new) and a policy that permits it everything in scope; it returns the
// identity's id and key.
func member(t *testing.T, env *dev.Env, tenant, name, scope string) (string, string) {
	t.Helper()
	if tenant != "root" {
		rest(t, env, env.Credential, "tenants/create", map[string]any{"tenantId": "root", "childTenantId": tenant}, nil)
	}
	var ident struct{ Identity struct{ ID string } }
	rest(t, env, env.Credential, "identities/create", map[string]any{"tenantId": tenant, "name": name}, &ident)
	var key struct{ Secret string }
	rest(t, env, env.Credential, "apiKeys/create", map[string]any{"tenantId": tenant, "identityId": ident.Identity.ID}, &key)
	rest(t, env, env.Credential, "policies/put", map[string]any{"tenantId": tenant, "name": name + "-all",
		"body": `permit (principal == Identity::"` + ident.Identity.ID + `", action, resource in Tenant::"` + scope + `");`}, nil)
	return ident.Identity.ID, key.Secret
}

// eventually is poll.Until at a pace that keeps the caller under its API
// rate limit (every tool call is an API call or more).
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, within, what, func() bool {
		if cond() {
			return true
		}
		time.Sleep(100 * time.Millisecond) // pacing under the rate limit, not an assertion
		return false
	})
}

func count(t *testing.T, db *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type nodesList struct {
	Nodes []struct {
		ID, TenantID, PoolID, State string
		Schedulable                 bool
		GPUs                        int
		Conditions                  []struct {
			Type   string
			Status bool
		}
	}
}

type command struct {
	ID, NodeID, Kind, State string
	Final                   bool
}

type reservation struct {
	ID, State string
	Bookings  []struct{ NodeID, DeviceID string }
	Nodes     []string
}

// TestMCP drives every tool with the SDK's own client over streamable HTTP
// against a real control plane and its simulated fleet.
func TestMCP(t *testing.T) {
	env, db := startEnv(t)
	endpoint := env.BaseURL() + mcpserver.Path
	root := connect(t, endpoint, env.Credential)

	// The fleet is adopted and bookable.
	var nodes nodesList
	eventually(t, 2*time.Minute, "the simulated nodes schedulable", func() bool {
		nodes = call[nodesList](t, root, "nodes_list", map[string]any{})
		ready := 0
		for _, n := range nodes.Nodes {
			if n.Schedulable {
				ready++
			}
		}
		return ready == simNodes
	})
	node, pool := nodes.Nodes[0].ID, nodes.Nodes[0].PoolID

	t.Run("ListsAllTenTools", func(t *testing.T) {
		want := slices.Concat(mcpserver.ReadTools, mcpserver.MutatingTools)
		slices.Sort(want)
		if got := toolNames(t, root); !slices.Equal(got, want) || len(got) != 10 {
			t.Fatalf("tools %v, want %v", got, want)
		}
	})

	t.Run("EveryInputFieldHasAMaximum", func(t *testing.T) {
		res, err := root.ListTools(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, tool := range res.Tools {
			b, _ := json.Marshal(tool.InputSchema)
			var s struct {
				Properties map[string]map[string]any
			}
			if err := json.Unmarshal(b, &s); err != nil {
				t.Fatal(err)
			}
			for name, p := range s.Properties {
				_, str := p["maxLength"]
				_, items := p["maxItems"]
				_, props := p["maxProperties"]
				_, hi := p["maximum"]
				if p["type"] != "boolean" && !str && !items && !props && !hi {
					t.Errorf("%s.%s has no maximum: %v", tool.Name, name, p)
				}
			}
		}
	})

	t.Run("NodesListSeesTheSimNodes", func(t *testing.T) {
		if len(nodes.Nodes) != simNodes {
			t.Fatalf("nodes %+v", nodes.Nodes)
		}
		for _, n := range nodes.Nodes {
			ready := slices.ContainsFunc(n.Conditions, func(c struct {
				Type   string
				Status bool
			}) bool {
				return c.Type == "Ready" && c.Status
			})
			if n.TenantID != "root" || n.GPUs != 8 || !ready {
				t.Fatalf("node %+v", n)
			}
		}
		got := call[struct {
			Node     struct{ ID string }
			GPUs     []struct{ ID, Model string }
			Sections []struct{ Section string }
		}](t, root, "nodes_get", map[string]any{"nodeId": node})
		if got.Node.ID != node || len(got.GPUs) != 8 || got.GPUs[0].Model == "" || len(got.Sections) == 0 {
			t.Fatalf("nodes_get %+v", got)
		}
	})

	t.Run("CommandRunsAndSettles", func(t *testing.T) {
		run := call[struct {
			Destructive bool
			Command     *command
		}](t, root, "commands_run", map[string]any{"nodeId": node, "kind": "inventory.refresh", "idempotencyKey": "mcp-refresh"})
		if run.Destructive || run.Command == nil || run.Command.ID == "" || run.Command.Kind != "inventory.refresh" {
			t.Fatalf("commands_run %+v", run)
		}
		var got struct{ Command command }
		eventually(t, time.Minute, "inventory.refresh settled", func() bool {
			got = call[struct{ Command command }](t, root, "commands_get", map[string]any{"nodeId": node, "commandId": run.Command.ID})
			return got.Command.Final
		})
		if got.Command.State != "succeeded" {
			t.Fatalf("inventory.refresh ended %+v", got.Command)
		}
		// Its events are in the log.
		eventually(t, time.Minute, "the command's events listed", func() bool {
			ev := call[struct {
				Events []struct{ Type, Subject string }
			}](t, root, "events_list", map[string]any{"subject": run.Command.ID})
			return slices.ContainsFunc(ev.Events, func(e struct{ Type, Subject string }) bool { return e.Type == "command.requested" })
		})
	})

	t.Run("DestructiveCommandNeedsConfirmAndDryRunQueuesNothing", func(t *testing.T) {
		before := count(t, db, `SELECT count(*) FROM commands WHERE node_id = $1`, node)
		msg := refused(t, root, "commands_run", map[string]any{"nodeId": node, "kind": "node.reboot"})
		if !strings.Contains(msg, "confirm") || !strings.Contains(msg, "destructive") {
			t.Fatalf("refusal %q", msg)
		}
		dry := call[struct {
			DryRun, Destructive bool
			NodeID, Kind        string
			Command             *command
		}](t, root, "commands_run", map[string]any{"nodeId": node, "kind": "node.reboot", "dryRun": true})
		if !dry.DryRun || !dry.Destructive || dry.NodeID != node || dry.Kind != "node.reboot" || dry.Command != nil {
			t.Fatalf("dry run %+v", dry)
		}
		if n := count(t, db, `SELECT count(*) FROM commands WHERE node_id = $1`, node); n != before {
			t.Fatalf("a refused call and a dry run queued %d commands", n-before)
		}
	})

	t.Run("BadInputNamesTheField", func(t *testing.T) {
		for _, tc := range []struct {
			tool  string
			args  map[string]any
			field string
		}{
			{"nodes_get", map[string]any{"nodeId": strings.Repeat("n", 200)}, "nodeId"},
			{"nodes_get", map[string]any{}, "nodeId"},
			{"commands_run", map[string]any{"nodeId": node, "kind": "shell"}, "kind"},
			{"commands_run", map[string]any{"nodeId": node, "kind": "diag.nvml", "notAfterSeconds": 5}, "notAfterSeconds"},
			{"events_list", map[string]any{"types": make([]string, 40)}, "types"},
			{"reservations_create", map[string]any{"poolId": pool, "gpuCount": 1, "startTime": "tomorrow"}, "startTime"},
			{"nodes_list", map[string]any{"command": "rm -rf /"}, "command"},
		} {
			msg := refused(t, root, tc.tool, tc.args)
			t.Logf("%s: %s", tc.tool, msg)
			if !strings.Contains(msg, tc.field) {
				t.Errorf("%s(%v): %q does not name %s", tc.tool, tc.args, msg, tc.field)
			}
		}
	})

	t.Run("Reservations", func(t *testing.T) {
		before := count(t, db, `SELECT count(*) FROM reservations`)
		type capacity struct{ Total struct{ Free, Booked int32 } }
		eventually(t, time.Minute, "capacity_get counts the fleet", func() bool {
			return call[capacity](t, root, "capacity_get", map[string]any{"poolId": pool}).Total.Free == 8*simNodes
		})
		dry := call[struct {
			DryRun          bool
			Requested, Free int32
			Fits            bool
			Reservation     *reservation
		}](t, root, "reservations_create", map[string]any{"poolId": pool, "gpuCount": 2, "dryRun": true})
		if !dry.DryRun || dry.Requested != 2 || dry.Free != 8*simNodes || !dry.Fits || dry.Reservation != nil {
			t.Fatalf("dry run %+v", dry)
		}
		tooMany := call[struct{ Fits bool }](t, root, "reservations_create", map[string]any{"poolId": pool, "gpuCount": 100, "dryRun": true})
		if tooMany.Fits {
			t.Fatal("100 GPUs fit a pool of 16")
		}
		if n := count(t, db, `SELECT count(*) FROM reservations`); n != before {
			t.Fatalf("dry runs made %d reservations", n-before)
		}

		made := call[struct{ Reservation *reservation }](t, root, "reservations_create", map[string]any{"poolId": pool, "gpuCount": 2, "idempotencyKey": "mcp-r1"})
		if made.Reservation == nil || made.Reservation.ID == "" || len(made.Reservation.Bookings) != 2 {
			t.Fatalf("create %+v", made.Reservation)
		}
		id := made.Reservation.ID
		got := call[struct{ Reservation reservation }](t, root, "reservations_get", map[string]any{"reservationId": id})
		if got.Reservation.ID != id || len(got.Reservation.Bookings) != 2 {
			t.Fatalf("get %+v", got)
		}
		eventually(t, time.Minute, "capacity_get counts the booking", func() bool {
			c := call[capacity](t, root, "capacity_get", map[string]any{"poolId": pool})
			return c.Total.Booked == 2 && c.Total.Free == 8*simNodes-2
		})

		rel := call[struct {
			DryRun      bool
			Reservation reservation
			FreedGPUs   []struct{ NodeID, DeviceID string }
			FreedNodes  []string
		}](t, root, "reservations_release", map[string]any{"reservationId": id, "dryRun": true})
		if !rel.DryRun || len(rel.FreedGPUs) != 2 || len(rel.FreedNodes) == 0 {
			t.Fatalf("release dry run %+v", rel)
		}
		if n := count(t, db, `SELECT count(*) FROM reservations WHERE id = $1 AND state IN ('placed', 'bound')`, id); n != 1 {
			t.Fatal("a dry run released the reservation")
		}
		done := call[struct{ Reservation reservation }](t, root, "reservations_release", map[string]any{"reservationId": id})
		if done.Reservation.State != "released" {
			t.Fatalf("release %+v", done)
		}
	})

	t.Run("AnotherTenantSeesNone", func(t *testing.T) {
		_, acmeKey := member(t, env, "acme", "acme-ops", "acme")
		acme := connect(t, endpoint, acmeKey)
		if got := call[nodesList](t, acme, "nodes_list", map[string]any{}); len(got.Nodes) != 0 {
			t.Fatalf("acme sees %+v", got.Nodes)
		}
		if msg := refused(t, acme, "nodes_list", map[string]any{"tenantId": "root"}); !strings.Contains(msg, "ACCESS_DENIED") {
			t.Fatalf("acme listing root's nodes: %q", msg)
		}
		if msg := refused(t, acme, "nodes_get", map[string]any{"nodeId": node}); !strings.Contains(msg, "NOT_FOUND") {
			t.Fatalf("acme getting root's node: %q", msg)
		}
		before := count(t, db, `SELECT count(*) FROM nodes WHERE state = 'adopted'`)
		if msg := refused(t, acme, "nodes_drain", map[string]any{"tenantId": "root", "nodeId": node, "confirm": true}); !strings.Contains(msg, "ACCESS_DENIED") {
			t.Fatalf("acme draining root's node: %q", msg)
		}
		if n := count(t, db, `SELECT count(*) FROM nodes WHERE state = 'adopted'`); n != before {
			t.Fatal("acme's refused drain changed a node")
		}
	})

	t.Run("AuditNamesTheCaller", func(t *testing.T) {
		opID, opKey := member(t, env, "root", "mcp-operator", "root")
		op := connect(t, endpoint, opKey)
		run := call[struct{ Command *command }](t, op, "commands_run", map[string]any{"nodeId": node, "kind": "diag.nvml"})
		if run.Command == nil {
			t.Fatal("no command")
		}
		if n := count(t, db, `SELECT count(*) FROM commands WHERE id = $1 AND created_by = $2`, run.Command.ID, opID); n != 1 {
			t.Fatalf("the command is not created by %s", opID)
		}
		if n := count(t, db, `SELECT count(*) FROM audit WHERE actor = $1 AND action = 'compute:nodes:exec' AND decision = 'allow'`, opID); n != 1 {
			t.Fatalf("audit rows naming %s: %d, want 1", opID, n)
		}
		var rootID string
		if err := db.QueryRow(context.Background(), `SELECT identity_id FROM api_keys WHERE id = $1`,
			strings.TrimPrefix(strings.Split(env.Credential, ".")[0], "bck_")).Scan(&rootID); err != nil {
			t.Fatal(err)
		}
		if rootID == opID || count(t, db, `SELECT count(*) FROM audit WHERE actor = $1 AND detail->>'commandId' = $2`, rootID, run.Command.ID) != 0 {
			t.Fatal("the operator's command is audited as the root credential")
		}
	})

	t.Run("Unauthenticated", func(t *testing.T) {
		init := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}`
		for _, auth := range []string{"", "Basic abc", "Bearer bck_nope.nope"} {
			code, hdr, body := post(t, endpoint, auth, "", init)
			var env client.Envelope
			_ = json.Unmarshal(body, &env)
			if code != http.StatusUnauthorized || env.Code != client.CodeUnauthenticated || env.Field != "Authorization" ||
				env.Message == "" || !strings.HasPrefix(hdr.Get("WWW-Authenticate"), "Bearer") {
				t.Fatalf("Authorization %q: %d %v %s", auth, code, hdr, body)
			}
		}
		if _, err := dial(t, endpoint, "bck_nope.nope"); err == nil {
			t.Fatal("the SDK client connected with an invalid key")
		}
	})

	t.Run("NoSessionIsKept", func(t *testing.T) {
		// The transport is stateless: initialize names no session, a
		// request naming one is answered on its own, and there is no
		// session to end or to listen on.
		init := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}`
		code, hdr, body := post(t, endpoint, "Bearer "+env.Credential, "", init)
		if code != http.StatusOK || hdr.Get("Mcp-Session-Id") != "" {
			t.Fatalf("initialize: %d %v %s", code, hdr, body)
		}
		list := `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"nodes_list","arguments":{}}}`
		if code, _, body := post(t, endpoint, "Bearer "+env.Credential, "", list); code != http.StatusOK || !strings.Contains(string(body), "nodes") {
			t.Fatalf("a tool call without a session: %d %s", code, body)
		}
		if code := deleteSession(t, endpoint, env.Credential, "whatever"); code != http.StatusMethodNotAllowed {
			t.Fatalf("DELETE of a session: %d, want 405", code)
		}
	})

	t.Run("RequestsAreRateLimitedPerIdentity", func(t *testing.T) {
		// Requests that call no tool (initialize, tools/list) never reach
		// the API's per-identity rate, so the MCP server keeps its own.
		conn, err := client.New(env.BaseURL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		srv := httptest.NewServer(mcpserver.Handler(mcpserver.Config{Conn: conn, Version: "test", RatePerSecond: 0.001, RateBurst: 3}))
		t.Cleanup(srv.Close)
		init := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}`
		for i := range 3 {
			if code, _, body := post(t, srv.URL, "Bearer "+env.Credential, "", init); code != http.StatusOK {
				t.Fatalf("initialize %d: %d %s", i, code, body)
			}
		}
		code, _, body := post(t, srv.URL, "Bearer "+env.Credential, "", init)
		var e client.Envelope
		_ = json.Unmarshal(body, &e)
		if code != http.StatusTooManyRequests || e.Code != client.CodeRateLimited {
			t.Fatalf("the 4th request in the burst: %d %s, want 429 RATE_LIMITED", code, body)
		}
		// Another identity has its own budget.
		_, other := member(t, env, "rate", "rate-ops", "rate")
		if code, _, body := post(t, srv.URL, "Bearer "+other, "", init); code != http.StatusOK {
			t.Fatalf("another identity: %d %s", code, body)
		}
	})

	t.Run("ReadOnlyOffersOnlyReadTools", func(t *testing.T) {
		conn, err := client.New(env.BaseURL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		srv := httptest.NewServer(mcpserver.Handler(mcpserver.Config{Conn: conn, ReadOnly: true, Version: "test"}))
		t.Cleanup(srv.Close) // after the session's close (cleanups run last first)
		ro := connect(t, srv.URL, env.Credential)
		want := slices.Clone(mcpserver.ReadTools)
		slices.Sort(want)
		if got := toolNames(t, ro); !slices.Equal(got, want) {
			t.Fatalf("read-only tools %v, want %v", got, want)
		}
		if got := call[nodesList](t, ro, "nodes_list", map[string]any{}); len(got.Nodes) != simNodes {
			t.Fatalf("read-only nodes_list %+v", got)
		}
		if res, err := ro.CallTool(t.Context(), &mcp.CallToolParams{Name: "nodes_drain", Arguments: map[string]any{"nodeId": node, "confirm": true}}); err == nil && !res.IsError {
			t.Fatal("a read-only server drained a node")
		}
		if n := count(t, db, `SELECT count(*) FROM nodes WHERE id = $1 AND state = 'adopted'`, node); n != 1 {
			t.Fatal("the read-only server changed the node")
		}
	})

	// Last: it takes a node out of service.
	t.Run("DrainNeedsConfirmAndDryRunChangesNothing", func(t *testing.T) {
		made := call[struct{ Reservation *reservation }](t, root, "reservations_create", map[string]any{"poolId": pool, "gpuCount": 1, "idempotencyKey": "mcp-r2"})
		if made.Reservation == nil || len(made.Reservation.Bookings) != 1 {
			t.Fatalf("create %+v", made.Reservation)
		}
		target := made.Reservation.Bookings[0].NodeID
		state := func() string {
			var s string
			if err := db.QueryRow(context.Background(), `SELECT state FROM nodes WHERE id = $1`, target).Scan(&s); err != nil {
				t.Fatal(err)
			}
			return s
		}
		before := state()

		dry := call[struct {
			DryRun       bool
			Node         struct{ ID string }
			GPUs         []struct{ ID string }
			Reservations []reservation
		}](t, root, "nodes_drain", map[string]any{"nodeId": target, "dryRun": true})
		if !dry.DryRun || dry.Node.ID != target || len(dry.GPUs) != 8 ||
			!slices.ContainsFunc(dry.Reservations, func(r reservation) bool { return r.ID == made.Reservation.ID }) {
			t.Fatalf("dry run %+v", dry)
		}
		msg := refused(t, root, "nodes_drain", map[string]any{"nodeId": target})
		if !strings.Contains(msg, "confirm") {
			t.Fatalf("refusal %q", msg)
		}
		if s := state(); s != before {
			t.Fatalf("a dry run and a refused drain moved the node from %s to %s", before, s)
		}
		done := call[struct{ Node struct{ ID, State string } }](t, root, "nodes_drain", map[string]any{"nodeId": target, "confirm": true, "reason": "mcp test"})
		if done.Node.ID != target || (done.Node.State != "draining" && done.Node.State != "drained") {
			t.Fatalf("drain %+v", done)
		}
		if s := state(); s != "draining" && s != "drained" {
			t.Fatalf("node state %s after the drain", s)
		}
	})
}

// deleteSession ends an MCP session as token.
func deleteSession(t *testing.T, endpoint, token, session string) int {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodDelete, endpoint, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Mcp-Session-Id", session)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// post sends one raw JSON-RPC message to the MCP endpoint.
func post(t *testing.T, endpoint, authorization, session, body string) (int, http.Header, []byte) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, endpoint, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	if session != "" {
		req.Header.Set("Mcp-Session-Id", session)
		req.Header.Set("Mcp-Protocol-Version", "2025-06-18")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, raw
}

func TestMain(m *testing.M) { pgtest.Main(m) }
