// Package console_test drives the console in a real browser (Debian's
// chromium through chromedp) against a real control plane: dev with a
// simulated fleet on real PostgreSQL and an embedded NATS server.
package console_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// TestMain is the package's (the console's HTTP tests share it): the shared
// PostgreSQL stops when the tests end, and leaked goroutines (a browser
// connection, a server) fail the run.
func TestMain(m *testing.M) { pgtest.Main(m) }

// Bounds of the browser steps: one action (a navigation, a click, a
// script), and a wait for something the page should show.
const (
	stepTimeout = 30 * time.Second
	waitTimeout = 60 * time.Second
)

// site is a running dev control plane with a simulated fleet in the root
// tenant's pool "sim".
type site struct {
	env   *dev.Env
	base  string
	pool  string
	nodes []string
}

// startSite starts dev with n simulated nodes and short liveness settings
// (Unknown 2 s after the last heartbeat; Lost only after two minutes, so a
// node stopped for a test is never written off) and the capacity rollup
// every 200 ms, and waits until every node is adopted, Ready and has its
// eight GPUs, and the pool's rollup counts them free.
func startSite(t *testing.T, n int) *site {
	t.Helper()
	return startSiteRun(t, n, dev.RunOptions{})
}

// startSiteRun is startSite with make run's additions: run.SimMig lays out
// GPU 0 of the first node (MIG), which is then not counted free whole.
func startSiteRun(t *testing.T, n int, run dev.RunOptions) *site {
	t.Helper()
	port, none, off := 0, 0, false
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		NATS:     config.NATS{URL: natstest.New(t).URL()},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &n, SimMachines: &none, SimInstances: &off},
		Gateway: config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(100 * time.Millisecond),
			LivenessInterval: config.Duration(100 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
		Capacity: config.Capacity{RollupEvery: config.Duration(200 * time.Millisecond)},
		Nodes: config.Nodes{NotReadyAfter: config.Duration(2 * time.Second), LostAfter: config.Duration(2 * time.Minute),
			LivenessEvery: config.Duration(100 * time.Millisecond)},
	}
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	env, err := dev.StartRun(t.Context(), cfg, nil, run)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	if env.Fleet == nil || len(env.Fleet.Nodes()) != n {
		t.Fatalf("dev started no simulated fleet of %d", n)
	}
	s := &site{env: env, base: env.BaseURL(), nodes: env.Fleet.Nodes()}
	var pools struct{ Pools []struct{ ID, Name string } }
	s.call(t, s.env.Credential, "pools/list", map[string]any{"tenantId": "root"}, &pools)
	for _, p := range pools.Pools {
		if p.Name == "sim" {
			s.pool = p.ID
		}
	}
	if s.pool == "" {
		t.Fatalf("no pool sim in %+v", pools.Pools)
	}
	for _, id := range s.nodes {
		s.waitNode(t, id)
	}
	whole := 8 * n
	if run.SimMig {
		whole-- // GPU 0 of the first node is in MIG mode: its slices are the atoms
	}
	s.waitCapacity(t, whole, 0)
	return s
}

// waitCapacity waits until capacity.get counts free and booked GPUs in the
// pool.
func (s *site) waitCapacity(t testing.TB, free, booked int) {
	t.Helper()
	poll.UntilNil(t, waitTimeout, fmt.Sprintf("pool %s to count %d GPUs free and %d booked", s.pool, free, booked), func() error {
		var out struct{ Total struct{ Free, Booked int } }
		s.call(t, s.env.Credential, "capacity/get", map[string]any{"tenantId": "root", "poolId": s.pool}, &out)
		if out.Total.Free != free || out.Total.Booked != booked {
			return fmt.Errorf("it counts %+v", out.Total)
		}
		return nil
	})
}

// call posts body to an API method with key and decodes the answer.
func (s *site) call(t testing.TB, key, method string, body, out any) {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.base+"/api/compute/"+method, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", method, resp.StatusCode, raw)
	}
	if err := json.Unmarshal(raw, out); err != nil {
		t.Fatalf("%s: %v: %s", method, err, raw)
	}
}

