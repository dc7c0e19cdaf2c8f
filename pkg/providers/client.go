package providers

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"

	"github.com/bettercompute/bettercompute/pkg/outbound"
	"strconv"
	"strings"
	"time"
)

// ClientConfig configures a [Client]. Zero values take the defaults given.
type ClientConfig struct {
	// Endpoint is the API's base URL ([ValidEndpoint]). Required.
	Endpoint string
	// Token is the bearer token (from the pool's credentials secret).
	// Required; it is sent only in the Authorization header and never
	// appears in an error.
	Token string
	// HTTP is the outbound client (pkg/outbound) the requests go through;
	// the endpoint is checked under its rules. Nil is a client with the
	// production rules (https, public addresses only). Share one: it keeps
	// connections.
	HTTP *outbound.Client
	// Timeout bounds each request (attempt); default 10s.
	Timeout time.Duration
	// Attempts bounds the tries of one call on 429, 5xx and transport
	// errors; default 3.
	Attempts int
	// Backoff is the first pause between tries, doubling; default 200ms.
	// A Retry-After up to MaxRetryAfter replaces it.
	Backoff time.Duration
	// MaxRetryAfter is the longest Retry-After waited for inside a call;
	// a longer one ends the call with ErrRateLimited and the caller comes
	// back later. Default 5s.
	MaxRetryAfter time.Duration
}

// Client is a [Provider] over the provider JSON API:
//
//	POST   {endpoint}/v1/machines            Idempotency-Key: <key>, body CreateRequest → 200/201 Machine
//	GET    {endpoint}/v1/machines/{id}       → 200 Machine, 404
//	POST   {endpoint}/v1/machines/{id}/start → 200/202 Machine
//	POST   {endpoint}/v1/machines/{id}/stop  → 200/202 Machine
//	DELETE {endpoint}/v1/machines/{id}       → 200/202/204, 404 (success)
//
// Every request carries "Authorization: Bearer <token>"; an error answer is
// {"message"}. 404 is ErrNotFound, 409 ErrConflict, 429 ErrRateLimited
// (with Retry-After), 5xx and transport errors ErrTransient, any other 4xx
// ErrRejected; so is a redirect, which is never followed, and a destination
// the outbound rules refuse.
type Client struct {
	base  *url.URL
	token string
	cfg   ClientConfig
}

var _ Provider = (*Client)(nil)

// NewClient returns a client; a bad endpoint or token is an error naming
// which (and never showing the token).
func NewClient(cfg ClientConfig) (*Client, error) {
	if cfg.HTTP == nil {
		cfg.HTTP = outbound.NewClient(outbound.Options{Setting: "providers"})
	}
	if err := ValidEndpoint(cfg.Endpoint, cfg.HTTP.Options()); err != nil {
		return nil, &Error{Kind: ErrRejected, Op: "configure", Class: outbound.ReasonRefused, Message: err.Error()}
	}
	if err := ValidToken(cfg.Token); err != nil {
		return nil, fmt.Errorf("provider token: %w", err)
	}
	u, _ := url.Parse(strings.TrimRight(cfg.Endpoint, "/"))
	cfg.Timeout = cmp.Or(cfg.Timeout, 10*time.Second)
	cfg.Attempts = cmp.Or(cfg.Attempts, 3)
	cfg.Backoff = cmp.Or(cfg.Backoff, 200*time.Millisecond)
	cfg.MaxRetryAfter = cmp.Or(cfg.MaxRetryAfter, 5*time.Second)
	return &Client{base: u, token: cfg.Token, cfg: cfg}, nil
}

// Create makes a machine under req.IdempotencyKey (required).
func (c *Client) Create(ctx context.Context, req CreateRequest) (Machine, error) {
	if req.IdempotencyKey == "" || len(req.IdempotencyKey) > 255 {
		return Machine{}, &Error{Kind: ErrRejected, Op: "create", Message: "an idempotency key of 1 to 255 bytes is required"}
	}
	body, err := json.Marshal(req)
	if err != nil {
		return Machine{}, err
	}
	return c.machine(ctx, "create", http.MethodPost, "/v1/machines", body, req.IdempotencyKey)
}

// Get reads machine id.
func (c *Client) Get(ctx context.Context, id string) (Machine, error) {
	if err := checkID("get", id); err != nil {
		return Machine{}, err
	}
	return c.machine(ctx, "get machine "+id, http.MethodGet, "/v1/machines/"+id, nil, "")
}

// Start powers machine id on.
func (c *Client) Start(ctx context.Context, id string) (Machine, error) {
	if err := checkID("start", id); err != nil {
		return Machine{}, err
	}
	return c.machine(ctx, "start machine "+id, http.MethodPost, "/v1/machines/"+id+"/start", []byte("{}"), "")
}

// Stop powers machine id off.
func (c *Client) Stop(ctx context.Context, id string) (Machine, error) {
	if err := checkID("stop", id); err != nil {
		return Machine{}, err
	}
	return c.machine(ctx, "stop machine "+id, http.MethodPost, "/v1/machines/"+id+"/stop", []byte("{}"), "")
}

