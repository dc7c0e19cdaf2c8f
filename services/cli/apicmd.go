package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"gopkg.in/yaml.v3"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/version"
	"github.com/bettercompute/bettercompute/proto/client"
	"github.com/bettercompute/bettercompute/proto/openapi"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// The client's environment variables and defaults (docs/cli.md).
const (
	EnvURL          = "BETTER_COMPUTE_URL"
	EnvToken        = "BETTER_COMPUTE_TOKEN"
	EnvClientConfig = "BETTER_COMPUTE_CONFIG"
	DefaultURL      = "http://127.0.0.1:8080"
	apiPrefix       = "/api/compute/"
	maxAnswerBytes  = 64 << 20
)

type apiFlags struct {
	url, token, clientConfig string
	timeout                  time.Duration
}

func newAPI(stdout, stderr io.Writer) *cobra.Command {
	f := &apiFlags{}
	cmd := &cobra.Command{
		Use:   "api <group>.<method> [field=string | field:=json ...]",
		Short: "Call an API method over REST and print its JSON answer",
		Args:  cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				cmd.HelpFunc()(cmd, args)
				return nil
			}
			return runAPICall(cmd.Context(), f, args, cmd.InOrStdin(), stdout, stderr)
		},
	}
	defaultHelp := cmd.HelpFunc()
	cmd.SetHelpFunc(func(c *cobra.Command, args []string) {
		c.Long = apiHelp(c.Flags().Args())
		defaultHelp(c, args)
	})
	fl := cmd.Flags()
	fl.StringVar(&f.url, "url", "", "API base URL (default $"+EnvURL+", client.url, "+DefaultURL+")")
	fl.StringVar(&f.token, "token", "", "API key sent as a bearer token (default $"+EnvToken+", client.token)")
	fl.StringVar(&f.clientConfig, "client-config", "", "client config file (default $"+EnvClientConfig+", ~/.config/better-compute/client.yaml)")
	fl.DurationVar(&f.timeout, "timeout", 30*time.Second, "how long to wait for the answer")
	return cmd
}

// runAPICall validates the method and arguments, resolves the endpoint and
// credential, POSTs the body and prints the answer.
func runAPICall(ctx context.Context, f *apiFlags, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	cat, err := loadCatalog()
	if err != nil {
		return err
	}
	m, err := cat.lookup(args[0])
	if err != nil {
		return err
	}
	body, err := buildBody(args[1:], stdin)
	if err != nil {
		return err
	}
	cc, err := resolveClient(f, os.Getenv)
	if err != nil {
		return err
	}
	endpoint := strings.TrimRight(cc.URL, "/") + apiPrefix + m.group + "/" + m.method

	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(body))
	if err != nil {
		return fault.Wrap(err, fault.InvalidConfig, "client.url", "%v", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "better-compute/"+version.Get().Version)
	if cc.Token != "" {
		req.Header.Set("Authorization", "Bearer "+cc.Token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("no answer from %s within %s", endpoint, f.timeout)
		}
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("cannot reach the API at %s: %w", endpoint, err)
	}
	defer func() { _ = resp.Body.Close() }()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes))
	if err != nil {
		return fmt.Errorf("reading the answer of %s: %w", endpoint, err)
	}
	if resp.StatusCode/100 == 2 {
		_, err := stdout.Write(indentJSON(answer))
		if resp.Header.Get("Deprecation") != "" {
			cat.warnDeprecated(stderr, m, body)
		}
		return err
	}
	env := envelopeOfAnswer(resp, answer)
	enc := json.NewEncoder(stderr)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	_ = enc.Encode(env)
	if resp.Header.Get("Deprecation") != "" {
		cat.warnDeprecated(stderr, m, body)
	}
	return &apiCallError{method: m.name, status: resp.StatusCode, env: env}
}