// ready reads node id's Ready condition value (True, False, Unknown, Lost)
// and its lifecycle state through nodes.get.
func (s *site) ready(t testing.TB, id string) (ready, state string, gpus int) {
	t.Helper()
	var out struct {
		Node struct {
			State      string
			Devices    []struct{ ID string }
			Conditions []struct{ Type, Value string }
		}
	}
	s.call(t, s.env.Credential, "nodes/get", map[string]any{"tenantId": "root", "nodeId": id}, &out)
	for _, c := range out.Node.Conditions {
		if c.Type == "Ready" {
			ready = c.Value
		}
	}
	return ready, out.Node.State, len(out.Node.Devices)
}

// waitNode waits until node id is adopted and Ready with its GPUs.
func (s *site) waitNode(t testing.TB, id string) {
	t.Helper()
	poll.UntilNil(t, waitTimeout, "node "+id+" to be adopted and Ready", func() error {
		if ready, state, gpus := s.ready(t, id); ready != "True" || state != "adopted" || gpus != 8 {
			return fmt.Errorf("it is Ready=%s, %s with %d GPUs", ready, state, gpus)
		}
		return nil
	})
}

// member makes tenant (a child of root), an identity in it, an API key for
// the identity and a policy that lets the tenant's members do anything in
// the tenant, all through the API as root; it returns the key.
func (s *site) member(t testing.TB, tenant, name string) string {
	t.Helper()
	root := s.env.Credential
	var ignore map[string]any
	s.call(t, root, "tenants/create", map[string]any{"tenantId": "root", "childTenantId": tenant}, &ignore)
	var ident struct{ Identity struct{ ID string } }
	s.call(t, root, "identities/create", map[string]any{"tenantId": tenant, "name": name}, &ident)
	var key struct{ Secret string }
	s.call(t, root, "apiKeys/create", map[string]any{"tenantId": tenant, "identityId": ident.Identity.ID, "name": name}, &key)
	s.call(t, root, "policies/put", map[string]any{"tenantId": tenant, "name": "members",
		"body": fmt.Sprintf(`permit (principal in Tenant::%q, action, resource in Tenant::%q);`, tenant, tenant)}, &ignore)
	if key.Secret == "" {
		t.Fatalf("apiKeys.create returned no secret for %s", name)
	}
	return key.Secret
}

// esProbe runs before every document's own scripts: it records each
// EventSource the page opens, so a test can wait until the live feed is
// connected before it makes the change it expects the page to show.
const esProbe = `(() => {
	const Real = window.EventSource;
	if (!Real || window.__bcEventSources) return;
	window.__bcEventSources = [];
	const Probe = function (url, init) {
		const es = new Real(url, init);
		window.__bcEventSources.push(es);
		return es;
	};
	Probe.prototype = Real.prototype;
	Probe.CONNECTING = 0; Probe.OPEN = 1; Probe.CLOSED = 2;
	window.EventSource = Probe;
})()`

// browser starts a headless chromium for t, its window 1280x800, with
// [esProbe] in its first tab, and stops it (killing the process) when t
// ends. It skips t when chromium is not installed.
func browser(t *testing.T) context.Context {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err != nil {
		t.Skip("chromium is not installed (the browser tests drive Debian's chromium, which CI installs: apt-get install chromium)")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1280, 800),
	)
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(allocCtx)
	t.Cleanup(func() {
		cancel()      // closes the browser
		cancelAlloc() // kills the process if it is still there and removes its profile
	})
	if err := first(ctx, cancel); err != nil {
		t.Fatalf("start chromium (%s): %v", path, err)
	}
	return ctx
}

// first runs the first action of a chromedp context, which starts its
// browser or opens its tab: that must run on the context itself (the browser
// or tab lives as long as the context of its first Run), so it is bounded by
// cancelling the context when [stepTimeout] passes first.
func first(ctx context.Context, cancel context.CancelFunc) error {
	timer := time.AfterFunc(stepTimeout, cancel)
	defer timer.Stop()
	return chromedp.Do(ctx, probe())
}