// Delete removes machine id; a machine that is gone is success.
func (c *Client) Delete(ctx context.Context, id string) error {
	if err := checkID("delete", id); err != nil {
		return err
	}
	_, err := c.do(ctx, "delete machine "+id, http.MethodDelete, "/v1/machines/"+id, nil, "")
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}

func checkID(op, id string) error {
	if !ValidID(id) {
		return &Error{Kind: ErrRejected, Op: op, Message: fmt.Sprintf("not a machine id (at most %d of A-Z a-z 0-9 . _ : -)", MaxIDLength)}
	}
	return nil
}

func (c *Client) machine(ctx context.Context, op, method, path string, body []byte, key string) (Machine, error) {
	raw, err := c.do(ctx, op, method, path, body, key)
	if err != nil {
		return Machine{}, err
	}
	m, err := parseMachine(raw)
	if err != nil {
		return Machine{}, &Error{Kind: ErrTransient, Op: op, Class: outbound.ReasonInvalidResponse, Message: err.Error()}
	}
	return m, nil
}

// parseMachine reads a provider's answer as a [Machine]: JSON with a valid
// id and a state of at most 32 printable ASCII characters.
func parseMachine(raw []byte) (Machine, error) {
	var m Machine
	if err := json.Unmarshal(raw, &m); err != nil {
		return Machine{}, errors.New("the answer is not a machine as JSON")
	}
	if !ValidID(m.ID) || m.State == "" || len(m.State) > 32 || strings.IndexFunc(m.State, func(r rune) bool { return r < 0x21 || r > 0x7e }) >= 0 {
		return Machine{}, errors.New("the answer has no valid machine id and state")
	}
	return m, nil
}

// do runs one call: up to Attempts tries, each under Timeout, retrying 429,
// 5xx and transport errors.
func (c *Client) do(ctx context.Context, op, method, path string, body []byte, key string) ([]byte, error) {
	pause := c.cfg.Backoff
	var last *Error
	for attempt := 1; ; attempt++ {
		raw, err := c.once(ctx, op, method, path, body, key)
		if err == nil {
			return raw, nil
		}
		if !errors.As(err, &last) || !errors.Is(err, ErrTransient) || attempt >= c.cfg.Attempts || ctx.Err() != nil {
			return nil, err
		}
		wait := pause
		if last.RetryAfter > 0 {
			if last.RetryAfter > c.cfg.MaxRetryAfter {
				return nil, err
			}
			wait = last.RetryAfter
		}
		pause *= 2
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
	}
}

func (c *Client) once(ctx context.Context, op, method, path string, body []byte, key string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base.String()+path, rd)
	if err != nil {
		return nil, &Error{Kind: ErrRejected, Op: op, Message: "bad request"}
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := c.cfg.HTTP.Do(req)
	if err != nil {
		// The transport's error names the URL and addresses (no token: it
		// is a header): for the log only. A refused destination stays
		// refused, so it is no transient failure.
		kind, class := ErrTransient, outbound.Reason(err)
		if class == outbound.ReasonRefused {
			kind = ErrRejected
		}
		return nil, &Error{Kind: kind, Op: op, Class: class, Message: transportMessage(err)}
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, MaxResponseBytes+1))
	if err != nil {
		return nil, &Error{Kind: ErrTransient, Op: op, Status: resp.StatusCode, Class: outbound.Reason(err), Message: "reading the answer: " + transportMessage(err)}
	}
	return answer(op, resp.StatusCode, resp.Header.Get("Retry-After"), raw)
}

// answer reads a provider's answer of status with body raw: raw on 2xx,
// otherwise the [*Error] of its status (404 ErrNotFound, 409 ErrConflict,
// 429 ErrRateLimited, 5xx ErrTransient, anything else — 3xx included —
// ErrRejected), with the provider's message for the log and its
// Retry-After.
func answer(op string, status int, retryAfterHeader string, raw []byte) ([]byte, error) {
	if len(raw) > MaxResponseBytes {
		return nil, &Error{Kind: ErrTransient, Op: op, Status: status, Class: outbound.ReasonInvalidResponse, Message: fmt.Sprintf("answer over %d bytes", MaxResponseBytes)}
	}
	if status >= 200 && status < 300 {
		return raw, nil
	}
	e := &Error{Op: op, Status: status, Message: providerMessage(raw), RetryAfter: retryAfter(retryAfterHeader)}
	switch {
	case status == http.StatusNotFound:
		e.Kind = ErrNotFound
	case status == http.StatusConflict:
		e.Kind = ErrConflict
	case status == http.StatusTooManyRequests:
		e.Kind = ErrRateLimited
	case status >= 500:
		e.Kind = ErrTransient
	default:
		e.Kind = ErrRejected
	}
	return nil, e
}

func transportMessage(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return bounded(err.Error())
}

func providerMessage(raw []byte) string {
	var m struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(raw, &m) == nil {
		return bounded(m.Message)
	}
	return ""
}

func bounded(s string) string {
	if len(s) > 256 {
		s = s[:256] + "…"
	}
	return strings.ToValidUTF8(s, "")
}

// retryAfter reads a Retry-After of seconds or an HTTP date; 0 when absent
// or unreadable.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if n, err := strconv.Atoi(v); err == nil && n >= 0 {
		return time.Duration(min(n, 3600)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return min(max(time.Until(t), 0), time.Hour)
	}
	return 0
}