// warnDeprecated tells the user, on stderr, that the server answered
// "Deprecation: true": the request named a field by a name accepted for
// one release only. It names each such field of body the catalog marks
// "Deprecated:" and what to send instead.
func (c *apiCatalog) warnDeprecated(stderr io.Writer, m *apiMethod, body []byte) {
	var sent map[string]json.RawMessage
	_ = json.Unmarshal(body, &sent)
	named := false
	if req := c.resolve(m.request); req != nil {
		for _, p := range req.Properties {
			if _, ok := sent[p.name]; ok && strings.HasPrefix(p.s.Description, "Deprecated:") {
				fmt.Fprintf(stderr, "warning: %s: field %s is deprecated (%s)\n", m.name, p.name, oneLine(strings.TrimSpace(strings.TrimPrefix(p.s.Description, "Deprecated:"))))
				named = true
			}
		}
	}
	if !named {
		fmt.Fprintf(stderr, "warning: %s: the request used a deprecated field name (see better-compute api %s --help)\n", m.name, m.name)
	}
}

// apiCallError is a call the server refused; its envelope is already on
// stderr, so the message is a one-line summary.
type apiCallError struct {
	method string
	status int
	env    client.Envelope
}

func (e *apiCallError) Error() string {
	return fmt.Sprintf("%s answered %s (HTTP %d)", e.method, e.env.Code, e.status)
}

// indentJSON indents a JSON answer, keeping the server's field order, and
// ends it with a newline; anything else is returned as is.
func indentJSON(b []byte) []byte {
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		out.Reset()
		out.Write(b)
	}
	if out.Len() > 0 && !bytes.HasSuffix(out.Bytes(), []byte("\n")) {
		out.WriteByte('\n')
	}
	return out.Bytes()
}

// envelopeOfAnswer reads the error envelope of a failed answer, or makes one
// from the HTTP status when the body is not an envelope (a proxy's page).
func envelopeOfAnswer(resp *http.Response, body []byte) client.Envelope {
	var env client.Envelope
	if err := json.Unmarshal(body, &env); err == nil && env.Code != "" {
		return env
	}
	msg := resp.Status
	if snippet := strings.TrimSpace(string(body)); snippet != "" {
		if len(snippet) > 200 {
			snippet = strings.ToValidUTF8(snippet[:200], "") + "…"
		}
		msg += ": " + snippet
	}
	return client.Envelope{Code: codeOfHTTP(resp.StatusCode), Message: msg}
}

func codeOfHTTP(status int) client.Code {
	switch status {
	case http.StatusUnauthorized:
		return client.CodeUnauthenticated
	case http.StatusForbidden:
		return client.CodeAccessDenied
	case http.StatusNotFound:
		return client.CodeNotFound
	case http.StatusConflict:
		return client.CodeConflict
	case http.StatusTooManyRequests:
		return client.CodeRateLimited
	case http.StatusNotImplemented:
		return client.CodeUnsupported
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return client.CodeUnavailable
	}
	if status >= 400 && status < 500 {
		return client.CodeInvalidInput
	}
	return client.CodeInternal
}

// --- URL, token and the client config file ---

// clientConfig is where the api command sends its calls and with which
// credential.
type clientConfig struct {
	URL   string `yaml:"url"`
	Token string `yaml:"token"`
}

// clientFile is the client config file: one `client:` section.
type clientFile struct {
	Client clientConfig `yaml:"client"`
}

// resolveClient resolves the URL and token: the flag, else the environment,
// else the client config file, else (URL only) DefaultURL.
func resolveClient(f *apiFlags, getenv func(string) string) (clientConfig, error) {
	file, path, err := readClientFile(f.clientConfig, getenv)
	if err != nil {
		return clientConfig{}, err
	}
	pick := func(flagName, flagVal, env, fileVal, def string) (string, string) {
		switch {
		case flagVal != "":
			return flagVal, "--" + flagName
		case getenv(env) != "":
			return getenv(env), env
		case fileVal != "":
			return fileVal, path
		}
		return def, "the default"
	}
	var cc clientConfig
	var from string
	cc.URL, from = pick("url", f.url, EnvURL, file.URL, DefaultURL)
	cc.Token, _ = pick("token", f.token, EnvToken, file.Token, "")
	u, err := url.Parse(cc.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return clientConfig{}, fault.New(fault.InvalidConfig, "client.url",
			"expected an http:// or https:// base URL such as %s, got %q (from %s)", DefaultURL, cc.URL, from)
	}
	if strings.ContainsFunc(cc.Token, func(r rune) bool { return r < 0x21 || r == 0x7f }) {
		return clientConfig{}, fault.New(fault.InvalidConfig, "client.token", "the token contains a space or control character")
	}
	return cc, nil
}