// tab opens a new tab in a fresh browser context (its own cookies) of the
// browser of ctx, closed when t ends.
func tab(ctx context.Context, t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := chromedp.NewContext(ctx, chromedp.WithNewBrowserContext())
	t.Cleanup(cancel)
	if err := first(ctx, cancel); err != nil {
		t.Fatalf("open a tab: %v", err)
	}
	return ctx
}

// probe installs [esProbe] in the tab.
func probe() chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		_, err := cdp.Call(ctx, t, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: esProbe})
		return err
	})
}

// do runs the steps in ctx's tab, bounded by [stepTimeout], and fails t
// with what the page showed when one fails.
func do(ctx context.Context, t *testing.T, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	if err := chromedp.Do(sctx, steps...); err != nil {
		t.Fatalf("browser: %v%s", err, shown(ctx))
	}
}

// eval evaluates a script in ctx's tab, bounded by [stepTimeout].
func eval[T any](ctx context.Context, script string) (T, error) {
	sctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	return chromedp.Run(sctx, chromedp.Evaluate[T](script))
}

// js evaluates a script and fails t when it throws.
func js[T any](ctx context.Context, t *testing.T, script string) T {
	t.Helper()
	v, err := eval[T](ctx, script)
	if err != nil {
		t.Fatalf("script %s: %v%s", script, err, shown(ctx))
	}
	return v
}

// waitFor polls a script in ctx's tab until it returns "" (the condition
// holds) or [waitTimeout] passes; what it returns otherwise says why the
// condition does not hold yet. A script that fails (a page between two
// documents) counts as not yet. On timeout it fails t with the page.
func waitFor(ctx context.Context, t *testing.T, what, script string) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	var last string
	poll.Until(t, 2*waitTimeout, what, func() bool {
		why, err := eval[string](ctx, script)
		switch {
		case err == nil && why == "":
			return true
		case err != nil:
			last = err.Error()
		default:
			last = why
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s: %s%s", waitTimeout, what, last, shown(ctx))
		}
		return false
	})
}

// shown describes what ctx's tab shows: its URL and the start of its text.
func shown(ctx context.Context) string {
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := chromedp.Run(sctx, chromedp.Evaluate[string](`location.href + "\n" + (document.body ? document.body.innerText.slice(0, 3000) : "(no body)")`))
	if err != nil {
		return "\n(the page could not be read: " + err.Error() + ")"
	}
	return "\nthe page: " + s
}

// quote makes s a JavaScript string literal.
func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// navigate loads a console path in ctx's tab and waits for its document.
func navigate(ctx context.Context, t *testing.T, base, path string) {
	t.Helper()
	do(ctx, t, chromedp.Navigate(base+path))
}

// waitPath waits until ctx's tab shows a document at a path for which
// match (a JavaScript expression on the string p) holds, with the console's
// nav bar loaded.
func waitPath(ctx context.Context, t *testing.T, what, match string) string {
	t.Helper()
	waitFor(ctx, t, what, `(() => {
		const p = location.pathname;
		if (!(`+match+`)) return "the page is at " + location.href;
		if (document.readyState !== "complete") return "the page is loading";
		return "";
	})()`)
	return js[string](ctx, t, `location.pathname`)
}

// signIn signs in through the login form with key and waits for the fleet
// page.
func signIn(ctx context.Context, t *testing.T, base, key string) {
	t.Helper()
	navigate(ctx, t, base, "/console/login")
	waitFor(ctx, t, "the login form", `document.querySelector('form#login[method="post"] input[name="key"][type="password"]') ? "" : "no login form"`)
	do(ctx, t,
		chromedp.SendKeys(chromedp.CSS(`form#login input[name="key"]`), key),
		chromedp.Click(chromedp.CSS(`form#login button[type="submit"]`)),
	)
	waitPath(ctx, t, "the fleet page after signing in", `p === "/console/"`)
	waitFor(ctx, t, "the signed-in identity", `(document.querySelector("#whoami")?.textContent || "").trim() ? "" : "no #whoami"`)
}

