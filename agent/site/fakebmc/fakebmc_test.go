package fakebmc_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
)

const (
	user     = "root"
	password = "calvin-but-longer"
)

type env struct {
	bmc *fakebmc.BMC
	srv *httptest.Server
}

func setup(t *testing.T, cfg fakebmc.Config) *env {
	t.Helper()
	cfg.Username, cfg.Password = user, password
	b, err := fakebmc.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewTLSServer(b)
	t.Cleanup(srv.Close)
	return &env{bmc: b, srv: srv}
}

// do sends a request with Basic credentials (unless auth is false) and
// returns the status, headers and decoded JSON body (nil when empty).
func (e *env) do(t *testing.T, method, path string, body any, auth bool, hdr ...string) (int, http.Header, map[string]any) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, e.srv.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if auth {
		req.SetBasicAuth(user, password)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out map[string]any
	if len(bytes.TrimSpace(raw)) > 0 {
		if err := json.Unmarshal(raw, &out); err != nil {
			t.Fatalf("%s %s: body is not JSON: %q", method, path, raw)
		}
	}
	return resp.StatusCode, resp.Header, out
}

var odataType = regexp.MustCompile(`^#[A-Za-z]+(\.v\d+_\d+_\d+)?\.[A-Za-z]+$`)

// collectLinks finds every {"@odata.id": …} link and @Redfish.ActionInfo in v.
func collectLinks(v any, out *[]string) {
	switch x := v.(type) {
	case map[string]any:
		for k, val := range x {
			if s, ok := val.(string); ok && (k == "@odata.id" || k == "@Redfish.ActionInfo") {
				*out = append(*out, s)
			}
			collectLinks(val, out)
		}
	case []any:
		for _, val := range x {
			collectLinks(val, out)
		}
	}
}

// TestSchema crawls every link from the service root: each resolves, and
// each resource has @odata.id (its own path) and a well-formed @odata.type.
func TestSchema(t *testing.T) {
	t.Parallel()
	e := setup(t, fakebmc.Config{})
	// A session so the Sessions collection has a member to crawl.
	if st, _, _ := e.do(t, "POST", "/redfish/v1/SessionService/Sessions", map[string]string{"UserName": user, "Password": password}, false); st != 201 {
		t.Fatalf("create session: %d", st)
	}
	seen := map[string]bool{}
	queue := []string{"/redfish/v1/"}
	types := map[string]bool{}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if seen[p] {
			continue
		}
		seen[p] = true
		st, hdr, body := e.do(t, "GET", p, nil, true)
		if st != 200 {
			t.Errorf("GET %s: %d", p, st)
			continue
		}
		if id, _ := body["@odata.id"].(string); id != p {
			t.Errorf("%s: @odata.id %q", p, id)
		}
		typ, _ := body["@odata.type"].(string)
		if !odataType.MatchString(typ) {
			t.Errorf("%s: @odata.type %q", p, typ)
		}
		types[strings.Split(strings.TrimPrefix(typ, "#"), ".")[0]] = true
		if strings.HasPrefix(typ, "#ComputerSystem.") && hdr.Get("ETag") == "" {
			t.Errorf("%s: no ETag", p)
		}
		var links []string
		collectLinks(body, &links)
		queue = append(queue, links...)
	}
	for _, want := range []string{"ServiceRoot", "ComputerSystemCollection", "ComputerSystem", "ProcessorCollection", "Processor",
		"MemoryCollection", "Memory", "EthernetInterfaceCollection", "EthernetInterface", "StorageCollection", "Storage",
		"Drive", "ActionInfo", "SessionService", "SessionCollection", "Session"} {
		if !types[want] {
			t.Errorf("the crawl never reached a %s (reached %d resources)", want, len(seen))
		}
	}
}

func TestAuth(t *testing.T) {
	t.Parallel()
	e := setup(t, fakebmc.Config{})
	if st, _, _ := e.do(t, "GET", "/redfish/v1/", nil, false); st != 200 {
		t.Errorf("service root without credentials: %d, want 200", st)
	}
	st, hdr, body := e.do(t, "GET", "/redfish/v1/Systems/1", nil, false)
	if st != 401 || hdr.Get("WWW-Authenticate") == "" || body["error"] == nil {
		t.Errorf("system without credentials: %d %v, want 401 with a Redfish error and WWW-Authenticate", st, body)
	}
	st, _, _ = e.do(t, "POST", "/redfish/v1/SessionService/Sessions", map[string]string{"UserName": user, "Password": "nope"}, false)
	if st != 401 {
		t.Errorf("session with a wrong password: %d", st)
	}
	st, hdr, _ = e.do(t, "POST", "/redfish/v1/SessionService/Sessions", map[string]string{"UserName": user, "Password": password}, false)
	tok, loc := hdr.Get("X-Auth-Token"), hdr.Get("Location")
	if st != 201 || tok == "" || loc == "" {
		t.Fatalf("session: %d token=%v location=%q", st, tok != "", loc)
	}
	if st, _, _ := e.do(t, "GET", "/redfish/v1/Systems/1", nil, false, "X-Auth-Token", tok); st != 200 {
		t.Errorf("system with the token: %d", st)
	}
	if st, _, _ := e.do(t, "DELETE", loc, nil, false, "X-Auth-Token", tok); st != 204 {
		t.Errorf("delete session: %d", st)
	}
	if st, _, _ := e.do(t, "GET", "/redfish/v1/Systems/1", nil, false, "X-Auth-Token", tok); st != 401 {
		t.Errorf("system with a deleted session's token: %d, want 401", st)
	}
}

