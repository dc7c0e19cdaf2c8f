package config

import (
	"cmp"
	"regexp"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Events configures the outbox-relay role (the spec's sinks): the relay that
// publishes the outbox to JetStream, the fan-out to webhooks, and
// retention.
type Events struct {
	// Stream is the JetStream stream events are published to; default
	// BC_EVENTS.
	Stream string `yaml:"stream"`
	// StreamMaxAge bounds how long the stream keeps a message; default 24h.
	// PostgreSQL keeps events for Retention whatever the stream holds.
	StreamMaxAge Duration `yaml:"streamMaxAge"`
	// StreamMaxBytes bounds the stream's file storage; default 1 GiB.
	StreamMaxBytes int64 `yaml:"streamMaxBytes"`
	// StreamReplicas is how many JetStream servers keep the stream (1 to
	// 5; 3 in a production cluster, as the ha overlay runs it). A cluster
	// with fewer servers refuses the stream, which the relay logs while
	// PostgreSQL keeps every event. Default 1.
	StreamReplicas int `yaml:"streamReplicas"`
	// DuplicateWindow is the stream's duplicate window: a republish of an
	// event id inside it is dropped; default 2m.
	DuplicateWindow Duration `yaml:"duplicateWindow"`
	// Poll is how often the relay looks for new outbox rows; default 20ms.
	Poll Duration `yaml:"poll"`
	// Batch bounds the rows the relay sequences and publishes at once;
	// default 1000.
	Batch int `yaml:"batch"`
	// Retention is how long events are kept, with their finished
	// deliveries; default 168h (7 days).
	Retention Duration `yaml:"retention"`
	// PruneEvery is how often events.prune runs; default 1m.
	PruneEvery Duration `yaml:"pruneEvery"`
	// CertificateGrace is how long past expiry a node certificate's row is
	// kept before events.prune removes it; default 720h (30 days).
	CertificateGrace Duration `yaml:"certificateGrace"`
	// MaxStreamLifetime ends an events.watch stream (gRPC, SSE, the
	// console's live feed) this long after it opened; the client resumes
	// after its last cursor (SSE: Last-Event-ID). Default 1h.
	MaxStreamLifetime Duration `yaml:"maxStreamLifetime"`
	// MaxWatchesPerIdentity bounds the events.watch streams one identity
	// holds open in one API process; one more is RATE_LIMITED. Default 16.
	MaxWatchesPerIdentity int `yaml:"maxWatchesPerIdentity"`
	// MaxWatches bounds the events.watch streams one API process holds
	// open; one more is RATE_LIMITED. Default 2048.
	MaxWatches int `yaml:"maxWatches"`
}

func (c *Events) defaults() {
	c.Stream = cmp.Or(c.Stream, "BC_EVENTS")
	c.StreamMaxAge = cmp.Or(c.StreamMaxAge, Duration(24*time.Hour))
	c.StreamMaxBytes = cmp.Or(c.StreamMaxBytes, 1<<30)
	c.StreamReplicas = cmp.Or(c.StreamReplicas, 1)
	c.DuplicateWindow = cmp.Or(c.DuplicateWindow, Duration(2*time.Minute))
	c.Poll = cmp.Or(c.Poll, Duration(20*time.Millisecond))
	c.Batch = cmp.Or(c.Batch, 1000)
	c.Retention = cmp.Or(c.Retention, Duration(7*24*time.Hour))
	c.PruneEvery = cmp.Or(c.PruneEvery, Duration(time.Minute))
	c.CertificateGrace = cmp.Or(c.CertificateGrace, Duration(30*24*time.Hour))
	c.MaxStreamLifetime = cmp.Or(c.MaxStreamLifetime, Duration(time.Hour))
	c.MaxWatchesPerIdentity = cmp.Or(c.MaxWatchesPerIdentity, 16)
	c.MaxWatches = cmp.Or(c.MaxWatches, 2048)
}

func (c *Events) validate() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	if !streamNameRE.MatchString(c.Stream) {
		bad("events.stream", "expected letters, digits, '-' and '_', got %q", c.Stream)
	}
	if c.StreamReplicas < 1 || c.StreamReplicas > 5 {
		bad("events.streamReplicas", "expected 1 to 5, got %d", c.StreamReplicas)
	}
	for _, d := range []struct {
		field string
		v     Duration
	}{
		{"events.streamMaxAge", c.StreamMaxAge}, {"events.duplicateWindow", c.DuplicateWindow}, {"events.poll", c.Poll},
		{"events.retention", c.Retention}, {"events.pruneEvery", c.PruneEvery}, {"events.certificateGrace", c.CertificateGrace},
		{"events.maxStreamLifetime", c.MaxStreamLifetime},
	} {
		if d.v <= 0 {
			bad(d.field, "expected a positive duration, got %s", d.v.Std())
		}
	}
	if c.DuplicateWindow > c.StreamMaxAge {
		bad("events.duplicateWindow", "expected at most events.streamMaxAge (%s), got %s", c.StreamMaxAge.Std(), c.DuplicateWindow.Std())
	}
	if c.StreamMaxBytes < 1<<20 {
		bad("events.streamMaxBytes", "expected at least 1 MiB (1048576), got %d", c.StreamMaxBytes)
	}
	if c.Batch < 1 || c.Batch > 10000 {
		bad("events.batch", "expected 1 to 10000, got %d", c.Batch)
	}
	if c.MaxStreamLifetime > Duration(24*time.Hour) {
		bad("events.maxStreamLifetime", "expected at most 24h, got %s", c.MaxStreamLifetime.Std())
	}
	if c.MaxWatches < 1 || c.MaxWatches > 1_000_000 {
		bad("events.maxWatches", "expected 1 to 1000000, got %d", c.MaxWatches)
	}
	if c.MaxWatchesPerIdentity < 1 || c.MaxWatchesPerIdentity > c.MaxWatches {
		bad("events.maxWatchesPerIdentity", "expected 1 to events.maxWatches (%d), got %d", c.MaxWatches, c.MaxWatchesPerIdentity)
	}
	return errs
}

var streamNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// DefaultRetrySchedule returns how long a failed webhook delivery waits
// before each next attempt (Standard Webhooks' schedule): 8 attempts over
// about 27 hours.
func DefaultRetrySchedule() []Duration {
	return []Duration{
		Duration(5 * time.Second), Duration(5 * time.Minute), Duration(30 * time.Minute), Duration(2 * time.Hour),
		Duration(5 * time.Hour), Duration(10 * time.Hour), Duration(10 * time.Hour),
	}
}

// Webhooks configures webhook delivery.
type Webhooks struct {
	// AllowInsecure permits http:// endpoints on loopback addresses; dev
	// sets it. Every other endpoint must be https://.
	AllowInsecure bool `yaml:"allowInsecure"`
	// AllowPrivateNetworks permits endpoints in private, loopback,
	// link-local and reserved ranges, checked on the address actually
	// dialled (cloud metadata addresses stay refused); dev and tests set it.
	AllowPrivateNetworks bool `yaml:"allowPrivateNetworks"`
	// Timeout bounds one attempt; a 2xx within it is success; default 15s.
	Timeout Duration `yaml:"timeout"`
	// RetrySchedule is the wait before each retry of a failed delivery;
	// default 5s, 5m, 30m, 2h, 5h, 10h, 10h. Each wait gets up to 10 %
	// jitter.
	RetrySchedule []Duration `yaml:"retrySchedule"`
	// DisableAfter disables a webhook whose attempts have all failed for
	// this long; default 120h (5 days).
	DisableAfter Duration `yaml:"disableAfter"`
	// Concurrency bounds attempts in flight per process; default 64.
	Concurrency int `yaml:"concurrency"`
	// PerEndpoint bounds attempts in flight to one webhook, so a slow
	// endpoint never holds up another's; default 4.
	PerEndpoint int `yaml:"perEndpoint"`
	// Poll is how often due deliveries are looked for when nothing woke the
	// deliverer; default 1s.
	Poll Duration `yaml:"poll"`
}

func (c *Webhooks) defaults() {
	c.Timeout = cmp.Or(c.Timeout, Duration(15*time.Second))
	if len(c.RetrySchedule) == 0 {
		c.RetrySchedule = DefaultRetrySchedule()
	}
	c.DisableAfter = cmp.Or(c.DisableAfter, Duration(5*24*time.Hour))
	c.Concurrency = cmp.Or(c.Concurrency, 64)
	c.PerEndpoint = cmp.Or(c.PerEndpoint, 4)
	c.Poll = cmp.Or(c.Poll, Duration(time.Second))
}

func (c *Webhooks) validate() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	if c.Timeout <= 0 || c.Timeout > Duration(5*time.Minute) {
		bad("webhooks.timeout", "expected a duration from 1ms to 5m, got %s", c.Timeout.Std())
	}
	if len(c.RetrySchedule) > 32 {
		bad("webhooks.retrySchedule", "expected at most 32 waits, got %d", len(c.RetrySchedule))
	}
	for i, d := range c.RetrySchedule {
		if d <= 0 {
			bad("webhooks.retrySchedule", "wait %d: expected a positive duration, got %s", i+1, d.Std())
			break
		}
	}
	if c.DisableAfter <= 0 {
		bad("webhooks.disableAfter", "expected a positive duration, got %s", c.DisableAfter.Std())
	}
	if c.Concurrency < 1 || c.Concurrency > 4096 {
		bad("webhooks.concurrency", "expected 1 to 4096, got %d", c.Concurrency)
	}
	if c.PerEndpoint < 1 || c.PerEndpoint > c.Concurrency {
		bad("webhooks.perEndpoint", "expected 1 to webhooks.concurrency (%d), got %d", c.Concurrency, c.PerEndpoint)
	}
	if c.Poll <= 0 {
		bad("webhooks.poll", "expected a positive duration, got %s", c.Poll.Std())
	}
	return errs
}