// liveFeed waits until the page's EventSource on /console/events/stream is
// open.
func liveFeed(ctx context.Context, t *testing.T) {
	t.Helper()
	waitFor(ctx, t, "the page's live feed", `(() => {
		const all = window.__bcEventSources || [];
		const feed = all.filter(es => new URL(es.url, location.href).pathname === "/console/events/stream");
		if (!feed.length) return "no EventSource on /console/events/stream (opened: " + all.map(es => es.url).join(", ") + ")";
		return feed.some(es => es.readyState === 1) ? "" : "the feed is not open (readyState " + feed.map(es => es.readyState).join(",") + ")";
	})()`)
}

// mark sets a marker on the page's window; [marked] says whether it is
// still there, that is, the page was not reloaded.
func mark(ctx context.Context, t *testing.T) string {
	t.Helper()
	m := fmt.Sprintf("marker-%d", time.Now().UnixNano())
	js[string](ctx, t, `window.__bcMarker = `+quote(m))
	return m
}

func marked(ctx context.Context, t *testing.T, m string) {
	t.Helper()
	if got := js[string](ctx, t, `String(window.__bcMarker)`); got != m {
		t.Fatalf("the page was reloaded (marker %q, want %q)", got, m)
	}
}

type tile struct {
	ID, Ready, State, Href string
}

