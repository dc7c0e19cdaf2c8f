// Package providers drives the machines of a provider pool (class
// "provider", DESIGN §14): a [Provider] creates, reads, starts, stops and
// deletes machines at a cloud provider's API.
//
// Every call is idempotent. A create carries an idempotency key — our
// instance id — and a provider answers the same key with the same machine,
// never a second one, so a caller that crashed between the provider's
// answer and its own write simply creates again. Start and stop of a
// machine already in that state succeed; deleting a machine that is gone
// succeeds.
//
// [Client] speaks a small JSON API over HTTPS (documented on [Client]) with
// a bearer token from the pool's credentials secret ([Credentials]); every
// request has a deadline and is retried a bounded number of times on 429
// and 5xx. [Fake] is that API in memory, for tests and `make run`: it
// honours Idempotency-Key, provisions with a delay, injects faults (fail
// the next requests, drop the connection after a create) and records every
// call.
package providers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/outbound"
)

// Provider is one provider account's API. Every method is idempotent.
type Provider interface {
	// Create makes a machine, or returns the one made earlier under
	// req.IdempotencyKey.
	Create(ctx context.Context, req CreateRequest) (Machine, error)
	// Get reads a machine: ErrNotFound when it does not exist.
	Get(ctx context.Context, id string) (Machine, error)
	// Start powers a machine on (success when it is on or starting).
	Start(ctx context.Context, id string) (Machine, error)
	// Stop powers a machine off (success when it is off or stopping).
	Stop(ctx context.Context, id string) (Machine, error)
	// Delete removes a machine; one that is gone is success.
	Delete(ctx context.Context, id string) error
}

// Machine states as a provider reports them.
const (
	StatePending  = "pending" // provisioning
	StateStarting = "starting"
	StateRunning  = "running"
	StateStopping = "stopping"
	StateStopped  = "stopped"
	StateDeleted  = "deleted"
)

// Settled reports whether a machine in state s is at rest (running,
// stopped or deleted) rather than on its way somewhere.
func Settled(s string) bool { return s == StateRunning || s == StateStopped || s == StateDeleted }

// Bounds of what travels to and from a provider.
const (
	MaxIDLength       = 128
	MaxEndpointLength = outbound.MaxURLLen
	MaxTokenLength    = 4096
	// MaxResponseBytes bounds a provider's answer.
	MaxResponseBytes = 1 << 20
)

