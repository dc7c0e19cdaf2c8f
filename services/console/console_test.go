package console_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/html"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/console"
	"github.com/bettercompute/bettercompute/services/dev"
)

// htFixture is a whole dev control plane (real PostgreSQL, embedded NATS,
// every role) with a simulated fleet of two GPU nodes in root's pool
// "sim", and a second tenant "acme" with a key of its own.
type htFixture struct {
	env     *dev.Env
	base    string
	nodes   []string
	acmeKey string
}

// htStart starts the fixture and waits for both nodes to be adopted, ready
// and converged.
func htStart(t *testing.T) *htFixture {
	t.Helper()
	return htStartRun(t, dev.RunOptions{})
}

// htStartRun is htStart with make run's additions (run.SimMig: node 0's GPU
// 0 gets a MIG layout); with any, dev starts without the API tuning.
func htStartRun(t *testing.T, run dev.RunOptions) *htFixture {
	t.Helper()
	port, nodes, none, noVPS := 0, 2, 0, false
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &nodes, SimMachines: &none, SimInstances: &noVPS},
		Gateway: config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond),
			LivenessInterval: config.Duration(200 * time.Millisecond)},
		Runtime: config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
	}
	cfg.Defaults()
	var env *dev.Env
	var err error
	if run == (dev.RunOptions{}) {
		env, err = dev.StartWith(t.Context(), cfg, app.Options{API: api.Tuning{RatePerSecond: 1000, RateBurst: 2000}})
	} else {
		env, err = dev.StartRun(t.Context(), cfg, nil, run)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	f := &htFixture{env: env, base: env.BaseURL()}

	poll.Until(t, 2*time.Minute, "two simulated nodes adopted, ready and converged", func() bool {
		var out struct {
			Nodes []struct {
				ID, State                      string
				Generation, ObservedGeneration string
				Conditions                     []struct{ Type, Value string }
				Devices                        []struct{ ID string }
			}
		}
		if htAPI(t, f, env.Credential, "nodes/list", map[string]any{"tenantId": "root"}, &out) != nil {
			return false
		}
		f.nodes = f.nodes[:0]
		for _, n := range out.Nodes {
			ready := slices.ContainsFunc(n.Conditions, func(c struct{ Type, Value string }) bool { return c.Type == "Ready" && c.Value == "True" })
			if n.State == "adopted" && ready && len(n.Devices) == 8 && n.Generation != "" && n.Generation == n.ObservedGeneration {
				f.nodes = append(f.nodes, n.ID)
			}
		}
		return len(f.nodes) == 2
	})

	must := func(method string, body, out any) {
		t.Helper()
		if err := htAPI(t, f, env.Credential, method, body, out); err != nil {
			t.Fatal(err)
		}
	}
	must("tenants/create", map[string]any{"tenantId": "root", "childTenantId": "acme"}, &struct{}{})
	var ident struct{ Identity struct{ ID string } }
	must("identities/create", map[string]any{"tenantId": "acme", "name": "ops", "kind": "user"}, &ident)
	var key struct{ Secret string }
	must("apiKeys/create", map[string]any{"tenantId": "acme", "identityId": ident.Identity.ID, "name": "console"}, &key)
	must("policies/put", map[string]any{"tenantId": "acme", "name": "members",
		"body": `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`}, &struct{}{})
	f.acmeKey = key.Secret
	return f
}

// htAPI calls an API method over REST with key and decodes the answer.
func htAPI(t testing.TB, f *htFixture, key, method string, body, out any) error {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, f.base+"/api/compute/"+method, strings.NewReader(string(b)))
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %d %s", method, resp.StatusCode, raw)
	}
	return json.Unmarshal(raw, out)
}

// htReq is one console request: never following redirects, with the
// session cookie when set.
type htReq struct {
	method, path string
	session      string
	form         url.Values
	header       map[string]string
	host         string
}

// htResp is what htDo read of a response (its body is read and closed).
type htResp struct {
	StatusCode int
	Header     http.Header
	cookies    []*http.Cookie
}

// Cookies returns the cookies the response set.
func (r htResp) Cookies() []*http.Cookie { return r.cookies }

func htDo(t testing.TB, f *htFixture, r htReq) (htResp, string) {
	t.Helper()
	var body io.Reader
	if r.form != nil {
		body = strings.NewReader(r.form.Encode())
	}
	req, err := http.NewRequestWithContext(t.Context(), htOr(r.method, http.MethodGet), f.base+r.path, body)
	if err != nil {
		t.Fatal(err)
	}
	if r.form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if r.session != "" {
		req.AddCookie(&http.Cookie{Name: console.CookieName, Value: r.session})
	}
	for k, v := range r.header {
		req.Header.Set(k, v)
	}
	if r.host != "" {
		req.Host = r.host
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	return htResp{StatusCode: resp.StatusCode, Header: resp.Header, cookies: resp.Cookies()}, string(raw)
}

func htOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// htLogin signs in with key and returns the session cookie's value.
func htLogin(t testing.TB, f *htFixture, key string) string {
	t.Helper()
	resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/login", form: url.Values{"key": {key}}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != console.Prefix {
		t.Fatalf("sign-in answered %d (Location %q): %s", resp.StatusCode, resp.Header.Get("Location"), body)
	}
	for _, ck := range resp.Cookies() {
		if ck.Name == console.CookieName {
			return ck.Value
		}
	}
	t.Fatal("sign-in set no session cookie")
	return ""
}

