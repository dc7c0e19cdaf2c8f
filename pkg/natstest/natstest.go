// Package natstest runs an embedded NATS server with JetStream for one test,
// which the test can stop and restart, with or without its streams, to check
// what its code does when the bus goes away or comes back empty.
//
// The server keeps its port across restarts, so clients configured with
// reconnects (nats.MaxReconnects(-1)) find it again.
package natstest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/natsembed"
)

// restartTimeout bounds how long a restart retries a port that is still
// closing.
const restartTimeout = 10 * time.Second

// Server is an embedded NATS server owned by one test. Its methods are safe
// to call from several goroutines, but Restart and RestartEmpty fail the test
// through t.Fatalf, so call them from the test's goroutine.
type Server struct {
	t        testing.TB
	port     int
	storeDir string

	mu  sync.Mutex
	srv *natsembed.Server // nil while stopped
}

// New starts a server on a free port on 127.0.0.1 with JetStream in a
// directory under t.TempDir, and shuts it down when t ends.
func New(t testing.TB) *Server {
	t.Helper()
	s := &Server{t: t, storeDir: filepath.Join(t.TempDir(), "jetstream")}
	srv, err := natsembed.Start(natsembed.Options{Port: -1, StoreDir: s.storeDir, ServerName: serverName(t)})
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	s.srv, s.port = srv, srv.Port()
	t.Cleanup(s.Stop)
	return s
}

// serverName is a name for t's server, which shows in errors.
func serverName(t testing.TB) string {
	return "natstest-" + strings.NewReplacer("/", "_", " ", "_").Replace(t.Name())
}

// URL returns the client URL, nats://127.0.0.1:port. It stays the same
// across restarts, and is valid (if refused) while the server is stopped.
func (s *Server) URL() string {
	return "nats://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Port returns the server's port, kept across restarts.
func (s *Server) Port() int { return s.port }

// StoreDir returns the directory holding JetStream's data.
func (s *Server) StoreDir() string { return s.storeDir }

// Embedded returns the running server, or nil while it is stopped.
func (s *Server) Embedded() *natsembed.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.srv
}

// Stop shuts the server down and waits for it; clients are disconnected and
// the port is refused until a restart. Stopping a stopped server does
// nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
}

func (s *Server) stopLocked() {
	if s.srv == nil {
		return
	}
	if err := s.srv.Shutdown(); err != nil {
		s.t.Errorf("natstest: shutdown: %v", err)
	}
	s.srv = nil
}

// Restart stops the server if it runs and starts it again on the same port
// with the same store: JetStream streams and their messages survive.
func (s *Server) Restart() {
	s.t.Helper()
	s.restart(false)
}

// RestartEmpty stops the server if it runs, deletes its JetStream store and
// starts it again on the same port, as a bus that lost its disk.
func (s *Server) RestartEmpty() {
	s.t.Helper()
	s.restart(true)
}

func (s *Server) restart(wipe bool) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
	if wipe {
		if err := os.RemoveAll(s.storeDir); err != nil {
			s.t.Fatalf("natstest: wipe store: %v", err)
		}
	}
	srv, err := s.startOnPort()
	if err != nil {
		s.t.Fatalf("natstest: restart on port %d: %v", s.port, err)
	}
	s.srv = srv
}

// startOnPort starts the server on s.port, retrying while the port is still
// in use: a client connection may hold it briefly after a shutdown, and
// another process may even have taken it in between, in which case it gives
// up after restartTimeout.
func (s *Server) startOnPort() (*natsembed.Server, error) {
	deadline := time.Now().Add(restartTimeout)
	backoff := 5 * time.Millisecond
	for {
		srv, err := natsembed.Start(natsembed.Options{Port: s.port, StoreDir: s.storeDir, ServerName: serverName(s.t)})
		if err == nil {
			return srv, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) && !strings.Contains(err.Error(), "address already in use") {
			return nil, err
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("port still in use after %s: %w", restartTimeout, err)
		}
		time.Sleep(backoff)
		backoff = min(backoff*2, 200*time.Millisecond)
	}
}