var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]*$`)

// ValidID reports whether id can name a provider machine in a URL path.
func ValidID(id string) bool { return len(id) <= MaxIDLength && idPattern.MatchString(id) }

// CreateRequest is a machine to make.
type CreateRequest struct {
	// IdempotencyKey is our instance id: the provider answers the same key
	// with the same machine. Required.
	IdempotencyKey string   `json:"-"`
	Size           Size     `json:"size"`
	Image          string   `json:"image"`
	SSHKeys        []string `json:"sshKeys,omitempty"`
	UserData       string   `json:"userData,omitempty"`
}

// Size is a machine's size.
type Size struct {
	VCPUs     int    `json:"vcpus"`
	MemoryMiB int64  `json:"memoryMiB"`
	DiskGiB   int64  `json:"diskGiB"`
	GPUs      int    `json:"gpus,omitempty"`
	GPUModel  string `json:"gpuModel,omitempty"`
}

// Machine is a provider's machine.
type Machine struct {
	ID    string `json:"id"`
	State string `json:"state"`
}

// Sentinel errors: test with errors.Is. An [*Error] wraps one of them.
var (
	// ErrNotFound: the machine does not exist.
	ErrNotFound = errors.New("provider: machine not found")
	// ErrConflict: the provider refused the request in the machine's
	// current state, or an idempotency key was reused for a different
	// request.
	ErrConflict = errors.New("provider: conflict")
	// ErrTransient: the request may succeed later (5xx, a dropped
	// connection, a deadline); ErrRateLimited is transient too.
	ErrTransient = errors.New("provider: transient failure")
	// ErrRateLimited: the provider answered 429; [RetryAfter] says when to
	// come back.
	ErrRateLimited = errors.New("provider: rate limited")
	// ErrRejected: the provider refused the request for good (401, 403,
	// 400, 422, …): retrying the same request cannot help.
	ErrRejected = errors.New("provider: request rejected")
)

// Error is a failed provider call.
type Error struct {
	// Kind is one of the sentinel errors.
	Kind error
	// Op is the call ("create", "get machine m-1").
	Op string
	// Status is the HTTP status, 0 when there was no answer.
	Status int
	// RetryAfter is the provider's Retry-After, when it gave one.
	RetryAfter time.Duration
	// Class is the failure's class (pkg/outbound's Reason constants) when
	// it came from the network or the provider's answer.
	Class string
	// Message is the provider's own message (bounded), or the transport's
	// error: for the server's log, never for the tenant ([Error.Reason]).
	Message string
}

// Reason is what a tenant may read about the failure: its class
// ("destination refused", "DNS failure", "timeout", "TLS error",
// "connection failed", "invalid response") or "HTTP status NNN" — never
// the provider's text, the transport's error or an address — or, for a
// failure of our own making (no settings, a bad credentials secret), our
// message.
func (e *Error) Reason() string {
	switch {
	case e.Class != "":
		return e.Class
	case e.Status != 0:
		return outbound.StatusReason(e.Status)
	}
	return e.Message
}

func (e *Error) Error() string {
	s := e.Op + ": " + e.Kind.Error()
	if e.Status != 0 {
		s += fmt.Sprintf(" (HTTP %d)", e.Status)
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Unwrap lets errors.Is find the kind (and ErrTransient under
// ErrRateLimited).
func (e *Error) Unwrap() []error {
	if e.Kind == ErrRateLimited { //nolint:errorlint // Kind is one of this package's sentinels, never wrapped
		return []error{ErrRateLimited, ErrTransient}
	}
	return []error{e.Kind}
}

// RetryAfter is the Retry-After of a rate-limited or transient err; 0 when
// it has none.
func RetryAfter(err error) time.Duration {
	var pe *Error
	if errors.As(err, &pe) {
		return pe.RetryAfter
	}
	return 0
}

// Credentials are a provider account's credentials: the payload of a
// secret of kind "provider", as JSON {"token"}. Its String, GoString and
// LogValue never show the token.
type Credentials struct {
	Token string `json:"token"`
}

const redacted = "[REDACTED]"

// String hides the token.
func (c Credentials) String() string { return "{token:" + redacted + "}" }

// GoString hides the token.
func (c Credentials) GoString() string { return c.String() }

// LogValue hides the token.
func (c Credentials) LogValue() slog.Value { return slog.StringValue(c.String()) }

// Marshal returns the payload to seal.
func (c Credentials) Marshal() []byte {
	b, _ := json.Marshal(c) // cannot fail: one string
	return b
}

// ValidToken checks a bearer token; the error never shows it.
func ValidToken(tok string) error {
	switch {
	case tok == "":
		return errors.New("required")
	case len(tok) > MaxTokenLength:
		return fmt.Errorf("at most %d bytes", MaxTokenLength)
	case strings.ContainsAny(tok, " \t\r\n"):
		return errors.New("no spaces or line breaks")
	}
	return nil
}

// ParseCredentials reads the payload of a provider secret.
func ParseCredentials(b []byte) (Credentials, error) {
	var c Credentials
	if err := json.Unmarshal(b, &c); err != nil {
		return Credentials{}, errors.New("provider credentials: not a JSON object with a token")
	}
	if err := ValidToken(c.Token); err != nil {
		return Credentials{}, fmt.Errorf("provider credentials: token: %w", err)
	}
	return c, nil
}

// EndpointField is the API field a provider's endpoint arrives in.
const EndpointField = "provider.endpoint"

// ValidEndpoint checks a provider's API base URL under o, the providers'
// outbound rules (pkg/outbound: https, a public host, the operator's
// allowed hosts; http to loopback only in development), with no user info
// — credentials go in the credentials secret — query or fragment. It
// fails with an INVALID_INPUT fault naming [EndpointField].
func ValidEndpoint(raw string, o outbound.Options) error {
	if raw == "" {
		return fault.New(fault.InvalidInput, EndpointField, "required: the provider API's base URL (https://…)")
	}
	if err := outbound.CheckURL(raw, EndpointField, o); err != nil {
		return err
	}
	if u, _ := url.Parse(raw); u.RawQuery != "" || u.ForceQuery {
		return fault.New(fault.InvalidInput, EndpointField, "expected no query (?...) in the URL")
	}
	return nil
}