// readClientFile reads the client config file: --client-config, else
// $BETTER_COMPUTE_CONFIG (either must exist), else
// $XDG_CONFIG_HOME/better-compute/client.yaml or
// ~/.config/better-compute/client.yaml when present.
func readClientFile(flagPath string, getenv func(string) string) (clientConfig, string, error) {
	path, explicit := flagPath, true
	if path == "" {
		path = getenv(EnvClientConfig)
	}
	if path == "" {
		explicit = false
		path = defaultClientConfigPath(getenv)
		if path == "" {
			return clientConfig{}, "", nil
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		if !explicit && errors.Is(err, os.ErrNotExist) {
			return clientConfig{}, "", nil
		}
		return clientConfig{}, "", fault.Wrap(err, fault.InvalidConfig, "client", "cannot read the client config file: %v", err)
	}
	var cf clientFile
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&cf); err != nil && !errors.Is(err, io.EOF) {
		return clientConfig{}, "", fault.Wrap(err, fault.InvalidConfig, "client", "%s: %v", path, err)
	}
	return cf.Client, path, nil
}

func defaultClientConfigPath(getenv func(string) string) string {
	dir := getenv("XDG_CONFIG_HOME")
	if dir == "" {
		home := getenv("HOME")
		if home == "" {
			if h, err := os.UserHomeDir(); err == nil {
				home = h
			}
		}
		if home == "" {
			return ""
		}
		dir = filepath.Join(home, ".config")
	}
	return filepath.Join(dir, "better-compute", "client.yaml")
}

// --- the request body ---

// buildBody turns the arguments into the JSON request body, httpie style:
//
//	field=value     a JSON string
//	field:=json     raw JSON
//	field=@file     a file's contents as a string (@- reads stdin)
//	field:=@file    a file's contents as JSON
//
// A dotted field (a.b=v) sets a nested object; `\.` is a literal dot. Every
// problem is a usage error naming the argument.
func buildBody(args []string, stdin io.Reader) ([]byte, error) {
	root := map[string]any{}
	stdinUsed := false
	for _, arg := range args {
		i := strings.IndexByte(arg, '=')
		if i < 0 {
			return nil, serve.Usage(fmt.Errorf("argument %q: expected field=string or field:=json", arg))
		}
		key, val, raw := arg[:i], arg[i+1:], false
		if strings.HasSuffix(key, ":") {
			key, raw = key[:len(key)-1], true
		}
		path, err := splitFieldPath(key)
		if err != nil {
			return nil, serve.Usage(fmt.Errorf("argument %q: %w", arg, err))
		}
		if name, ok := strings.CutPrefix(val, "@"); ok {
			var b []byte
			switch {
			case name == "-" && stdinUsed:
				return nil, serve.Usage(fmt.Errorf("argument %q: stdin is already read by an earlier argument", arg))
			case name == "-":
				stdinUsed = true
				b, err = io.ReadAll(stdin)
			case name == "":
				err = errors.New("expected a file name after @")
			default:
				b, err = os.ReadFile(name)
			}
			if err != nil {
				return nil, serve.Usage(fmt.Errorf("argument %q: %w", arg, err))
			}
			val = string(b)
			if !raw && !utf8.ValidString(val) {
				return nil, serve.Usage(fmt.Errorf("argument %q: the file is not UTF-8 text", arg))
			}
		}
		var v any = val
		if raw {
			if err := checkJSON(val); err != nil {
				return nil, serve.Usage(fmt.Errorf("argument %q: invalid JSON after \":=\": %w", arg, err))
			}
			v = json.RawMessage(val)
		}
		if err := setField(root, path, v); err != nil {
			return nil, serve.Usage(fmt.Errorf("argument %q: %w", arg, err))
		}
	}
	return json.Marshal(root)
}

