package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// startAPIServer starts the real control plane (the api role) on a free port
// against its own database and returns its address.
func startAPIServer(t *testing.T) string {
	t.Helper()
	port := 0
	cfg := &config.Config{Database: config.Database{URL: pgtest.NewDB(t)}, Server: config.Server{Host: "127.0.0.1", Port: &port}}
	cfg.Defaults()
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	return a.Addr()
}

// emptyClientConfig is an empty client config file, so that a developer's
// ~/.config/better-compute/client.yaml cannot change a test.
func emptyClientConfig(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "client.yaml")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// execCLI runs better-compute with args and returns the exit code and output.
func execCLI(t *testing.T, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	root := NewRoot(&out, &errb)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	code = serve.Report(&errb, root.ExecuteContext(t.Context()))
	return code, out.String(), errb.String()
}

// splitEnvelope parses the envelope the api command prints on stderr before
// Report's one-line summary.
func splitEnvelope(t *testing.T, stderr string) (client.Envelope, string) {
	t.Helper()
	i := strings.LastIndex(stderr, "\nerror: ")
	if i < 0 {
		t.Fatalf("no error line in stderr:\n%s", stderr)
	}
	var env client.Envelope
	dec := json.NewDecoder(strings.NewReader(stderr[:i]))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil {
		t.Fatalf("stderr does not start with an envelope (%v):\n%s", err, stderr)
	}
	return env, strings.TrimSpace(stderr[i:])
}