// tiles reads the fleet page's node tiles.
func tiles(ctx context.Context, t *testing.T) []tile {
	t.Helper()
	raw := js[string](ctx, t, `JSON.stringify([...document.querySelectorAll("#tiles a.tile")].map(a => ({
		ID: a.dataset.nodeId || "", Ready: a.dataset.ready || "", State: a.dataset.state || "", Href: a.getAttribute("href") || ""})))`)
	var out []tile
	if err := json.Unmarshal([]byte(raw), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// tileReady is a script for [waitFor]: "" once node id's tile has a
// data-ready for which cond (on the string r) holds.
func tileReady(id, cond string) string {
	return `(() => {
		const a = document.querySelector('#tiles a.tile[data-node-id=' + ` + quote(quote(id)) + ` + ']');
		if (!a) return "no tile for " + ` + quote(id) + `;
		const r = a.dataset.ready;
		return (` + cond + `) ? "" : "its data-ready is " + r;
	})()`
}

// TestBrowserConsole drives the console in chromium against dev with three
// simulated nodes: signing in, the fleet, a command, a reservation, the
// isolation of tenants and the live fleet as a node's agent stops.
func TestBrowserConsole(t *testing.T) {
	t.Parallel()
	ctx := browser(t)
	s := startSite(t, 3)

	t.Run("a bad key is refused on the login form", func(t *testing.T) {
		ctx := tab(ctx, t)
		navigate(ctx, t, s.base, "/console/nodes/"+s.nodes[0])
		waitPath(ctx, t, "the redirect to the login page", `p === "/console/login"`)
		do(ctx, t,
			chromedp.SendKeys(chromedp.CSS(`form#login input[name="key"]`), "bck_nope.not-a-key"),
			chromedp.Click(chromedp.CSS(`form#login button[type="submit"]`)),
		)
		waitFor(ctx, t, "the login error", `(document.querySelector("#login-error")?.textContent || "").trim() ? "" : "no #login-error"`)
		if p := js[string](ctx, t, `location.pathname`); p != "/console/login" {
			t.Fatalf("a bad key left the login page for %s", p)
		}
	})

	t.Run("root signs in and sees a tile per simulated node", func(t *testing.T) {
		signIn(ctx, t, s.base, s.env.Credential)
		if who := js[string](ctx, t, `document.querySelector("#whoami").textContent`); !strings.Contains(who, "root") {
			t.Fatalf("#whoami shows %q, not the root identity", who)
		}
		links := js[[]string](ctx, t, `[...document.querySelectorAll("nav#nav a")].map(a => a.getAttribute("href"))`)
		for _, want := range []string{"/console/", "/console/reservations", "/console/commands", "/console/events", "/console/audit"} {
			if !slices.Contains(links, want) {
				t.Errorf("the nav bar has no link to %s: %v", want, links)
			}
		}
		if !js[bool](ctx, t, `!!document.querySelector("section#fleet-summary")`) {
			t.Error("no #fleet-summary on the fleet page")
		}
		cells := js[[]string](ctx, t, `(() => {
			const r = document.querySelector('table#pools tr[data-pool-id=`+quote(s.pool)+`]');
			return r ? [".gpus-free", ".gpus-booked", ".gpus-quarantined"].map(c => (r.querySelector(c)?.textContent || "").trim()) : [];
		})()`)
		if want := []string{fmt.Sprint(8 * len(s.nodes)), "0", "0"}; !slices.Equal(cells, want) {
			t.Errorf("pool %s's row in #pools shows free, booked, quarantined %q; want %q", s.pool, cells, want)
		}
		got := tiles(ctx, t)
		if len(got) != len(s.nodes) {
			t.Fatalf("%d tiles for %d nodes: %+v", len(got), len(s.nodes), got)
		}
		for _, id := range s.nodes {
			i := slices.IndexFunc(got, func(x tile) bool { return x.ID == id })
			if i < 0 {
				t.Fatalf("no tile for node %s: %+v", id, got)
			}
			if g := got[i]; g.Ready != "True" || g.Href != "/console/nodes/"+id || g.State == "" {
				t.Errorf("node %s's tile: %+v", id, g)
			}
		}
	})

	t.Run("a command runs from the node page and its page follows it live", func(t *testing.T) {
		id := s.nodes[1]
		navigate(ctx, t, s.base, "/console/nodes/"+id)
		waitFor(ctx, t, "the node page", `(document.querySelector("#node-ready")?.textContent || "").trim() === "True" ? "" : "#node-ready is not True"`)
		for _, sel := range []string{"table#conditions", "div#generation", "table#devices", "table#node-commands", "ul#node-events"} {
			if !js[bool](ctx, t, `!!document.querySelector(`+quote(sel)+`)`) {
				t.Errorf("no %s on the node page", sel)
			}
		}
		// The kinds offered are exactly the API's allowlist.
		var allowed []string
		for _, k := range commands.Builtin().Kinds() {
			if k.API {
				allowed = append(allowed, k.Name)
			}
		}
		offered := js[[]string](ctx, t, `[...document.querySelectorAll('form#run-command[method="post"] select[name="kind"] option')].map(o => o.value).filter(v => v)`)
		slices.Sort(allowed)
		slices.Sort(offered)
		if !slices.Equal(offered, allowed) {
			t.Errorf("the form offers kinds %v; the API allows %v", offered, allowed)
		}
		if why := js[string](ctx, t, `(() => {
			const s = document.querySelector('form#run-command select[name="kind"]');
			if (!s) return "no kind select";
			if (![...s.options].some(o => o.value === "inventory.refresh")) return "no inventory.refresh option";
			s.value = "inventory.refresh";
			s.dispatchEvent(new Event("change", {bubbles: true}));
			return "";
		})()`); why != "" {
			t.Fatal(why)
		}
		if action := js[string](ctx, t, `new URL(document.querySelector("form#run-command").action).pathname`); action != "/console/nodes/"+id+"/commands" {
			t.Errorf("#run-command posts to %s", action)
		}

		do(ctx, t, chromedp.Click(chromedp.CSS(`#run-command-submit`)))
		waitFor(ctx, t, "the confirmation dialog", `document.querySelector("dialog#confirm-dialog")?.open ? "" : "#confirm-dialog is not open"`)
		if text := js[string](ctx, t, `document.querySelector("dialog#confirm-dialog").textContent`); !strings.Contains(text, id) {
			t.Fatalf("the confirmation does not name node %s: %q", id, text)
		}
		if p := js[string](ctx, t, `location.pathname`); p != "/console/nodes/"+id {
			t.Fatalf("the form was submitted before it was confirmed: the page is at %s", p)
		}
		// The node's agent stops before the command is confirmed, so the
		// command page opens on a command that cannot have run yet, and
		// must follow it live once the agent is back.
		s.env.Fleet.Halt(1)
		resumed := false
		defer func() {
			if !resumed {
				s.env.Fleet.Resume(1)
			}
		}()
		do(ctx, t, chromedp.Click(chromedp.CSS(`dialog#confirm-dialog #confirm-yes`)))
		path := waitPath(ctx, t, "the command page", `p.startsWith("/console/commands/") && p.length > "/console/commands/".length`)
		cmdID := strings.TrimPrefix(path, "/console/commands/")
		var got struct {
			Command struct{ Kind, NodeID, State string }
		}
		s.call(t, s.env.Credential, "commands/get", map[string]any{"tenantId": "root", "nodeId": id, "commandId": cmdID}, &got)
		if got.Command.Kind != "inventory.refresh" || got.Command.NodeID != id {
			t.Fatalf("the console queued %+v", got.Command)
		}
		waitFor(ctx, t, "#command-state", `(document.querySelector("span#command-state")?.textContent || "").trim() ? "" : "no #command-state"`)
		st := strings.TrimSpace(js[string](ctx, t, `document.querySelector("#command-state").textContent`))
		if isTerminal(st) {
			t.Fatalf("a command for a stopped agent shows %s", st)
		}
		t.Logf("command %s opens %s", cmdID, st)
		liveFeed(ctx, t)
		m := mark(ctx, t)
		s.env.Fleet.Resume(1)
		resumed = true
		waitFor(ctx, t, "#command-state to be SUCCEEDED", `(() => {
			const st = document.querySelector("#command-state").textContent.trim();
			return st === "SUCCEEDED" ? "" : "it is " + st;
		})()`)
		marked(ctx, t, m)
		s.waitNode(t, id)
	})

	t.Run("a reservation is created, placed and released", func(t *testing.T) {
		navigate(ctx, t, s.base, "/console/reservations")
		waitFor(ctx, t, "the reservation form", `document.querySelector('form#create-reservation[method="post"]') ? "" : "no #create-reservation"`)
		before := js[[]string](ctx, t, `[...document.querySelectorAll("tr[data-reservation-id]")].map(r => r.dataset.reservationId)`)
		if why := js[string](ctx, t, `(() => {
			const f = document.querySelector("form#create-reservation");
			const set = (name, value, label) => {
				const el = f.querySelector('[name="' + name + '"]');
				if (!el) return "no " + name + " input";
				if (el.tagName === "SELECT") {
					const o = [...el.options].find(o => o.value === value || o.textContent.includes(label));
					if (!o) return "no option for " + value + " in " + name;
					el.value = o.value;
				} else {
					el.value = value;
				}
				el.dispatchEvent(new Event("change", {bubbles: true}));
				return "";
			};
			const name = f.querySelector('[name="name"]');
			if (name) name.value = "browser-test";
			return set("pool", `+quote(s.pool)+`, "sim") || set("gpus", "2", "2");
		})()`); why != "" {
			t.Fatal(why)
		}
		do(ctx, t, chromedp.Click(chromedp.CSS(`form#create-reservation :is(button[type="submit"], input[type="submit"], button:not([type]))`)))
		// Creating may ask for confirmation too; it lands back on the list.
		waitFor(ctx, t, "the new reservation in the list", `(() => {
			const d = document.querySelector("dialog#confirm-dialog");
			if (d && d.open) { document.querySelector("#confirm-yes").click(); return "confirming"; }
			if (location.pathname !== "/console/reservations") return "the page is at " + location.href;
			const before = `+mustJSON(before)+`;
			const rows = [...document.querySelectorAll("tr[data-reservation-id]")].filter(r => !before.includes(r.dataset.reservationId));
			return rows.length === 1 ? "" : rows.length + " new rows";
		})()`)
		rsv := js[string](ctx, t, `[...document.querySelectorAll("tr[data-reservation-id]")].map(r => r.dataset.reservationId).find(id => !`+mustJSON(before)+`.includes(id))`)
		if bad := js[string](ctx, t, `document.querySelector("#error")?.textContent || ""`); bad != "" {
			t.Fatalf("creating the reservation shows an error: %s", bad)
		}

		// It is placed by the API; the list shows where once it is bound
		// (the list is not live: read it again until then).
		var placed struct {
			Reservation struct {
				State    string
				Bookings []struct{ NodeID, DeviceID string }
			}
		}
		poll.UntilNil(t, waitTimeout, "reservation "+rsv+" to be bound", func() error {
			s.call(t, s.env.Credential, "reservations/get", map[string]any{"tenantId": "root", "reservationId": rsv}, &placed)
			if placed.Reservation.State != "bound" {
				return fmt.Errorf("it is %s", placed.Reservation.State)
			}
			return nil
		})
		if len(placed.Reservation.Bookings) != 2 {
			t.Fatalf("reservation %s booked %+v", rsv, placed.Reservation.Bookings)
		}
		row := `document.querySelector('tr[data-reservation-id=` + quote(rsv) + `]')`
		navigate(ctx, t, s.base, "/console/reservations")
		waitFor(ctx, t, "the row of "+rsv, row+` ? "" : "no row"`)
		if st := js[string](ctx, t, row+`.dataset.state`); !strings.EqualFold(st, "bound") {
			t.Errorf("the row's data-state is %q, want bound", st)
		}
		placement := js[string](ctx, t, row+`.querySelector(".placement")?.textContent || ""`)
		for _, b := range placed.Reservation.Bookings {
			if !strings.Contains(placement, b.NodeID) {
				t.Errorf("the placement cell %q does not show node %s", placement, b.NodeID)
			}
		}

		do(ctx, t, chromedp.Click(chromedp.CSS(`tr[data-reservation-id=`+quote(rsv)+`] form.release :is(button, input[type="submit"])`)))
		waitFor(ctx, t, "the confirmation dialog", `document.querySelector("dialog#confirm-dialog")?.open ? "" : "#confirm-dialog is not open"`)
		if text := js[string](ctx, t, `document.querySelector("dialog#confirm-dialog").textContent`); !strings.Contains(text, rsv) {
			t.Errorf("the confirmation does not name reservation %s: %q", rsv, text)
		}
		do(ctx, t, chromedp.Click(chromedp.CSS(`dialog#confirm-dialog #confirm-yes`)))
		waitFor(ctx, t, "the released reservation", `(() => {
			if (location.pathname !== "/console/reservations") return "the page is at " + location.href;
			const r = `+row+`;
			return !r || /released/i.test(r.dataset.state) ? "" : "its data-state is " + r.dataset.state;
		})()`)
		s.call(t, s.env.Credential, "reservations/get", map[string]any{"tenantId": "root", "reservationId": rsv}, &placed)
		if placed.Reservation.State != "released" {
			t.Fatalf("after the release the API has it %s", placed.Reservation.State)
		}
	})

	t.Run("another tenant's user sees none of root's nodes", func(t *testing.T) {
		key := s.member(t, "acme", "viewer")
		ctx := tab(ctx, t)
		signIn(ctx, t, s.base, key)
		if who := js[string](ctx, t, `document.querySelector("#whoami").textContent`); !strings.Contains(who, "viewer") && !strings.Contains(who, "acme") {
			t.Errorf("#whoami shows %q for acme's viewer", who)
		}
		if got := tiles(ctx, t); len(got) != 0 {
			t.Fatalf("acme's fleet page shows tiles %+v", got)
		}
		html := js[string](ctx, t, `document.documentElement.outerHTML`)
		for _, id := range append([]string{s.pool}, s.nodes...) {
			if strings.Contains(html, id) {
				t.Errorf("acme's fleet page mentions root's %s", id)
			}
		}
		navigate(ctx, t, s.base, "/console/nodes/"+s.nodes[0])
		waitFor(ctx, t, "an error for root's node", `(() => {
			const e = document.querySelector("div#error");
			return e && e.dataset.code ? "" : "no #error with a data-code";
		})()`)
		if shows := js[[]string](ctx, t, `["#node-ready", "#conditions", "#devices", "#generation", "#run-command"].filter(s => document.querySelector(s))`); len(shows) != 0 {
			t.Fatalf("acme's viewer sees root's node: %v%s", shows, shown(ctx))
		}
		t.Logf("acme's viewer opening root's node: %s", js[string](ctx, t, `document.querySelector("#error").dataset.code + ": " + document.querySelector("#error").textContent.trim()`))

		// Asking for root's tenant outright is refused by the API, and the
		// page says so.
		for _, path := range []string{"/console/nodes/" + s.nodes[0] + "?tenant=root", "/console/?tenant=root"} {
			navigate(ctx, t, s.base, path)
			waitFor(ctx, t, "an error for "+path, `document.querySelector("div#error[data-code]") ? "" : "no #error with a data-code"`)
			if code := js[string](ctx, t, `document.querySelector("#error").dataset.code`); code != "ACCESS_DENIED" {
				t.Errorf("%s: #error's code is %s, want ACCESS_DENIED", path, code)
			}
			html := js[string](ctx, t, `document.documentElement.outerHTML`)
			for _, id := range s.nodes[1:] {
				if strings.Contains(html, id) {
					t.Errorf("%s mentions root's node %s", path, id)
				}
			}
			if shows := js[[]string](ctx, t, `["#node-ready", "#devices", "#tiles a.tile", "#pools tr[data-pool-id]"].filter(s => document.querySelector(s))`); len(shows) != 0 {
				t.Errorf("%s shows %v of root's", path, shows)
			}
		}
	})

	t.Run("a stopped agent's tile leaves Ready live", func(t *testing.T) {
		navigate(ctx, t, s.base, "/console/")
		for _, id := range s.nodes {
			waitFor(ctx, t, "node "+id+" Ready on the fleet page", tileReady(id, `r === "True"`))
		}
		liveFeed(ctx, t)
		m := mark(ctx, t)
		s.env.Fleet.Halt(0)
		defer s.env.Fleet.Resume(0)
		waitFor(ctx, t, "node "+s.nodes[0]+"'s tile to leave Ready", tileReady(s.nodes[0], `r === "False" || r === "Unknown"`))
		marked(ctx, t, m)
		if ready, _, _ := s.ready(t, s.nodes[0]); ready == "True" {
			t.Fatalf("the tile left Ready while the API still has the node Ready")
		}
		for _, id := range s.nodes[1:] {
			if r := js[string](ctx, t, `document.querySelector('#tiles a.tile[data-node-id=`+quote(id)+`]').dataset.ready`); r != "True" {
				t.Errorf("running node %s's tile went %s", id, r)
			}
		}
		// And back, still live.
		s.env.Fleet.Resume(0)
		waitFor(ctx, t, "node "+s.nodes[0]+"'s tile to be Ready again", tileReady(s.nodes[0], `r === "True"`))
		marked(ctx, t, m)
	})
}

// isTerminal says whether a command state shown by the console is terminal.
func isTerminal(state string) bool {
	switch strings.ToUpper(state) {
	case "SUCCEEDED", "FAILED", "EXPIRED", "CANCELLED", "CANCELED", "TIMED_OUT", "REJECTED", "UNSUPPORTED":
		return true
	}
	return false
}

// mustJSON is v as a JavaScript literal.
func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	if string(b) == "null" {
		return "[]"
	}
	return string(b)
}