// checkJSON reports whether s is exactly one JSON value.
func checkJSON(s string) error {
	dec := json.NewDecoder(strings.NewReader(s))
	var v json.RawMessage
	if err := dec.Decode(&v); err != nil {
		if errors.Is(err, io.EOF) {
			return errors.New("empty value")
		}
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("more than one JSON value")
	}
	return nil
}

// splitFieldPath splits a.b.c into its parts; `\.` is a literal dot.
func splitFieldPath(key string) ([]string, error) {
	if key == "" {
		return nil, errors.New("empty field name")
	}
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(key); i++ {
		switch {
		case key[i] == '\\' && i+1 < len(key) && key[i+1] == '.':
			cur.WriteByte('.')
			i++
		case key[i] == '.':
			parts = append(parts, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(key[i])
		}
	}
	parts = append(parts, cur.String())
	if slices.Contains(parts, "") {
		return nil, fmt.Errorf("field %q has an empty part", key)
	}
	return parts, nil
}

func setField(root map[string]any, path []string, v any) error {
	m := root
	for i, p := range path[:len(path)-1] {
		switch next := m[p].(type) {
		case nil:
			n := map[string]any{}
			m[p] = n
			m = n
		case map[string]any:
			m = next
		default:
			return fmt.Errorf("%s is already set to a value, not an object", strings.Join(path[:i+1], "."))
		}
	}
	last := path[len(path)-1]
	switch m[last].(type) {
	case nil:
		m[last] = v
		return nil
	case map[string]any:
		return fmt.Errorf("%s is already an object set by a dotted field", strings.Join(path, "."))
	}
	return fmt.Errorf("%s is given twice", strings.Join(path, "."))
}

// --- the method catalog, from the embedded OpenAPI document ---

type apiMethod struct {
	name          string // group.method
	group, method string
	summary       string
	description   string
	request       *schema
}

type apiCatalog struct {
	methods []apiMethod // sorted by name
	defs    map[string]*schema
}

// schema is the part of an OpenAPI v2 schema the help reads.
type schema struct {
	Ref                  string          `json:"$ref"`
	Type                 string          `json:"type"`
	Format               string          `json:"format"`
	Title                string          `json:"title"`
	Description          string          `json:"description"`
	Properties           orderedSchemas  `json:"properties"`
	Items                *schema         `json:"items"`
	Enum                 []string        `json:"enum"`
	Required             []string        `json:"required"`
	AdditionalProperties json.RawMessage `json:"additionalProperties"`
}

// orderedSchemas keeps properties in the document's order (the .proto's).
type orderedSchemas []namedSchema

type namedSchema struct {
	name string
	s    *schema
}

func (o *orderedSchemas) UnmarshalJSON(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	if _, err := dec.Token(); err != nil {
		return err
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		name, _ := tok.(string)
		var s schema
		if err := dec.Decode(&s); err != nil {
			return err
		}
		*o = append(*o, namedSchema{name, &s})
	}
	return nil
}

// loadCatalog reads every POST /api/compute/{group}/{method} of the embedded
// OpenAPI document, so new groups need no change here.
func loadCatalog() (*apiCatalog, error) { return parseCatalog(openapi.Document()) }

func parseCatalog(document []byte) (*apiCatalog, error) {
	var doc struct {
		Paths map[string]map[string]struct {
			Summary     string `json:"summary"`
			Description string `json:"description"`
			Parameters  []struct {
				In     string  `json:"in"`
				Schema *schema `json:"schema"`
			} `json:"parameters"`
		} `json:"paths"`
		Definitions map[string]*schema `json:"definitions"`
	}
	if err := json.Unmarshal(document, &doc); err != nil {
		return nil, fmt.Errorf("the embedded OpenAPI document: %w", err)
	}
	cat := &apiCatalog{defs: doc.Definitions}
	for path, ops := range doc.Paths {
		rest, ok := strings.CutPrefix(path, apiPrefix)
		group, method, ok2 := strings.Cut(rest, "/")
		op, ok3 := ops["post"]
		if !ok || !ok2 || !ok3 || group == "" || method == "" || strings.ContainsAny(method, "/{") {
			continue
		}
		m := apiMethod{name: group + "." + method, group: group, method: method, summary: op.Summary, description: op.Description}
		for _, p := range op.Parameters {
			if p.In == "body" {
				m.request = p.Schema
			}
		}
		cat.methods = append(cat.methods, m)
	}
	sort.Slice(cat.methods, func(i, j int) bool { return cat.methods[i].name < cat.methods[j].name })
	return cat, nil
}

// lookup finds a method by group.method; an unknown one is a usage error
// that suggests close names.
func (c *apiCatalog) lookup(name string) (*apiMethod, error) {
	for i := range c.methods {
		if c.methods[i].name == name {
			return &c.methods[i], nil
		}
	}
	msg := fmt.Sprintf("unknown API method %q", name)
	if s := c.suggest(name); len(s) > 0 {
		msg += "; did you mean " + strings.Join(s, ", ") + "?"
	}
	return nil, serve.Usage(errors.New(msg + " (`better-compute api --help` lists them)"))
}

// suggest returns up to five methods close to name: the same name in another
// case, the methods of a group named alone, then the nearest by edit
// distance.
func (c *apiCatalog) suggest(name string) []string {
	lower := strings.ToLower(name)
	var out []string
	for _, m := range c.methods {
		if strings.ToLower(m.name) == lower {
			return []string{m.name}
		}
	}
	group := strings.ToLower(strings.TrimSuffix(name, "."))
	for _, m := range c.methods {
		if strings.ToLower(m.group) == group {
			out = append(out, m.name)
		}
	}
	if len(out) > 0 {
		return out[:min(len(out), 5)]
	}
	type cand struct {
		name string
		d    int
	}
	var cands []cand
	limit := max(2, utf8.RuneCountInString(name)/3)
	for _, m := range c.methods {
		d := editDistance(lower, strings.ToLower(m.name))
		if _, meth, _ := strings.Cut(lower, "."); meth != "" && strings.EqualFold(meth, m.method) {
			d = min(d, limit) // the right method in a mistyped group
		}
		if d <= limit {
			cands = append(cands, cand{m.name, d})
		}
	}
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].d < cands[j].d })
	for _, cd := range cands[:min(len(cands), 5)] {
		out = append(out, cd.name)
	}
	return out
}