func TestAPICommandAgainstTheServer(t *testing.T) {
	t.Parallel()
	addr := startAPIServer(t)
	base := "http://" + addr
	cfgFile := emptyClientConfig(t)

	t.Run("system.version prints the answer", func(t *testing.T) {
		t.Parallel()
		code, out, stderr := execCLI(t, "", "api", "system.version", "--url", base, "--client-config", cfgFile)
		if code != serve.ExitOK {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
		var v struct{ Version, SchemaVersion, RequiredSchemaVersion string }
		if err := json.Unmarshal([]byte(out), &v); err != nil || v.Version == "" || v.SchemaVersion != v.RequiredSchemaVersion {
			t.Fatalf("answer %q (%v)", out, err)
		}
		if !strings.HasPrefix(out, "{\n  \"version\": ") || !strings.HasSuffix(out, "}\n") {
			t.Fatalf("the answer is not indented in the server's order:\n%s", out)
		}
	})

	t.Run("system.health through the config file, base URL with a slash", func(t *testing.T) {
		t.Parallel()
		p := filepath.Join(t.TempDir(), "client.yaml")
		if err := os.WriteFile(p, []byte("client:\n  url: "+base+"/\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		code, out, stderr := execCLI(t, "", "api", "system.health", "--client-config", p)
		if code != serve.ExitOK || !strings.Contains(out, `"status": "HEALTH_STATUS_OK"`) {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
	})

	t.Run("a refused call prints the envelope and exits 1", func(t *testing.T) {
		t.Parallel()
		code, out, stderr := execCLI(t, "", "api", "system.version", "bogus=1", "--url", base, "--client-config", cfgFile)
		if code != serve.ExitError || out != "" {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
		env, summary := splitEnvelope(t, stderr)
		if env.Code != client.CodeInvalidInput || !strings.Contains(env.Message, "bogus") {
			t.Fatalf("envelope %+v", env)
		}
		if summary != "error: system.version answered INVALID_INPUT (HTTP 400)" {
			t.Fatalf("summary %q", summary)
		}
	})

	t.Run("a URL where no API answers still gives an envelope", func(t *testing.T) {
		t.Parallel()
		// A wrong base path: the server's plain-text 404, not an envelope,
		// so the CLI makes one from the HTTP status.
		code, _, stderr := execCLI(t, "", "api", "system.version", "--url", base+"/nowhere", "--client-config", cfgFile)
		env, _ := splitEnvelope(t, stderr)
		if code != serve.ExitError || env.Code != client.CodeNotFound {
			t.Fatalf("exit %d: %+v\n%s", code, env, stderr)
		}
	})

	t.Run("proto/client over gRPC", func(t *testing.T) {
		t.Parallel()
		for _, target := range []string{addr, "http://" + addr} {
			conn, err := client.Dial(t.Context(), target, client.WithInsecure())
			if err != nil {
				t.Fatal(err)
			}
			v, err := computev1.NewSystemServiceClient(conn).Version(t.Context(), &computev1.VersionRequest{})
			if err != nil || v.GetVersion() == "" || v.GetSchemaVersion() == 0 {
				t.Fatalf("%s: Version = %v, %v", target, v, err)
			}
			err = conn.Invoke(t.Context(), "/bettercompute.compute.v1.SystemService/Nope", &emptypb.Empty{}, &emptypb.Empty{})
			if env := client.EnvelopeOf(err); env.Code != client.CodeUnsupported {
				t.Fatalf("unknown method: %+v (%v)", env, err)
			}
			_ = conn.Close()
		}
	})
}

// TestClientEnvelopeMatchesTheServer checks proto/client reads what
// services/api writes, and knows every code.
func TestClientEnvelopeMatchesTheServer(t *testing.T) {
	t.Parallel()
	var codes []client.Code
	for _, info := range fault.Codes {
		codes = append(codes, client.Code(info.Code))
		for _, field := range []string{"", "spec.gpus"} {
			st := fault.ToStatus(fault.New(info.Code, field, "something about %s", info.Code))
			want := api.FromStatus(st)
			got := client.EnvelopeOf(st.Err())
			if string(got.Code) != string(want.Code) || got.Message != want.Message || got.Field != want.Field {
				t.Errorf("EnvelopeOf = %+v, the server's FromStatus = %+v", got, want)
			}
		}
	}
	if !slices.Equal(codes, client.Codes) {
		t.Errorf("client.Codes = %v, fault.Codes = %v", client.Codes, codes)
	}
}

// TestAPIRequest checks what the command sends: the server's method
// handling is tested above, against the real server; this recorder only
// captures the request.
func TestAPIRequest(t *testing.T) {
	t.Parallel()
	var (
		mu      sync.Mutex
		got     *http.Request
		gotBody []byte
	)
	last := func() (*http.Request, []byte) {
		mu.Lock()
		defer mu.Unlock()
		return got, gotBody
	}
	rec := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got, gotBody = r, b
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"b":1,"a":[]}`)
	}))
	defer rec.Close()

	code, out, stderr := execCLI(t, "policy text", "api", "system.version", "--url", rec.URL+"/prefix/", "--token", "bck_id.secret",
		"--client-config", emptyClientConfig(t), "tenantId=acme", "labels.zone=a", "count:=2", "body=@-")
	if code != serve.ExitOK || out != "{\n  \"b\": 1,\n  \"a\": []\n}\n" {
		t.Fatalf("exit %d\n%q%s", code, out, stderr)
	}
	req, body := last()
	if req.Method != http.MethodPost || req.URL.Path != "/prefix/api/compute/system/version" ||
		req.Header.Get("Authorization") != "Bearer bck_id.secret" || req.Header.Get("Content-Type") != "application/json" ||
		!strings.HasPrefix(req.Header.Get("User-Agent"), "better-compute/") {
		t.Fatalf("request %s %s %v", req.Method, req.URL, req.Header)
	}
	if string(body) != `{"body":"policy text","count":2,"labels":{"zone":"a"},"tenantId":"acme"}` {
		t.Fatalf("body %s", body)
	}

	// Without a token, no Authorization header.
	code, _, stderr = execCLI(t, "", "api", "system.version", "--url", rec.URL, "--client-config", emptyClientConfig(t))
	req, _ = last()
	if code != serve.ExitOK || req.Header.Get("Authorization") != "" {
		t.Fatalf("exit %d %s, Authorization %q", code, stderr, req.Header.Get("Authorization"))
	}
}

func TestAPIUnreachable(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + lis.Addr().String()
	_ = lis.Close()
	code, out, stderr := execCLI(t, "", "api", "system.version", "--url", base, "--client-config", emptyClientConfig(t))
	want := "error: cannot reach the API at " + base + "/api/compute/system/version: "
	if code != serve.ExitError || out != "" || !strings.HasPrefix(stderr, want) || !strings.Contains(stderr, "refused") {
		t.Fatalf("exit %d\n%s%s", code, out, stderr)
	}
}

func TestAPIUsageErrors(t *testing.T) {
	t.Parallel()
	cfgFile := emptyClientConfig(t)
	badFile := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(badFile, []byte("client:\n  urll: http://x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Nothing listens at this URL: each case fails before calling it.
	const url = "http://127.0.0.1:1"
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"misspelt method", []string{"system.verison"}, `unknown API method "system.verison"; did you mean system.version?`},
		{"group alone", []string{"system"}, `did you mean system.health, system.version`},
		{"wrong case", []string{"System.Version"}, `did you mean system.version?`},
		{"misspelt group", []string{"sytsem.health"}, `did you mean system.health?`},
		{"nothing close", []string{"zzzz.qqqq"}, `unknown API method "zzzz.qqqq" (` + "`better-compute api --help`"},
		{"no separator", []string{"system.version", "tenantId"}, `argument "tenantId": expected field=string or field:=json`},
		{"bad JSON", []string{"system.version", `payload:={"a":`}, `argument "payload:={\"a\":": invalid JSON after ":="`},
		{"empty field", []string{"system.version", "=x"}, `argument "=x": empty field name`},
		{"flag", []string{"system.version", "--bogus"}, "unknown flag: --bogus"},
		{"bad URL", []string{"system.version", "--url", "127.0.0.1:8080"}, `INVALID_CONFIG client.url: expected an http:// or https:// base URL such as http://127.0.0.1:8080, got "127.0.0.1:8080" (from --url)`},
		{"missing config file", []string{"system.version", "--client-config", "/nonexistent/client.yaml"}, "INVALID_CONFIG client: cannot read the client config file"},
		{"bad config file", []string{"system.version", "--client-config", badFile}, "INVALID_CONFIG client: " + badFile + ": yaml: unmarshal errors:\n  line 2: field urll not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			args := append([]string{"api"}, tc.args...)
			if !slices.Contains(tc.args, "--url") {
				args = append(args, "--url", url)
			}
			if !slices.Contains(tc.args, "--client-config") {
				args = append(args, "--client-config", cfgFile)
			}
			code, out, stderr := execCLI(t, "", args...)
			if code != serve.ExitConfig || out != "" || !strings.Contains(stderr, tc.want) {
				t.Fatalf("exit %d\nstdout: %s\nstderr: %s\nwant exit %d and %q", code, out, stderr, serve.ExitConfig, tc.want)
			}
		})
	}
}

func TestAPIHelpListsTheMethods(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"api", "--help"}, {"api"}, {"help", "api"}} {
		code, out, stderr := execCLI(t, "", args...)
		if code != serve.ExitOK || stderr != "" {
			t.Fatalf("%v: exit %d\n%s", args, code, stderr)
		}
		collapsed := strings.Join(strings.Fields(out), " ")
		for _, want := range []string{
			"Methods: ",
			" system.version Version returns the build information of the serving binary",
			" system.health Health reports",
			"BETTER_COMPUTE_URL", "BETTER_COMPUTE_TOKEN", "BETTER_COMPUTE_CONFIG", "--url", "--token",
		} {
			if !strings.Contains(collapsed, want) {
				t.Fatalf("%v lacks %q:\n%s", args, want, out)
			}
		}
	}
	// Every method of the document is listed.
	cat, err := loadCatalog()
	if err != nil || len(cat.methods) < 2 {
		t.Fatalf("catalog: %v, %v", cat, err)
	}
	_, out, _ := execCLI(t, "", "api", "--help")
	for _, m := range cat.methods {
		if !strings.Contains(out, "  "+m.name+" ") {
			t.Errorf("help lacks %s", m.name)
		}
	}

	code, out, _ := execCLI(t, "", "api", "system.version", "--help")
	if code != serve.ExitOK || !strings.HasPrefix(out, "system.version: POST /api/compute/system/version\n\nVersion returns") ||
		!strings.Contains(out, "The request (VersionRequest) has no fields") {
		t.Fatalf("method help: exit %d\n%s", code, out)
	}
}

func TestMethodHelpDescribesFields(t *testing.T) {
	t.Parallel()
	doc := `{"paths": {
	  "/api/compute/pools/create": {"post": {"summary": "Create creates a pool. It is long.\nSecond line.",
	    "parameters": [{"name": "body", "in": "body", "schema": {"$ref": "#/definitions/CreatePoolRequest"}}]}},
	  "/api/compute/pools/get": {"post": {"description": "Get returns a pool."}},
	  "/api/compute/openapi.json": {"get": {}},
	  "/healthz": {"post": {}}
	},
	"definitions": {
	  "CreatePoolRequest": {"type": "object", "required": ["tenantId"], "properties": {
	    "tenantId": {"type": "string", "description": "Tenant that owns the pool.\nMore."},
	    "class": {"$ref": "#/definitions/PoolClass"},
	    "labels": {"type": "object", "additionalProperties": {"type": "string"}, "title": "Labels to match"},
	    "hosts": {"type": "array", "items": {"type": "object", "$ref": "#/definitions/Host"}},
	    "gpus": {"type": "integer", "format": "int32"},
	    "spec": {"$ref": "#/definitions/Host"}
	  }},
	  "PoolClass": {"type": "string", "enum": ["POOL_CLASS_UNSPECIFIED", "POOL_CLASS_GPU", "POOL_CLASS_VPS_HOST"], "description": "PoolClass is what a pool holds."},
	  "Host": {"type": "object", "description": "Host is a host."}
	}}`
	cat, err := parseCatalog([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range cat.methods {
		names = append(names, m.name)
	}
	if !slices.Equal(names, []string{"pools.create", "pools.get"}) {
		t.Fatalf("methods %v", names)
	}
	list := cat.methodList()
	if !strings.Contains(list, "  pools.create  Create creates a pool.\n") || !strings.Contains(list, "  pools.get     Get returns a pool.\n") {
		t.Fatalf("list:\n%s", list)
	}
	m, err := cat.lookup("pools.create")
	if err != nil {
		t.Fatal(err)
	}
	help := cat.methodHelp(m)
	if !strings.HasPrefix(help, "pools.create: POST /api/compute/pools/create\n\nCreate creates a pool. It is long.\nSecond line.\n\n") {
		t.Errorf("method help:\n%s", help)
	}
	// Columns aligned; compared with runs of spaces collapsed.
	collapsed := strings.Join(strings.Fields(strings.ReplaceAll(help, "\n", " | ")), " ")
	for _, want := range []string{
		"| Request fields (CreatePoolRequest; * required): |",
		"| *tenantId string Tenant that owns the pool. |",
		"| class enum POOL_CLASS_GPU|POOL_CLASS_VPS_HOST PoolClass is what a pool holds. |",
		"| labels map of string Labels to match |",
		"| hosts array of object Host |",
		"| gpus int32 |",
		"| spec object Host Host is a host.",
	} {
		if !strings.Contains(collapsed, want) {
			t.Errorf("method help lacks %q:\n%s", want, help)
		}
	}
	if strings.Contains(help, " \n") {
		t.Errorf("trailing spaces in:\n%q", help)
	}
	if _, err := cat.lookup("pool.create"); err == nil || !strings.Contains(err.Error(), "did you mean pools.create?") {
		t.Errorf("lookup: %v", err)
	}
}

func TestBuildBody(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	textFile := filepath.Join(dir, "policy.cedar")
	jsonFile := filepath.Join(dir, "spec.json")
	if err := os.WriteFile(textFile, []byte("permit(principal, action, resource);\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(jsonFile, []byte(`{"gpus": 2}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args  []string
		stdin string
		want  string
	}{
		{nil, "", `{}`},
		{[]string{"tenantId=acme", "kind=inventory.refresh"}, "", `{"kind":"inventory.refresh","tenantId":"acme"}`},
		{[]string{`payload:={"sections": ["gpus"]}`, "idempotencyKey=refresh-1"}, "", `{"idempotencyKey":"refresh-1","payload":{"sections":["gpus"]}}`},
		{[]string{"count:=2", "ok:=true", "none:=null", `s:="x"`}, "", `{"count":2,"none":null,"ok":true,"s":"x"}`},
		{[]string{"name=", "eq=a=b", "colon=a:=b", "url=http://x/?a=1"}, "", `{"colon":"a:=b","eq":"a=b","name":"","url":"http://x/?a=1"}`},
		{[]string{"spec.gpus:=2", "spec.labels.zone=a", "spec.name=x"}, "", `{"spec":{"gpus":2,"labels":{"zone":"a"},"name":"x"}}`},
		{[]string{`labels.bettercompute\.io/pool=p1`}, "", `{"labels":{"bettercompute.io/pool":"p1"}}`},
		{[]string{"text=@" + textFile, "spec:=@" + jsonFile}, "", `{"spec":{"gpus":2},"text":"permit(principal, action, resource);\n"}`},
		{[]string{"text=@-"}, "from stdin", `{"text":"from stdin"}`},
		{[]string{"spec:=@-"}, `[1, 2]`, `{"spec":[1,2]}`},
	} {
		got, err := buildBody(tc.args, strings.NewReader(tc.stdin))
		if err != nil || string(got) != tc.want {
			t.Errorf("buildBody(%q) = %s, %v; want %s", tc.args, got, err, tc.want)
		}
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"tenantId"}, `argument "tenantId": expected field=string or field:=json`},
		{[]string{"=v"}, `argument "=v": empty field name`},
		{[]string{":=1"}, `argument ":=1": empty field name`},
		{[]string{"a..b=1"}, `argument "a..b=1": field "a..b" has an empty part`},
		{[]string{".a=1"}, `has an empty part`},
		{[]string{"n:=two"}, `argument "n:=two": invalid JSON after ":=": invalid character 'w'`},
		{[]string{"n:="}, `argument "n:=": invalid JSON after ":=": empty value`},
		{[]string{"n:=1 2"}, `argument "n:=1 2": invalid JSON after ":=": more than one JSON value`},
		{[]string{"a=1", "a=2"}, `argument "a=2": a is given twice`},
		{[]string{"a=1", "a.b=2"}, `argument "a.b=2": a is already set to a value, not an object`},
		{[]string{"a.b=1", "a=2"}, `argument "a=2": a is already an object set by a dotted field`},
		{[]string{"x=@"}, `argument "x=@": expected a file name after @`},
		{[]string{"x=@/nonexistent/f"}, `argument "x=@/nonexistent/f": open /nonexistent/f`},
		{[]string{"x:=@" + textFile}, `invalid JSON after ":="`},
		{[]string{"x=@-", "y=@-"}, `argument "y=@-": stdin is already read`},
	} {
		_, err := buildBody(tc.args, strings.NewReader(""))
		var ue serve.UsageError
		if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.As(err, &ue) {
			t.Errorf("buildBody(%q) = %v; want a usage error with %q", tc.args, err, tc.want)
		}
	}
}

func TestResolveClient(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "client.yaml")
	if err := os.WriteFile(file, []byte("client:\n  url: https://file.example\n  token: bck_file.s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	xdg := filepath.Join(dir, "xdg")
	if err := os.MkdirAll(filepath.Join(xdg, "better-compute"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(xdg, "better-compute", "client.yaml"), []byte("client:\n  url: https://xdg.example\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	home := filepath.Join(dir, "home")
	if err := os.MkdirAll(filepath.Join(home, ".config", "better-compute"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(home, ".config", "better-compute", "client.yaml"), []byte("client:\n  token: bck_home.s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "nohome")

	for _, tc := range []struct {
		name  string
		flags apiFlags
		env   map[string]string
		want  clientConfig
	}{
		{"defaults", apiFlags{}, map[string]string{"HOME": empty}, clientConfig{URL: DefaultURL}},
		{"file from the environment", apiFlags{}, map[string]string{EnvClientConfig: file, "HOME": empty}, clientConfig{URL: "https://file.example", Token: "bck_file.s"}},
		{"file from the flag wins", apiFlags{clientConfig: file}, map[string]string{EnvClientConfig: "/nonexistent", "HOME": empty}, clientConfig{URL: "https://file.example", Token: "bck_file.s"}},
		{"environment beats the file", apiFlags{clientConfig: file}, map[string]string{EnvURL: "http://env:1", EnvToken: "bck_env.s"}, clientConfig{URL: "http://env:1", Token: "bck_env.s"}},
		{"flags beat everything", apiFlags{clientConfig: file, url: "http://flag", token: "bck_flag.s"}, map[string]string{EnvURL: "http://env:1", EnvToken: "bck_env.s"}, clientConfig{URL: "http://flag", Token: "bck_flag.s"}},
		{"XDG_CONFIG_HOME", apiFlags{}, map[string]string{"XDG_CONFIG_HOME": xdg, "HOME": home}, clientConfig{URL: "https://xdg.example"}},
		{"~/.config", apiFlags{}, map[string]string{"HOME": home}, clientConfig{URL: DefaultURL, Token: "bck_home.s"}},
	} {
		got, err := resolveClient(&tc.flags, func(k string) string { return tc.env[k] })
		if err != nil || got != tc.want {
			t.Errorf("%s: resolveClient = %+v, %v; want %+v", tc.name, got, err, tc.want)
		}
	}

	for _, tc := range []struct {
		flags apiFlags
		env   map[string]string
		want  string
	}{
		{apiFlags{url: "ftp://x"}, nil, `INVALID_CONFIG client.url: expected an http:// or https:// base URL such as http://127.0.0.1:8080, got "ftp://x" (from --url)`},
		{apiFlags{}, map[string]string{EnvURL: "http://"}, `(from BETTER_COMPUTE_URL)`},
		{apiFlags{clientConfig: file}, map[string]string{EnvURL: "http://x?q=1"}, `got "http://x?q=1"`},
		{apiFlags{token: "bck_a b"}, nil, "INVALID_CONFIG client.token: the token contains a space or control character"},
		{apiFlags{}, map[string]string{EnvClientConfig: "/nonexistent/c.yaml"}, "INVALID_CONFIG client: cannot read the client config file: open /nonexistent/c.yaml"},
	} {
		env := map[string]string{"HOME": empty}
		for k, v := range tc.env {
			env[k] = v
		}
		_, err := resolveClient(&tc.flags, func(k string) string { return env[k] })
		if fault.CodeOf(err) != fault.InvalidConfig || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("resolveClient(%+v, %v) = %v; want %q", tc.flags, tc.env, err, tc.want)
		}
	}
}

func TestEnvelopeOfAnswer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status int
		body   string
		want   client.Envelope
	}{
		{http.StatusConflict, `{"code":"CONFLICT","message":"taken","field":"idempotencyKey"}`, client.Envelope{Code: client.CodeConflict, Message: "taken", Field: "idempotencyKey"}},
		{http.StatusBadGateway, "<html>bad gateway</html>\n", client.Envelope{Code: client.CodeUnavailable, Message: "502 Bad Gateway: <html>bad gateway</html>"}},
		{http.StatusUnauthorized, ``, client.Envelope{Code: client.CodeUnauthenticated, Message: "401 Unauthorized"}},
		{http.StatusRequestEntityTooLarge, `{"error":"too big"}`, client.Envelope{Code: client.CodeInvalidInput, Message: `413 Request Entity Too Large: {"error":"too big"}`}},
		{http.StatusInternalServerError, strings.Repeat("x", 300), client.Envelope{Code: client.CodeInternal, Message: "500 Internal Server Error: " + strings.Repeat("x", 200) + "…"}},
	} {
		resp := &http.Response{StatusCode: tc.status, Status: strconv.Itoa(tc.status) + " " + http.StatusText(tc.status)}
		if got := envelopeOfAnswer(resp, []byte(tc.body)); got != tc.want {
			t.Errorf("%d: %+v, want %+v", tc.status, got, tc.want)
		}
	}
	for status, want := range map[int]client.Code{
		http.StatusForbidden: client.CodeAccessDenied, http.StatusNotFound: client.CodeNotFound,
		http.StatusTooManyRequests: client.CodeRateLimited, http.StatusNotImplemented: client.CodeUnsupported,
		http.StatusServiceUnavailable: client.CodeUnavailable, http.StatusGatewayTimeout: client.CodeUnavailable,
	} {
		if got := codeOfHTTP(status); got != want {
			t.Errorf("codeOfHTTP(%d) = %s, want %s", status, got, want)
		}
	}
}

func TestOneLine(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                                 "",
		"Version returns the build.\nMore": "Version returns the build.",
		"Lists pools,\nwith paging":        "Lists pools, with paging",
		strings.Repeat("word ", 40):        strings.TrimSpace(strings.Repeat("word ", 23)) + "…",
	} {
		if got := oneLine(in); got != want {
			t.Errorf("oneLine(%q) = %q, want %q", in, got, want)
		}
	}
}
