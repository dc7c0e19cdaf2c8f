package natstest_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/pkg/natstest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// reconnectingClient connects with unlimited, quick reconnects and reports
// each reconnect on the returned channel.
func reconnectingClient(t *testing.T, url string) (*nats.Conn, jetstream.JetStream, <-chan struct{}) {
	t.Helper()
	reconnected := make(chan struct{}, 16)
	nc, err := nats.Connect(url,
		nats.MaxReconnects(-1),
		nats.ReconnectWait(10*time.Millisecond),
		nats.ReconnectJitter(0, 0),
		nats.ReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} }),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js, reconnected
}

func waitReconnect(t *testing.T, reconnected <-chan struct{}) {
	t.Helper()
	select {
	case <-reconnected:
	case <-time.After(30 * time.Second):
		t.Fatal("client did not reconnect")
	}
}

func createStream(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}, Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(t.Context(), "events.a", []byte("1")); err != nil {
		t.Fatal(err)
	}
}

func TestServer(t *testing.T) {
	t.Parallel()

	t.Run("streams survive Restart and the client reconnects", func(t *testing.T) {
		t.Parallel()
		s := natstest.New(t)
		url := s.URL()
		nc, js, reconnected := reconnectingClient(t, url)
		createStream(t, js)

		s.Stop()
		if _, err := nats.Connect(url, nats.Timeout(time.Second)); err == nil {
			t.Fatal("connected while stopped")
		}
		if s.Embedded() != nil {
			t.Error("Embedded() is not nil while stopped")
		}
		s.Restart()
		if s.URL() != url {
			t.Errorf("URL changed: %s, then %s", url, s.URL())
		}
		waitReconnect(t, reconnected)
		if !nc.IsConnected() {
			t.Fatalf("status %v after reconnect", nc.Status())
		}

		st, err := js.Stream(t.Context(), "EVENTS")
		if err != nil {
			t.Fatalf("stream after Restart: %v", err)
		}
		info, err := st.Info(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs != 1 {
			t.Errorf("%d messages after Restart, want 1", info.State.Msgs)
		}
	})

	t.Run("streams are gone after RestartEmpty", func(t *testing.T) {
		t.Parallel()
		s := natstest.New(t)
		url := s.URL()
		_, js, reconnected := reconnectingClient(t, url)
		createStream(t, js)

		s.RestartEmpty() // from running, without a Stop first
		if s.URL() != url {
			t.Errorf("URL changed: %s, then %s", url, s.URL())
		}
		waitReconnect(t, reconnected)
		if _, err := js.Stream(t.Context(), "EVENTS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Fatalf("stream after RestartEmpty: err = %v, want ErrStreamNotFound", err)
		}
		// The new, empty server takes new streams.
		createStream(t, js)
	})

	t.Run("restarts many times on the same port", func(t *testing.T) {
		t.Parallel()
		s := natstest.New(t)
		port := s.Port()
		for range 5 {
			s.Restart()
		}
		if s.Port() != port || s.Embedded() == nil || s.Embedded().Port() != port {
			t.Fatalf("port %d, want %d", s.Embedded().Port(), port)
		}
		s.Stop()
		s.Stop() // twice is fine; Cleanup stops a third time
	})

	t.Run("keeps JetStream data in the test's temp dir", func(t *testing.T) {
		t.Parallel()
		s := natstest.New(t)
		_, js, _ := reconnectingClient(t, s.URL())
		createStream(t, js)
		if _, err := os.Stat(filepath.Join(s.StoreDir(), "jetstream")); err != nil {
			t.Errorf("no JetStream data under %s: %v", s.StoreDir(), err)
		}
	})
}