// Audit configures the audit hash chain.
type Audit struct {
	// CheckpointEvery is how often audit.checkpoint signs the chain head;
	// default 1h.
	CheckpointEvery Duration `yaml:"checkpointEvery"`
	// ChainEvery is how often new audit rows are chained; default 1s.
	ChainEvery Duration `yaml:"chainEvery"`
	// SigningKeyFile is the Ed25519 private key (PEM PKCS#8) checkpoints are
	// signed with. Unset means checkpoints record the head unsigned (and
	// audit.verify says so); dev generates <dev.dataDir>/pki/audit.key.
	SigningKeyFile string `yaml:"signingKeyFile"`
	// Retention is how long audit records are kept: older ones are pruned
	// below a checkpoint after each checkpoint, and audit.verify checks
	// the chain from the first kept one. Default 400 days (9600h); a
	// negative duration (e.g. -1s) keeps every record.
	Retention Duration `yaml:"retention"`
}

// DefaultAuditRetention is audit.retention's default: over a year, so a
// yearly review still finds the whole year.
const DefaultAuditRetention = 400 * 24 * time.Hour

func (c *Audit) defaults() {
	c.CheckpointEvery = cmp.Or(c.CheckpointEvery, Duration(time.Hour))
	c.ChainEvery = cmp.Or(c.ChainEvery, Duration(time.Second))
	c.Retention = cmp.Or(c.Retention, Duration(DefaultAuditRetention))
}

// KeepFor is how long records are kept; 0 means forever.
func (c Audit) KeepFor() time.Duration {
	if c.Retention < 0 {
		return 0
	}
	return c.Retention.Std()
}

func (c *Audit) validate() []error {
	var errs []error
	if c.CheckpointEvery <= 0 {
		errs = append(errs, fault.New(fault.InvalidConfig, "audit.checkpointEvery", "expected a positive duration, got %s", c.CheckpointEvery.Std()))
	}
	if c.ChainEvery <= 0 {
		errs = append(errs, fault.New(fault.InvalidConfig, "audit.chainEvery", "expected a positive duration, got %s", c.ChainEvery.Std()))
	}
	if c.Retention >= 0 && c.Retention.Std() < 24*time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "audit.retention", "expected at least 24h, or a negative duration to keep every record, got %s", c.Retention.Std()))
	}
	return errs
}
