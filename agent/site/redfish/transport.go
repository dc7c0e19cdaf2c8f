package redfish

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// maxResponse bounds every response body read from a BMC.
const maxResponse = 4 << 20

// transport gives every request the context of the operation in flight
// (gofish fixes one context at connect time), retries 503 and 429 answers a
// bounded number of times with exponential back-off (honouring Retry-After up
// to the cap), and bounds response bodies. It logs method, path, status and
// attempt — never headers or bodies.
type transport struct {
	base     http.RoundTripper
	log      *slog.Logger
	attempts int
	delay    time.Duration
	maxDelay time.Duration

	mu  sync.Mutex
	ctx context.Context // the operation's; nil between operations
}

func (t *transport) setContext(ctx context.Context) {
	t.mu.Lock()
	t.ctx = ctx
	t.mu.Unlock()
}

// endOperation clears the operation's context: requests outside an
// operation are refused.
func (t *transport) endOperation() {
	t.mu.Lock()
	t.ctx = nil
	t.mu.Unlock()
}

func (t *transport) context() context.Context {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ctx
}

func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := t.context()
	if ctx == nil {
		return nil, errors.New("request outside an operation")
	}
	delay := t.delay
	for attempt := 1; ; attempt++ {
		r := req.Clone(ctx)
		r.Close = false // gofish closes every connection; BMCs are slow to handshake
		if attempt > 1 && req.Body != nil {
			if req.GetBody == nil {
				return nil, errors.New("cannot retry a request without GetBody")
			}
			body, err := req.GetBody()
			if err != nil {
				return nil, err
			}
			r.Body = body
		}
		start := time.Now()
		resp, err := t.base.RoundTrip(r)
		if err != nil {
			t.log.LogAttrs(ctx, slog.LevelDebug, "bmc request failed",
				slog.String("method", req.Method), slog.String("path", req.URL.Path), slog.Int("attempt", attempt),
				slog.String("err", err.Error()))
			return nil, err
		}
		t.log.LogAttrs(ctx, slog.LevelDebug, "bmc request",
			slog.String("method", req.Method), slog.String("path", req.URL.Path),
			slog.Int("status", resp.StatusCode), slog.Int("attempt", attempt),
			slog.Duration("took", time.Since(start)))
		retryable := resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests
		if !retryable || attempt >= t.attempts {
			resp.Body = &limitedBody{rc: resp.Body, left: maxResponse}
			return resp, nil
		}
		wait := delay
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s >= 0 {
			wait = time.Duration(s) * time.Second
		}
		wait = min(wait, t.maxDelay)
		delay = min(2*delay, t.maxDelay)
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		t.log.LogAttrs(ctx, slog.LevelWarn, "bmc busy, retrying",
			slog.String("method", req.Method), slog.String("path", req.URL.Path),
			slog.Int("status", resp.StatusCode), slog.Int("attempt", attempt), slog.Duration("wait", wait))
		timer := time.NewTimer(wait)
		select {
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		}
	}
}

// limitedBody fails a read past its limit instead of truncating silently.
type limitedBody struct {
	rc   io.ReadCloser
	left int64
}

var errTooLarge = errors.New("response body larger than 4 MiB")

func (l *limitedBody) Read(p []byte) (int, error) {
	if l.left <= 0 {
		var one [1]byte
		if n, _ := l.rc.Read(one[:]); n > 0 {
			return 0, errTooLarge
		}
		return 0, io.EOF
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.rc.Read(p)
	l.left -= int64(n)
	return n, err
}

func (l *limitedBody) Close() error { return l.rc.Close() }
