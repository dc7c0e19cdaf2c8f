package natsembed_test

import (
	"bytes"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/pkg/natsembed"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func start(t *testing.T, opts natsembed.Options) *natsembed.Server {
	t.Helper()
	s, err := natsembed.Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Shutdown(); err != nil {
			t.Error(err)
		}
	})
	return s
}

func connect(t *testing.T, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// syncBuffer is a bytes.Buffer safe for a logger used by server goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func TestStart(t *testing.T) {
	t.Parallel()

	t.Run("serves core NATS and JetStream on a random port", func(t *testing.T) {
		t.Parallel()
		s := start(t, natsembed.Options{Port: -1, StoreDir: t.TempDir()})
		if s.Port() <= 0 || s.Port() == 4222 {
			t.Fatalf("port = %d", s.Port())
		}
		if !strings.HasPrefix(s.ClientURL(), "nats://127.0.0.1:") {
			t.Errorf("ClientURL = %q", s.ClientURL())
		}
		nc := connect(t, s.ClientURL())
		sub, err := nc.SubscribeSync("hello")
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.Publish("hello", []byte("world")); err != nil {
			t.Fatal(err)
		}
		msg, err := sub.NextMsg(5 * time.Second)
		if err != nil || string(msg.Data) != "world" {
			t.Fatalf("got %v, %v", msg, err)
		}

		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
			t.Fatal(err)
		}
		if _, err := js.Publish(t.Context(), "s.1", []byte("x")); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("shutdown waits until clients are refused", func(t *testing.T) {
		t.Parallel()
		s := start(t, natsembed.Options{Port: -1})
		if err := s.Shutdown(); err != nil {
			t.Fatal(err)
		}
		if _, err := nats.Connect(s.ClientURL(), nats.Timeout(time.Second)); err == nil {
			t.Fatal("connected after Shutdown")
		}
		if err := s.Shutdown(); err != nil {
			t.Errorf("second Shutdown: %v", err)
		}
	})

	t.Run("fails at once on a port in use", func(t *testing.T) {
		t.Parallel()
		first := start(t, natsembed.Options{Port: -1, StoreDir: t.TempDir()})
		began := time.Now()
		_, err := natsembed.Start(natsembed.Options{Port: first.Port(), StoreDir: t.TempDir(), ReadyTimeout: 30 * time.Second})
		if err == nil || !strings.Contains(err.Error(), "address already in use") {
			t.Fatalf("err = %v, want address already in use", err)
		}
		// Not a timed assertion of speed: a failed listen must not wait for
		// the whole ReadyTimeout.
		if d := time.Since(began); d >= 30*time.Second {
			t.Errorf("took %s", d)
		}
	})

	t.Run("logs only to the given logger", func(t *testing.T) {
		t.Parallel()
		var buf syncBuffer
		start(t, natsembed.Options{Port: -1, StoreDir: t.TempDir(), Logger: slog.New(slog.NewTextHandler(&buf, nil))})
		if !strings.Contains(buf.String(), "Server is ready") {
			t.Errorf("log lacks the ready line:\n%s", buf.String())
		}
	})
}

// TestQuiet checks that a server without a logger writes nothing to stdout or
// stderr. It swaps os.Stdout and os.Stderr, so it does not run in parallel.
func TestQuiet(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, stderr := os.Stdout, os.Stderr
	os.Stdout, os.Stderr = w, w
	s, err := natsembed.Start(natsembed.Options{Port: -1, StoreDir: t.TempDir()})
	if err == nil {
		err = s.Shutdown()
	}
	os.Stdout, os.Stderr = stdout, stderr
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if _, err := out.ReadFrom(r); err != nil {
		t.Fatal(err)
	}
	if out.Len() > 0 {
		t.Errorf("server wrote to stdout/stderr:\n%s", out.String())
	}
}
