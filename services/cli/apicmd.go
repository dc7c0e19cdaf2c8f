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
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/version"
	"github.com/bettercompute/bettercompute/proto/client"
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