func TestBootOverrideAndReset(t *testing.T) {
	t.Parallel()
	var boots []string
	e := setup(t, fakebmc.Config{OnPowerOn: func(target string) { boots = append(boots, target) }})
	sys := "/redfish/v1/Systems/1"

	_, hdr, _ := e.do(t, "GET", sys, nil, true)
	etag := hdr.Get("ETag")
	patch := map[string]any{"Boot": map[string]string{"BootSourceOverrideEnabled": "Once", "BootSourceOverrideTarget": "Pxe"}}
	if st, _, _ := e.do(t, "PATCH", sys, patch, true, "If-Match", etag); st != 204 {
		t.Fatalf("patch boot: %d", st)
	}
	if st, _, _ := e.do(t, "PATCH", sys, patch, true, "If-Match", etag); st != 412 {
		t.Errorf("patch with a stale ETag: %d, want 412", st)
	}
	for name, bad := range map[string]any{
		"bad target":    map[string]any{"Boot": map[string]string{"BootSourceOverrideTarget": "Floppy"}},
		"read only":     map[string]any{"PowerState": "On"},
		"wrong type":    map[string]any{"Boot": map[string]any{"BootSourceOverrideEnabled": 1}},
		"unknown field": map[string]any{"Boot": map[string]string{"BootOrder": "x"}},
	} {
		st, _, body := e.do(t, "PATCH", sys, bad, true)
		if st != 400 || body["error"] == nil {
			t.Errorf("%s: %d %v, want 400 with a Redfish error", name, st, body)
		}
	}
	reset := sys + "/Actions/ComputerSystem.Reset"
	if st, _, _ := e.do(t, "POST", reset, map[string]string{"ResetType": "Nmi"}, true); st != 400 {
		t.Errorf("reset Nmi: %d, want 400", st)
	}
	if st, _, _ := e.do(t, "POST", reset, map[string]string{"ResetType": "ForceOff"}, true); st != 409 {
		t.Errorf("ForceOff when off: %d, want 409", st)
	}
	if st, _, _ := e.do(t, "POST", reset, map[string]string{"ResetType": "On"}, true); st != 204 {
		t.Fatalf("reset On: %d", st)
	}
	if st, _, _ := e.do(t, "POST", reset, map[string]string{"ResetType": "On"}, true); st != 409 {
		t.Errorf("On when on: %d, want 409", st)
	}
	_, _, body := e.do(t, "GET", sys, nil, true)
	boot := body["Boot"].(map[string]any)
	if body["PowerState"] != "On" || boot["BootSourceOverrideEnabled"] != "Disabled" || boot["BootSourceOverrideTarget"] != "None" {
		t.Errorf("after boot: power %v override %v/%v, want On Disabled/None", body["PowerState"], boot["BootSourceOverrideEnabled"], boot["BootSourceOverrideTarget"])
	}
	if st, _, _ := e.do(t, "POST", reset, map[string]string{"ResetType": "ForceRestart"}, true); st != 204 {
		t.Fatalf("ForceRestart: %d", st)
	}
	if !slices.Equal(boots, []string{"Pxe", "Hdd"}) {
		t.Errorf("boots %v, want [Pxe Hdd]", boots)
	}
	var kinds []string
	for _, a := range e.bmc.Actions() {
		kinds = append(kinds, a.Kind+":"+a.Detail)
	}
	want := []string{"BootOverride:Once/Pxe", "Reset:On", "Boot:Pxe", "Reset:ForceRestart", "PowerOff:ForceRestart", "Boot:Hdd"}
	if !slices.Equal(kinds, want) {
		t.Errorf("actions %v, want %v", kinds, want)
	}
	_, _, info := e.do(t, "GET", sys+"/ResetActionInfo", nil, true)
	params, _ := info["Parameters"].([]any)
	if len(params) != 1 || len(params[0].(map[string]any)["AllowableValues"].([]any)) != 5 {
		t.Errorf("ResetActionInfo parameters %v", params)
	}
}

func TestFaults(t *testing.T) {
	t.Parallel()
	e := setup(t, fakebmc.Config{})
	e.bmc.FailNext(2)
	for i := range 2 {
		st, _, body := e.do(t, "GET", "/redfish/v1/", nil, false)
		if st != 503 || body["error"] == nil {
			t.Errorf("request %d: %d, want 503 with a Redfish error", i, st)
		}
	}
	if st, _, _ := e.do(t, "GET", "/redfish/v1/", nil, false); st != 200 {
		t.Errorf("after the faults: %d", st)
	}
	if st, _, _ := e.do(t, "GET", "/redfish/v1/Nope", nil, true); st != 404 {
		t.Errorf("unknown path: %d", st)
	}
	if st, hdr, _ := e.do(t, "DELETE", "/redfish/v1/Systems/1", nil, true); st != 405 || hdr.Get("Allow") == "" {
		t.Errorf("DELETE system: %d, want 405 with Allow", st)
	}
	if _, err := fakebmc.New(fakebmc.Config{Username: user}); err == nil {
		t.Error("New without a password succeeded")
	}
}