// editDistance is the Levenshtein distance between a and b, in runes.
func editDistance(a, b string) int {
	ra, rb := []rune(a), []rune(b)
	prev := make([]int, len(rb)+1)
	cur := make([]int, len(rb)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(ra); i++ {
		cur[0] = i
		for j := 1; j <= len(rb); j++ {
			cost := 1
			if ra[i-1] == rb[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(rb)]
}

// --- help ---

const apiHelpIntro = `Call one API method over REST: POST <url>/api/compute/<group>/<method> with a
JSON body built from the arguments, and print the JSON answer on stdout.

Arguments (httpie style):
  field=value      a JSON string               name=gpu-a
  field:=json      raw JSON                    count:=2 labels:='{"zone":"a"}'
  field=@file      a file's contents, string   text=@policy.cedar (@- reads stdin)
  field:=@file     a file's contents, JSON     spec:=@spec.json
  a.b=value        a nested object             spec.gpus:=2 (\. is a literal dot)

The URL is --url, else $BETTER_COMPUTE_URL, else client.url in the client config
file, else ` + DefaultURL + `. The API key is --token, else $BETTER_COMPUTE_TOKEN,
else client.token. The client config file is --client-config, else
$BETTER_COMPUTE_CONFIG, else ~/.config/better-compute/client.yaml:

  client:
    url: https://compute.example.com
    token: bck_<id>.<secret>

A refused call prints the error envelope {"code","message","field"} on stderr
and exits 1; a bad argument, an unknown method or a bad client config exits 2.
`

// apiHelp is the api command's long help: the method list, or one method's
// fields when args name one.
func apiHelp(args []string) string {
	cat, err := loadCatalog()
	if err != nil {
		return apiHelpIntro + "\n" + err.Error() + "\n"
	}
	if len(args) > 0 {
		m, err := cat.lookup(args[0])
		if err == nil {
			return cat.methodHelp(m)
		}
		return err.Error() + "\n\n" + apiHelpIntro + cat.methodList()
	}
	return apiHelpIntro + cat.methodList()
}

func (c *apiCatalog) methodList() string {
	var b strings.Builder
	b.WriteString("\nMethods:\n")
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	for _, m := range c.methods {
		fmt.Fprintf(tw, "  %s\t%s\n", m.name, oneLine(firstNonEmpty(m.summary, m.description)))
	}
	_ = tw.Flush()
	b.WriteString("\n`better-compute api <group>.<method> --help` shows a method's fields.")
	return b.String()
}

func (c *apiCatalog) methodHelp(m *apiMethod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: POST %s%s/%s\n\n", m.name, apiPrefix, m.group, m.method)
	if text := strings.TrimSpace(strings.Join([]string{m.summary, m.description}, "\n\n")); text != "" {
		b.WriteString(text + "\n\n")
	}
	req := c.resolve(m.request)
	name := ""
	if m.request != nil {
		name = strings.TrimPrefix(m.request.Ref, "#/definitions/")
	}
	if req == nil || len(req.Properties) == 0 {
		fmt.Fprintf(&b, "The request (%s) has no fields: the body is {}.", name)
		return b.String()
	}
	note := ""
	if len(req.Required) > 0 {
		note = "; * required"
	}
	fmt.Fprintf(&b, "Request fields (%s%s):\n", name, note)
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	for _, p := range req.Properties {
		mark := " "
		if slices.Contains(req.Required, p.name) {
			mark = "*"
		}
		fmt.Fprintf(tw, " %s%s\t%s\t%s\n", mark, p.name, c.typeName(p.s), oneLine(firstNonEmpty(p.s.Description, p.s.Title, c.resolve(p.s).Description)))
	}
	_ = tw.Flush()
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, " ")
	}
	return strings.Join(lines, "\n")
}

// resolve follows a $ref into the definitions.
func (c *apiCatalog) resolve(s *schema) *schema {
	for i := 0; s != nil && s.Ref != "" && i < 8; i++ {
		s = c.defs[strings.TrimPrefix(s.Ref, "#/definitions/")]
	}
	return s
}

// typeName describes a field's JSON type in a few words.
func (c *apiCatalog) typeName(s *schema) string {
	r := c.resolve(s)
	if r == nil {
		return "any"
	}
	switch {
	case len(r.Enum) > 0:
		vals := slices.DeleteFunc(slices.Clone(r.Enum), func(v string) bool { return strings.HasSuffix(v, "_UNSPECIFIED") })
		return "enum " + strings.Join(vals, "|")
	case r.Type == "array":
		return "array of " + c.typeName(r.Items)
	case r.Type == "object" && len(r.AdditionalProperties) > 0 && r.AdditionalProperties[0] == '{':
		var v schema
		if json.Unmarshal(r.AdditionalProperties, &v) == nil {
			return "map of " + c.typeName(&v)
		}
	case s.Ref != "":
		return "object " + strings.TrimPrefix(s.Ref, "#/definitions/")
	case r.Format != "":
		return r.Format
	case r.Type != "":
		return r.Type
	}
	return "object"
}

func firstNonEmpty(ss ...string) string {
	for _, s := range ss {
		if strings.TrimSpace(s) != "" {
			return s
		}
	}
	return ""
}

// oneLine is the first sentence of a comment, on one line and at most 120
// characters.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if i := strings.Index(s, ". "); i >= 0 {
		s = s[:i+1]
	}
	if utf8.RuneCountInString(s) > 120 {
		r := []rune(s)[:119]
		if i := strings.LastIndexByte(string(r), ' '); i > 60 {
			return string(r)[:i] + "…"
		}
		return string(r) + "…"
	}
	return s
}