// htGet renders a console page as session and parses it, failing unless
// it answered want.
func htGet(t testing.TB, f *htFixture, session, path string, want int) (*html.Node, string) {
	t.Helper()
	resp, body := htDo(t, f, htReq{path: path, session: session})
	if resp.StatusCode != want {
		t.Fatalf("GET %s: %d, want %d: %s", path, resp.StatusCode, want, body)
	}
	doc, err := html.Parse(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return doc, body
}

func htAttr(n *html.Node, name string) string {
	for _, a := range n.Attr {
		if a.Key == name {
			return a.Val
		}
	}
	return ""
}

func htHasAttr(n *html.Node, name string) bool {
	return slices.ContainsFunc(n.Attr, func(a html.Attribute) bool { return a.Key == name })
}

func htHasClass(n *html.Node, class string) bool {
	return slices.Contains(strings.Fields(htAttr(n, "class")), class)
}

// all returns the elements under n that match.
func htAll(n *html.Node, match func(*html.Node) bool) []*html.Node {
	var out []*html.Node
	for d := range n.Descendants() {
		if d.Type == html.ElementNode && match(d) {
			out = append(out, d)
		}
	}
	return out
}

func htByID(t testing.TB, doc *html.Node, tag, id string) *html.Node {
	t.Helper()
	got := htAll(doc, func(n *html.Node) bool { return htAttr(n, "id") == id })
	if len(got) != 1 || (tag != "" && got[0].Data != tag) {
		t.Fatalf("want one <%s id=%q>, found %d", tag, id, len(got))
	}
	return got[0]
}

func htText(n *html.Node) string {
	var b strings.Builder
	for d := range n.Descendants() {
		if d.Type == html.TextNode {
			b.WriteString(d.Data)
		}
	}
	return strings.TrimSpace(b.String())
}

// input is the form's input (or select) named name.
func htInput(t testing.TB, form *html.Node, name string) *html.Node {
	t.Helper()
	got := htAll(form, func(n *html.Node) bool { return (n.Data == "input" || n.Data == "select") && htAttr(n, "name") == name })
	if len(got) != 1 {
		t.Fatalf("form %q: want one field %q, found %d", htAttr(form, "id"), name, len(got))
	}
	return got[0]
}

// csrf is the csrf token of the form with id.
func htCSRF(t testing.TB, doc *html.Node, formID string) string {
	t.Helper()
	in := htInput(t, htByID(t, doc, "form", formID), "csrf")
	if htAttr(in, "type") != "hidden" || htAttr(in, "value") == "" {
		t.Fatalf("form %s: csrf field %v", formID, in.Attr)
	}
	return htAttr(in, "value")
}

// wantNav checks the chrome every signed-in page has.
func htWantNav(t testing.TB, doc *html.Node, who string) {
	t.Helper()
	nav := htByID(t, doc, "nav", "nav")
	var hrefs []string
	for _, a := range htAll(nav, func(n *html.Node) bool { return n.Data == "a" }) {
		hrefs = append(hrefs, htText(a)+" "+htAttr(a, "href"))
	}
	want := []string{"Fleet /console/", "Reservations /console/reservations", "Commands /console/commands", "Events /console/events", "Audit /console/audit"}
	if !slices.Equal(hrefs, want) {
		t.Fatalf("nav links %q, want %q", hrefs, want)
	}
	if got := htText(htByID(t, doc, "span", "whoami")); !strings.Contains(got, who) {
		t.Fatalf("#whoami %q does not name %q", got, who)
	}
}

// wantError checks the page's #error shows code (and field when set).
func htWantError(t testing.TB, doc *html.Node, code, field string) {
	t.Helper()
	e := htByID(t, doc, "div", "error")
	if htAttr(e, "data-code") != code || (field != "" && htAttr(e, "data-field") != field) {
		t.Fatalf("#error %v %q, want code %s field %q", e.Attr, htText(e), code, field)
	}
}

func TestConsoleHTTP(t *testing.T) {
	f := htStart(t)
	root := f.env.Credential
	node := f.nodes[0]

	t.Run("sign-in keeps a session id (not the key) in an HttpOnly SameSite=Strict cookie, Secure except on loopback", func(t *testing.T) {
		for _, tc := range []struct {
			host   string
			secure bool
		}{{"", false}, {"localhost", false}, {"console.example.com", true}} {
			resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/login", form: url.Values{"key": {root}}, host: tc.host})
			if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/" {
				t.Fatalf("host %q: %d %q %s", tc.host, resp.StatusCode, resp.Header.Get("Location"), body)
			}
			cks := resp.Cookies()
			if len(cks) != 1 {
				t.Fatalf("host %q: cookies %v", tc.host, cks)
			}
			ck := cks[0]
			if ck.Name != console.CookieName || ck.Value == root || len(ck.Value) != 43 || strings.HasPrefix(ck.Value, "bck_") || !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode ||
				ck.Path != "/console/" || ck.Secure != tc.secure {
				t.Fatalf("host %q: cookie %+v (want Secure=%v)", tc.host, ck, tc.secure)
			}
		}
	})

	t.Run("a bad key re-renders the form with #login-error", func(t *testing.T) {
		for _, tc := range []struct{ key, code string }{
			{"bck_nobody.wrongsecret", "UNAUTHENTICATED"},
			{"<script>", "INVALID_INPUT"},
			{"", "INVALID_INPUT"},
		} {
			resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/login", form: url.Values{"key": {tc.key}}})
			if resp.StatusCode < 400 || len(resp.Cookies()) != 0 {
				t.Fatalf("key %q: %d, cookies %v", tc.key, resp.StatusCode, resp.Cookies())
			}
			doc, _ := html.Parse(strings.NewReader(body))
			e := htByID(t, doc, "p", "login-error")
			if htAttr(e, "data-code") != tc.code || strings.Contains(body, "<script>") {
				t.Fatalf("key %q: #login-error %v %q", tc.key, e.Attr, htText(e))
			}
			htByID(t, doc, "form", "login")
		}
	})

	t.Run("without a session pages redirect to sign-in and the stream is 401", func(t *testing.T) {
		for _, p := range []string{"/console/", "/console/nodes/" + node, "/console/reservations", "/console/commands", "/console/events", "/console/audit", "/console/nowhere"} {
			resp, _ := htDo(t, f, htReq{path: p})
			if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/login" {
				t.Fatalf("GET %s: %d %q", p, resp.StatusCode, resp.Header.Get("Location"))
			}
		}
		resp, _ := htDo(t, f, htReq{path: "/console/events/stream"})
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("stream without a session: %d", resp.StatusCode)
		}
		resp, _ = htDo(t, f, htReq{path: "/console/", session: "bck_nobody.wrongsecret"})
		if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "/console/login") {
			t.Fatalf("a session whose key the API refuses: %d %q", resp.StatusCode, resp.Header.Get("Location"))
		}
		doc, _ := htGet(t, f, "", "/console/login", http.StatusOK)
		form := htByID(t, doc, "form", "login")
		if htAttr(form, "method") != "post" || htAttr(form, "action") != "/console/login" || htAttr(htInput(t, form, "key"), "type") != "password" {
			t.Fatalf("login form %v", form.Attr)
		}
	})

	s := htLogin(t, f, root)

	t.Run("the fleet page shows the summary, the pools and a tile per node", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/", http.StatusOK)
		htWantNav(t, doc, "root")
		sum := htByID(t, doc, "section", "fleet-summary")
		if !strings.Contains(htText(sum), "2 nodes") {
			t.Fatalf("#fleet-summary %q", htText(sum))
		}
		rows := htAll(htByID(t, doc, "table", "pools"), func(n *html.Node) bool { return n.Data == "tr" && htHasAttr(n, "data-pool-id") })
		if len(rows) == 0 {
			t.Fatal("no pool rows")
		}
		for _, cls := range []string{"gpus-free", "gpus-booked", "gpus-quarantined"} {
			if len(htAll(rows[0], func(n *html.Node) bool { return htHasClass(n, cls) })) != 1 {
				t.Fatalf("pool row has no .%s", cls)
			}
		}
		tiles := htAll(htByID(t, doc, "div", "tiles"), func(n *html.Node) bool { return htHasClass(n, "tile") })
		var ids []string
		for _, tl := range tiles {
			ids = append(ids, htAttr(tl, "data-node-id"))
			if tl.Data != "a" || htAttr(tl, "data-ready") != "True" || htAttr(tl, "data-state") != "adopted" || htAttr(tl, "href") != "/console/nodes/"+htAttr(tl, "data-node-id") {
				t.Fatalf("tile %v", tl.Attr)
			}
		}
		slices.Sort(ids)
		if want := slices.Sorted(slices.Values(f.nodes)); !slices.Equal(ids, want) {
			t.Fatalf("tiles %v, want %v", ids, want)
		}
		filters := htByID(t, doc, "form", "filters")
		for _, name := range []string{"pool", "label", "condition"} {
			htInput(t, filters, name)
		}
		if !strings.HasPrefix(htBodyAttr(doc, "body", "data-stream"), "/console/events/stream?") {
			t.Fatal("the fleet page opens no stream")
		}
	})

	t.Run("fleet filters are query parameters of nodes.list", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/?pool=sim&condition=Ready%3DLost", http.StatusOK)
		if n := len(htAll(doc, func(n *html.Node) bool { return htHasClass(n, "tile") })); n != 0 {
			t.Fatalf("Ready=Lost shows %d tiles", n)
		}
		doc, _ = htGet(t, f, s, "/console/?pool=sim&condition=Ready", http.StatusOK)
		if n := len(htAll(doc, func(n *html.Node) bool { return htHasClass(n, "tile") })); n != 2 {
			t.Fatalf("Ready in pool sim shows %d tiles", n)
		}
		doc, _ = htGet(t, f, s, "/console/?label=nonsense", http.StatusBadRequest)
		htWantError(t, doc, "INVALID_INPUT", "label")
		doc, _ = htGet(t, f, s, "/console/?condition=Bogus%3D%3D", http.StatusBadRequest)
		htWantError(t, doc, "INVALID_INPUT", "condition")
	})

	t.Run("the node page shows conditions, generation, devices, commands and events", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/nodes/"+node, http.StatusOK)
		htWantNav(t, doc, "root")
		if got := htText(htByID(t, doc, "span", "node-ready")); got != "True" {
			t.Fatalf("#node-ready %q", got)
		}
		conds := htAll(htByID(t, doc, "table", "conditions"), func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-type") != "" })
		if !slices.ContainsFunc(conds, func(n *html.Node) bool { return htAttr(n, "data-type") == "Ready" }) {
			t.Fatal("no Ready row in #conditions")
		}
		gen := htByID(t, doc, "div", "generation")
		if htAttr(gen, "data-generation") == "" || htAttr(gen, "data-generation") != htAttr(gen, "data-observed-generation") {
			t.Fatalf("#generation %v", gen.Attr)
		}
		if n := len(htAll(gen, func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-section") != "" })); n == 0 {
			t.Fatal("#generation has no section rows")
		}
		if n := len(htAll(htByID(t, doc, "table", "devices"), func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-device-id") != "" })); n != 8 {
			t.Fatalf("#devices has %d rows, want 8", n)
		}
		htByID(t, doc, "table", "node-commands")
		if n := len(htAll(htByID(t, doc, "ul", "node-events"), func(n *html.Node) bool { return n.Data == "li" })); n == 0 {
			t.Fatal("#node-events is empty: the node's join wrote events")
		}
		form := htByID(t, doc, "form", "run-command")
		if htAttr(form, "method") != "post" || htAttr(form, "action") != "/console/nodes/"+node+"/commands" || !strings.Contains(htAttr(form, "data-confirm"), node) {
			t.Fatalf("#run-command %v", form.Attr)
		}
		var kinds []string
		for _, o := range htAll(htInput(t, form, "kind"), func(n *html.Node) bool { return n.Data == "option" }) {
			kinds = append(kinds, htAttr(o, "value"))
		}
		if !slices.Equal(kinds, []string{"agent.upgrade", "diag.nvml", "inventory.refresh", "logs.collect", "node.reboot"}) {
			t.Fatalf("kinds %v: want the API's allowlist", kinds)
		}
		htByID(t, doc, "button", "run-command-submit")
		htCSRF(t, doc, "run-command")
		for _, id := range []string{"drain", "undrain"} {
			fm := htByID(t, doc, "form", id)
			if htAttr(fm, "action") != "/console/nodes/"+node+"/"+id || !strings.Contains(htAttr(fm, "data-confirm"), node) {
				t.Fatalf("#%s %v", id, fm.Attr)
			}
		}
		htByID(t, doc, "dialog", "confirm-dialog")
		htByID(t, doc, "button", "confirm-yes")
		htByID(t, doc, "button", "confirm-no")
		doc, _ = htGet(t, f, s, "/console/nodes/node_nope", http.StatusNotFound)
		htWantError(t, doc, "NOT_FOUND", "nodeId")
	})

	nodePage, _ := htGet(t, f, s, "/console/nodes/"+node, http.StatusOK)
	token := htCSRF(t, nodePage, "drain")

	t.Run("a POST without the csrf token or from another origin is 403 and changes nothing", func(t *testing.T) {
		for _, tc := range []struct {
			name   string
			form   url.Values
			header map[string]string
		}{
			{"no token", url.Values{}, nil},
			{"a wrong token", url.Values{"csrf": {"x" + token}}, nil},
			{"another session's token", url.Values{"csrf": {htCSRFOf(t, f, htLogin(t, f, f.acmeKey))}}, nil},
			{"a foreign Origin", url.Values{"csrf": {token}}, map[string]string{"Origin": "https://evil.example"}},
			{"a foreign Referer", url.Values{"csrf": {token}}, map[string]string{"Referer": "https://evil.example/x"}},
			{"a cross-site fetch", url.Values{"csrf": {token}}, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		} {
			for _, path := range []string{"/console/nodes/" + node + "/drain", "/console/reservations", "/console/logout"} {
				form := url.Values{"pool": {"sim"}, "gpus": {"1"}}
				for k, v := range tc.form {
					form[k] = v
				}
				resp, body := htDo(t, f, htReq{method: http.MethodPost, path: path, session: s, form: form, header: tc.header})
				if resp.StatusCode != http.StatusForbidden {
					t.Fatalf("%s to %s: %d %s", tc.name, path, resp.StatusCode, body)
				}
			}
		}
		if htDraining(t, f, node) {
			t.Fatal("a refused POST drained the node")
		}
		var rs struct{ Reservations []struct{ ID string } }
		if err := htAPI(t, f, root, "reservations/list", map[string]any{"tenantId": "root"}, &rs); err != nil || len(rs.Reservations) != 0 {
			t.Fatalf("refused POSTs made reservations %v (%v)", rs.Reservations, err)
		}
		// The same origin passes.
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/audit", session: s,
			form: url.Values{"csrf": {token}}, header: map[string]string{"Origin": f.base, "Sec-Fetch-Site": "same-origin"}})
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("same-origin undrain: %d %s", resp.StatusCode, body)
		}
	})

	t.Run("forms are bounded", func(t *testing.T) {
		resp, _ := htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {token}, "pool": {strings.Repeat("p", 70<<10)}}})
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("a 70 KiB form: %d", resp.StatusCode)
		}
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"1"}, "name": {strings.Repeat("n", 65)}}})
		doc, _ := html.Parse(strings.NewReader(body))
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("a 65-character name: %d", resp.StatusCode)
		}
		htWantError(t, doc, "INVALID_INPUT", "name")
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"lots"}}})
		doc, _ = html.Parse(strings.NewReader(body))
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("gpus=lots: %d", resp.StatusCode)
		}
		htWantError(t, doc, "INVALID_INPUT", "gpus")
	})

	var commandID string
	t.Run("inventory.refresh through the console reaches SUCCEEDED", func(t *testing.T) {
		idem := htAttr(htInput(t, htByID(t, nodePage, "form", "run-command"), "idem"), "value")
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/commands", session: s,
			form: url.Values{"csrf": {token}, "kind": {"inventory.refresh"}, "idem": {idem}}})
		loc := resp.Header.Get("Location")
		m := regexp.MustCompile(`^/console/commands/([^/?]+)\?node=` + regexp.QuoteMeta(node) + `$`).FindStringSubmatch(loc)
		if resp.StatusCode != http.StatusSeeOther || m == nil {
			t.Fatalf("run: %d %q %s", resp.StatusCode, loc, body)
		}
		commandID = m[1]
		// The same form again is the same command.
		resp, _ = htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/commands", session: s,
			form: url.Values{"csrf": {token}, "kind": {"inventory.refresh"}, "idem": {idem}}})
		if resp.Header.Get("Location") != loc {
			t.Fatalf("a resubmitted form made another command: %q", resp.Header.Get("Location"))
		}
		poll.Until(t, time.Minute, "the command to succeed", func() bool {
			var out struct{ Command struct{ State string } }
			err := htAPI(t, f, root, "commands/get", map[string]any{"tenantId": "root", "nodeId": node, "commandId": commandID}, &out)
			if err == nil && out.Command.State != "pending" && out.Command.State != "in_flight" && out.Command.State != "succeeded" {
				t.Fatalf("the command ended %s", out.Command.State)
			}
			return err == nil && out.Command.State == "succeeded"
		})
		doc, _ := htGet(t, f, s, loc, http.StatusOK)
		htWantNav(t, doc, "root")
		if st := htByID(t, doc, "span", "command-state"); htText(st) != "SUCCEEDED" || htAttr(st, "data-state") != "succeeded" {
			t.Fatalf("#command-state %q %v", htText(st), st.Attr)
		}
		// Without ?node= the page finds the node in the command's events.
		poll.UntilNil(t, 30*time.Second, "the command page without ?node=", func() error {
			resp, body := htDo(t, f, htReq{path: "/console/commands/" + commandID, session: s})
			if resp.StatusCode != http.StatusOK || !strings.Contains(body, ">SUCCEEDED<") {
				return fmt.Errorf("%d", resp.StatusCode)
			}
			return nil
		})
		poll.UntilNil(t, 30*time.Second, "the command on the commands page", func() error {
			doc, _ := htGet(t, f, s, "/console/commands", http.StatusOK)
			rows := htAll(doc, func(n *html.Node) bool { return n.Data == "tr" && htAttr(n, "data-command-id") == commandID })
			if len(rows) != 1 || htAttr(rows[0], "data-state") != "succeeded" {
				return fmt.Errorf("rows %d", len(rows))
			}
			return nil
		})
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/commands", session: s,
			form: url.Values{"csrf": {token}, "kind": {"gpu.reset"}}})
		doc, _ = html.Parse(strings.NewReader(body))
		if resp.StatusCode < 400 {
			t.Fatalf("gpu.reset (not on the allowlist): %d", resp.StatusCode)
		}
		htWantError(t, doc, "UNSUPPORTED", "kind")
	})

	t.Run("the stream is the events watch as the session", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		q := url.Values{"types": {"command.*"}, "subject": {commandID}, "after": {"0"}}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, f.base+"/console/events/stream?"+q.Encode(), nil)
		req.AddCookie(&http.Cookie{Name: console.CookieName, Value: s})
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			t.Fatalf("stream: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		sc := bufio.NewScanner(resp.Body)
		var types []string
		for sc.Scan() && !slices.Contains(types, "command.succeeded") {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			var e struct{ Type, Subject, TenantID string }
			if err := json.Unmarshal([]byte(data), &e); err != nil {
				t.Fatal(err)
			}
			if e.Subject != commandID || e.TenantID != "root" {
				t.Fatalf("stream event %+v", e)
			}
			types = append(types, e.Type)
		}
		if !slices.Contains(types, "command.succeeded") {
			t.Fatalf("stream ended (%v) after %v", sc.Err(), types)
		}
		// Another tenant's session cannot watch root.
		resp2, body := htDo(t, f, htReq{path: "/console/events/stream?tenantId=root", session: htLogin(t, f, f.acmeKey)})
		if resp2.StatusCode != http.StatusForbidden || !strings.Contains(body, "ACCESS_DENIED") {
			t.Fatalf("acme watching root: %d %s", resp2.StatusCode, body)
		}
	})

	t.Run("signing out ends the session's open live feed", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		s2 := htLogin(t, f, root)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, f.base+"/console/events/stream?types=node.*", nil)
		req.AddCookie(&http.Cookie{Name: console.CookieName, Value: s2})
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("stream: %d", resp.StatusCode)
		}
		sc := bufio.NewScanner(resp.Body)
		if !sc.Scan() {
			t.Fatalf("stream ended before its first line: %v", sc.Err())
		}
		out, _ := htDo(t, f, htReq{method: http.MethodPost, path: "/console/logout", session: s2, form: url.Values{"csrf": {htCSRFOf(t, f, s2)}}})
		if out.StatusCode != http.StatusSeeOther {
			t.Fatalf("logout: %d", out.StatusCode)
		}
		var last []string
		for sc.Scan() {
			if line := sc.Text(); line != "" && !strings.HasPrefix(line, ":") {
				last = append(last, line)
			}
		}
		if n := len(last); n < 2 || last[n-2] != "event: error" || !strings.Contains(last[n-1], `"code":"UNAUTHENTICATED"`) {
			t.Fatalf("the feed after sign-out ended with %q (%v), want a final UNAUTHENTICATED error event", last, sc.Err())
		}
	})

	t.Run("reservations are created and released through the console", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/reservations", http.StatusOK)
		htWantNav(t, doc, "root")
		form := htByID(t, doc, "form", "create-reservation")
		for _, name := range []string{"pool", "gpus", "name", "csrf"} {
			htInput(t, form, name)
		}
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {htCSRF(t, doc, "create-reservation")}, "pool": {"sim"}, "gpus": {"2"}, "name": {"ht-first"}}})
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/reservations" {
			t.Fatalf("create: %d %q %s", resp.StatusCode, resp.Header.Get("Location"), body)
		}
		var rs struct {
			Reservations []struct {
				ID, State string
				GpuCount  int
				Bookings  []struct{ NodeID string }
			}
		}
		if err := htAPI(t, f, root, "reservations/list", map[string]any{"tenantId": "root"}, &rs); err != nil {
			t.Fatal(err)
		}
		if len(rs.Reservations) != 1 || rs.Reservations[0].GpuCount != 2 || len(rs.Reservations[0].Bookings) != 2 {
			t.Fatalf("reservations %+v", rs.Reservations)
		}
		r := rs.Reservations[0]
		// The same name again is the same reservation.
		htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"2"}, "name": {"ht-first"}}})
		doc, _ = htGet(t, f, s, "/console/reservations", http.StatusOK)
		rows := htAll(doc, func(n *html.Node) bool { return n.Data == "tr" && htHasAttr(n, "data-reservation-id") })
		if len(rows) != 1 || htAttr(rows[0], "data-reservation-id") != r.ID || htAttr(rows[0], "data-state") != r.State {
			t.Fatalf("rows %d (want one, %s %s)", len(rows), r.ID, r.State)
		}
		cells := htAll(rows[0], func(n *html.Node) bool { return htHasClass(n, "placement") })
		if len(cells) != 1 || !strings.Contains(htText(cells[0]), r.Bookings[0].NodeID) {
			t.Fatalf("placement %q, want node %s", htText(cells[0]), r.Bookings[0].NodeID)
		}
		// The node page shows the booking on its devices.
		nd, _ := htGet(t, f, s, "/console/nodes/"+r.Bookings[0].NodeID, http.StatusOK)
		if n := len(htAll(htByID(t, nd, "table", "devices"), func(n *html.Node) bool { return htAttr(n, "data-reservation-id") == r.ID })); n != 2 {
			t.Fatalf("%d devices show the booking, want 2", n)
		}
		rel := htAll(rows[0], func(n *html.Node) bool { return n.Data == "form" && htHasClass(n, "release") })
		if len(rel) != 1 || htAttr(rel[0], "action") != "/console/reservations/"+r.ID+"/release" || !strings.Contains(htAttr(rel[0], "data-confirm"), r.ID) {
			t.Fatalf("release form %v", rel)
		}
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations/" + r.ID + "/release", session: s, form: url.Values{"csrf": {token}}})
		if resp.StatusCode != http.StatusSeeOther {
			t.Fatalf("release: %d %s", resp.StatusCode, body)
		}
		var got struct{ Reservation struct{ State string } }
		if err := htAPI(t, f, root, "reservations/get", map[string]any{"tenantId": "root", "reservationId": r.ID}, &got); err != nil || got.Reservation.State != "released" {
			t.Fatalf("after release: %+v %v", got, err)
		}
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
			form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"999"}}})
		doc, _ = html.Parse(strings.NewReader(body))
		if resp.StatusCode < 400 {
			t.Fatalf("999 GPUs: %d", resp.StatusCode)
		}
		htWantError(t, doc, "NO_CAPACITY", "")
	})

	t.Run("drain and undrain through the console", func(t *testing.T) {
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/drain", session: s,
			form: url.Values{"csrf": {token}, "reason": {"console test"}}})
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/nodes/"+node {
			t.Fatalf("drain: %d %q %s", resp.StatusCode, resp.Header.Get("Location"), body)
		}
		if !htDraining(t, f, node) {
			t.Fatal("the node is not draining")
		}
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/undrain", session: s, form: url.Values{"csrf": {token}}})
		if resp.StatusCode != http.StatusSeeOther {
			t.Fatalf("undrain: %d %s", resp.StatusCode, body)
		}
		if htDraining(t, f, node) {
			t.Fatal("the node is still draining")
		}
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/drain", session: s,
			form: url.Values{"csrf": {token}, "deadlineSeconds": {"-1"}}})
		doc, _ := html.Parse(strings.NewReader(body))
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("deadlineSeconds=-1: %d", resp.StatusCode)
		}
		htWantError(t, doc, "INVALID_INPUT", "deadlineSeconds")
	})

	t.Run("the events page lists and filters events", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/events?type=command&subject="+commandID, http.StatusOK)
		htWantNav(t, doc, "root")
		fm := htByID(t, doc, "form", "event-filters")
		htInput(t, fm, "type")
		htInput(t, fm, "subject")
		items := htAll(htByID(t, doc, "ul", "event-list"), func(n *html.Node) bool { return n.Data == "li" })
		if len(items) == 0 {
			t.Fatal("no events for the command")
		}
		for _, li := range items {
			if !strings.HasPrefix(htAttr(li, "data-event-type"), "command.") || htAttr(li, "data-subject") != commandID {
				t.Fatalf("event %v", li.Attr)
			}
		}
		if st := htBodyAttr(doc, "body", "data-stream"); !strings.Contains(st, "types=command.%2A") || !strings.Contains(st, "subject="+commandID) {
			t.Fatalf("stream %q does not carry the filter", st)
		}
		doc, _ = htGet(t, f, s, "/console/events?type=Not+A+Type", http.StatusBadRequest)
		htWantError(t, doc, "INVALID_INPUT", "type")
	})

	t.Run("the audit page lists the log and verifies the chain", func(t *testing.T) {
		doc, _ := htGet(t, f, s, "/console/audit", http.StatusOK)
		htWantNav(t, doc, "root")
		if n := len(htAll(htByID(t, doc, "table", "audit-log"), func(n *html.Node) bool { return n.Data == "tr" && htHasAttr(n, "data-record-id") })); n == 0 {
			t.Fatal("#audit-log has no rows")
		}
		tok := htCSRF(t, doc, "audit-verify")
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/audit", session: s, form: url.Values{"csrf": {tok}}, header: map[string]string{"HX-Request": "true"}})
		part, _ := html.Parse(strings.NewReader(body))
		if res := htByID(t, part, "div", "audit-verify-result"); resp.StatusCode != http.StatusOK || htAttr(res, "data-ok") != "true" {
			t.Fatalf("verify (htmx): %d %s", resp.StatusCode, body)
		}
		if strings.Contains(body, `id="nav"`) {
			t.Fatal("the htmx answer is the whole page")
		}
		resp, body = htDo(t, f, htReq{method: http.MethodPost, path: "/console/audit", session: s, form: url.Values{"csrf": {tok}}})
		doc, _ = html.Parse(strings.NewReader(body))
		if res := htByID(t, doc, "div", "audit-verify-result"); resp.StatusCode != http.StatusOK || htAttr(res, "data-ok") != "true" {
			t.Fatalf("verify: %d %v", resp.StatusCode, res.Attr)
		}
		htByID(t, doc, "table", "audit-log")
	})

	t.Run("another tenant's key sees none of root's nodes", func(t *testing.T) {
		a := htLogin(t, f, f.acmeKey)
		doc, body := htGet(t, f, a, "/console/", http.StatusOK)
		htWantNav(t, doc, "ops")
		if n := len(htAll(doc, func(n *html.Node) bool { return htHasClass(n, "tile") || htHasClass(n, "tile-group") })); n != 0 {
			t.Fatalf("acme sees %d tiles", n)
		}
		for _, id := range f.nodes {
			if strings.Contains(body, id) {
				t.Fatalf("acme's fleet page names root's node %s", id)
			}
		}
		if !strings.Contains(htText(htByID(t, doc, "section", "fleet-summary")), "0 nodes") {
			t.Fatal("acme's summary counts nodes")
		}
		// Asking for root's fleet is refused, and says so.
		doc, body = htGet(t, f, a, "/console/?tenant=root", http.StatusForbidden)
		htWantError(t, doc, "ACCESS_DENIED", "")
		for _, id := range f.nodes {
			if strings.Contains(body, id) {
				t.Fatalf("a refused page names root's node %s", id)
			}
		}
		doc, _ = htGet(t, f, a, "/console/nodes/"+node+"?tenant=root", http.StatusForbidden)
		htWantError(t, doc, "ACCESS_DENIED", "")
		// Its own tenant's node page of root's node is NOT_FOUND.
		doc, _ = htGet(t, f, a, "/console/nodes/"+node, http.StatusNotFound)
		htWantError(t, doc, "NOT_FOUND", "")
		// And it cannot act there: the API refuses, the console shows it.
		ap, _ := htGet(t, f, a, "/console/reservations", http.StatusOK)
		resp, body := htDo(t, f, htReq{method: http.MethodPost, path: "/console/nodes/" + node + "/drain?tenant=root", session: a,
			form: url.Values{"csrf": {htCSRF(t, ap, "create-reservation")}, "tenant": {"root"}}})
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, `data-code="ACCESS_DENIED"`) {
			t.Fatalf("acme draining root's node: %d", resp.StatusCode)
		}
		if htDraining(t, f, node) {
			t.Fatal("acme drained root's node")
		}
	})

	t.Run("sign-out clears the cookie", func(t *testing.T) {
		resp, _ := htDo(t, f, htReq{method: http.MethodPost, path: "/console/logout", session: s, form: url.Values{"csrf": {token}}})
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/login" {
			t.Fatalf("logout: %d %q", resp.StatusCode, resp.Header.Get("Location"))
		}
		cks := resp.Cookies()
		if len(cks) != 1 || cks[0].Name != console.CookieName || cks[0].MaxAge >= 0 || cks[0].Value != "" {
			t.Fatalf("logout cookies %+v", cks)
		}
	})

	t.Run("static assets are embedded", func(t *testing.T) {
		for _, p := range []string{"/console/static/htmx.min.js", "/console/static/console.js", "/console/static/console.css"} {
			resp, body := htDo(t, f, htReq{path: p})
			if resp.StatusCode != http.StatusOK || len(body) < 100 {
				t.Fatalf("GET %s: %d, %d bytes", p, resp.StatusCode, len(body))
			}
		}
		resp, _ := htDo(t, f, htReq{path: "/console"})
		if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/console/" {
			t.Fatalf("GET /console: %d %q", resp.StatusCode, resp.Header.Get("Location"))
		}
	})
}

// htCSRFOf is the csrf token session renders.
func htCSRFOf(t testing.TB, f *htFixture, session string) string {
	t.Helper()
	doc, _ := htGet(t, f, session, "/console/reservations", http.StatusOK)
	return htCSRF(t, doc, "create-reservation")
}

// renderAttr is attribute name of the first <tag>.
func htBodyAttr(doc *html.Node, tag, name string) string {
	got := htAll(doc, func(n *html.Node) bool { return n.Data == tag })
	if len(got) == 0 {
		return ""
	}
	return htAttr(got[0], name)
}

// draining says whether the API reports node's Draining condition.
func htDraining(t testing.TB, f *htFixture, node string) bool {
	t.Helper()
	var out struct {
		Node struct {
			Conditions []struct {
				Type   string
				Status bool
			}
		}
	}
	if err := htAPI(t, f, f.env.Credential, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &out); err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(out.Node.Conditions, func(c struct {
		Type   string
		Status bool
	}) bool {
		return c.Type == "Draining" && c.Status
	})
}
