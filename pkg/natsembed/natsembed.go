// Package natsembed runs a NATS server with JetStream inside the process, for
// `better-compute dev` and for tests.
//
// It is the real nats-server (github.com/nats-io/nats-server/v2), configured
// for one node on one host: no cluster, no signal handlers, and no logging
// unless a logger is given.
package natsembed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Options configures [Start]. The zero value listens on 127.0.0.1:4222 with
// JetStream in a temporary directory.
type Options struct {
	// Host is the address to listen on; empty means 127.0.0.1.
	Host string
	// Port is the client port. Zero means 4222, NATS's default; -1 picks a
	// free port (see [Server.Port]).
	Port int
	// StoreDir holds JetStream's streams. Empty means a temporary directory
	// that [Server.Shutdown] removes.
	StoreDir string
	// ServerName names the server; empty means "bc-embedded".
	ServerName string
	// ReadyTimeout bounds the wait for the server to accept clients; zero
	// means 10s.
	ReadyTimeout time.Duration
	// Logger receives the server's log (notices at Info, debug at Debug).
	// Nil discards it.
	Logger *slog.Logger
	// Debug and Trace turn on the server's debug and protocol trace lines,
	// which go to Logger at Debug level.
	Debug, Trace bool
}

// Server is a running embedded NATS server.
type Server struct {
	ns      *server.Server
	port    int
	tmpDir  string
	once    sync.Once
	stopErr error
}

// Start starts a server and waits until it accepts clients.
func Start(opts Options) (*Server, error) {
	if opts.Host == "" {
		opts.Host = "127.0.0.1"
	}
	if opts.ServerName == "" {
		opts.ServerName = "bc-embedded"
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = 10 * time.Second
	}
	var tmpDir string
	if opts.StoreDir == "" {
		d, err := os.MkdirTemp("", "natsembed-")
		if err != nil {
			return nil, err
		}
		tmpDir, opts.StoreDir = d, d
	}

	ns, err := server.NewServer(&server.Options{
		ServerName: opts.ServerName,
		Host:       opts.Host,
		Port:       opts.Port,
		JetStream:  true,
		StoreDir:   opts.StoreDir,
		NoSigs:     true,
		Debug:      opts.Debug,
		Trace:      opts.Trace,
	})
	if err != nil {
		removeAll(tmpDir)
		return nil, fmt.Errorf("nats server: %w", err)
	}
	log := &logger{l: opts.Logger}
	ns.SetLoggerV2(log, opts.Debug, opts.Trace, false)

	// Start returns once the server listens, or has failed to.
	started := make(chan struct{})
	go func() {
		ns.Start()
		close(started)
	}()
	select {
	case <-started:
	case <-time.After(opts.ReadyTimeout):
	}
	err = log.fatal()
	if err == nil && !ns.ReadyForConnections(time.Second) {
		err = fmt.Errorf("not ready after %s", opts.ReadyTimeout)
	}
	if err != nil {
		ns.Shutdown()
		ns.WaitForShutdown()
		removeAll(tmpDir)
		return nil, fmt.Errorf("nats server on %s: %w", net.JoinHostPort(opts.Host, strconv.Itoa(opts.Port)), err)
	}
	addr, ok := ns.Addr().(*net.TCPAddr)
	if !ok {
		ns.Shutdown()
		ns.WaitForShutdown()
		removeAll(tmpDir)
		return nil, errors.New("nats server has no TCP listener")
	}
	return &Server{ns: ns, port: addr.Port, tmpDir: tmpDir}, nil
}

// ClientURL returns the URL clients connect to, nats://host:port.
func (s *Server) ClientURL() string { return s.ns.ClientURL() }

// Port returns the client port the server listens on.
func (s *Server) Port() int { return s.port }

// NATS returns the underlying server, for inspection (JetStream state,
// connection counts) in tests.
func (s *Server) NATS() *server.Server { return s.ns }

// Shutdown stops the server, closing client connections, and waits until it
// has stopped. It removes a temporary store directory. It may be called more
// than once.
func (s *Server) Shutdown() error {
	s.once.Do(func() {
		s.ns.Shutdown()
		s.ns.WaitForShutdown()
		if s.tmpDir != "" {
			s.stopErr = os.RemoveAll(s.tmpDir)
		}
	})
	return s.stopErr
}

func removeAll(dir string) {
	if dir != "" {
		_ = os.RemoveAll(dir)
	}
}

// logger adapts the server's log calls to slog, and remembers the first
// fatal error (the server then stops starting; it never exits the process).
type logger struct {
	l          *slog.Logger
	mu         sync.Mutex
	firstFatal error
}

func (g *logger) log(level slog.Level, format string, v []any) {
	if g.l != nil {
		g.l.Log(context.Background(), level, fmt.Sprintf(format, v...))
	}
}

func (g *logger) fatal() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.firstFatal
}

func (g *logger) Noticef(format string, v ...any) { g.log(slog.LevelInfo, format, v) }
func (g *logger) Warnf(format string, v ...any)   { g.log(slog.LevelWarn, format, v) }
func (g *logger) Errorf(format string, v ...any)  { g.log(slog.LevelError, format, v) }
func (g *logger) Debugf(format string, v ...any)  { g.log(slog.LevelDebug, format, v) }
func (g *logger) Tracef(format string, v ...any)  { g.log(slog.LevelDebug-4, format, v) }

func (g *logger) Fatalf(format string, v ...any) {
	g.mu.Lock()
	if g.firstFatal == nil {
		g.firstFatal = fmt.Errorf(format, v...)
	}
	g.mu.Unlock()
	g.log(slog.LevelError, format, v)
}
