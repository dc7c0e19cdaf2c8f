// Package pglocal finds or starts a PostgreSQL server for tests and for
// `better-compute dev`.
//
// [Resolve] tries, in order:
//
//  1. the URL in an environment variable (tests use TEST_DATABASE_URL);
//  2. the local server at 127.0.0.1:5432, when it accepts a connection quickly;
//  3. a private cluster it creates with initdb and runs as a child process,
//     listening on 127.0.0.1 only with trust authentication (as the postgres
//     user when running as root);
//  4. a testcontainers-go postgres container, when a Docker engine is healthy.
//
// The first that works wins; when none does, the error says what was tried and
// why each failed. [Server.Stop] stops only what Resolve started.
package pglocal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Source says where a [Server] came from.
type Source string

// The sources [Resolve] tries, in order.
const (
	// SourceEnv is a URL taken from the environment variable named by
	// [Options.URLEnv].
	SourceEnv Source = "env"
	// SourceLocal is an already running server, by default 127.0.0.1:5432.
	SourceLocal Source = "local"
	// SourceCluster is a private cluster in [Options.DataDir].
	SourceCluster Source = "cluster"
	// SourceContainer is a testcontainers-go postgres container.
	SourceContainer Source = "container"
)

// DefaultLocalURL is the server [Resolve] probes when [Options.LocalURL] is
// empty.
const DefaultLocalURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// ErrNoServer is returned (wrapped, with what was tried) by [Resolve] when no
// source produced a server. An explicit URL that does not answer is a
// different error: it does not wrap ErrNoServer.
var ErrNoServer = errors.New("no PostgreSQL server found")

// Options says where [Resolve] may look. The zero value probes the local
// server, then starts a private cluster in a temporary directory, then tries
// testcontainers.
type Options struct {
	// URLEnv names an environment variable that, when set and not empty, holds
	// the URL to use; nothing else is tried then. Empty consults no variable.
	URLEnv string

	// LocalURL is the already running server to probe; empty means
	// [DefaultLocalURL].
	LocalURL string
	// SkipLocal does not probe LocalURL.
	SkipLocal bool

	// SkipCluster does not start a private cluster.
	SkipCluster bool
	// DataDir holds the private cluster. An existing cluster there is reused
	// (dev keeps its data in ./.data/pg across restarts); an empty or missing
	// directory is initialised with initdb. Empty means a fresh temporary
	// directory that [Server.Stop] removes.
	DataDir string
	// Port is the private cluster's port on 127.0.0.1. Zero means the port the
	// cluster used last time when it is free, else any free port.
	Port int
	// BinDir holds initdb and postgres. Empty means the directory of initdb
	// found on PATH, else the newest /usr/lib/postgresql/*/bin.
	BinDir string
	// Fast turns off fsync, synchronous commit and full-page writes in a
	// private cluster: much faster, and a machine crash may corrupt it. For
	// throwaway test clusters.
	Fast bool
	// StartTimeout bounds starting a private cluster or a container; zero
	// means 60s.
	StartTimeout time.Duration

	// SkipContainer does not try testcontainers.
	SkipContainer bool
	// ContainerImage is the image to run; empty means "postgres:15-alpine".
	ContainerImage string

	// ProbeTimeout bounds each connection attempt to an existing server; zero
	// means 2s.
	ProbeTimeout time.Duration
	// Logger receives a line when a cluster or container starts or stops. Nil
	// discards.
	Logger *slog.Logger
}

func (o Options) withDefaults() Options {
	if o.LocalURL == "" {
		o.LocalURL = DefaultLocalURL
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = 60 * time.Second
	}
	if o.ContainerImage == "" {
		o.ContainerImage = "postgres:15-alpine"
	}
	if o.ProbeTimeout <= 0 {
		o.ProbeTimeout = 2 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Server is a PostgreSQL server found or started by [Resolve].
type Server struct {
	// URL connects to the server's maintenance database ("postgres") as a
	// superuser, except for [SourceEnv], where it is the URL as given.
	URL string
	// Source says which source produced the server.
	Source Source
	// DataDir is the private cluster's data directory; empty for other
	// sources.
	DataDir string

	stop     func() error
	stopOnce sync.Once
	stopErr  error
}

// Stop stops the cluster or container that [Resolve] started, and removes a
// temporary data directory. It does nothing for a server Resolve only found.
// It may be called more than once; later calls return the first result.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		if s.stop != nil {
			s.stopErr = s.stop()
		}
	})
	return s.stopErr
}

// Resolve returns the first PostgreSQL server it finds or starts, trying the
// sources in the order the package documentation gives. The caller must call
// [Server.Stop] when done.
func Resolve(ctx context.Context, opts Options) (*Server, error) {
	opts = opts.withDefaults()

	if opts.URLEnv != "" {
		if u := os.Getenv(opts.URLEnv); u != "" {
			if err := probe(ctx, u, opts.ProbeTimeout); err != nil {
				return nil, fmt.Errorf("%s: %w", opts.URLEnv, err)
			}
			return &Server{URL: u, Source: SourceEnv}, nil
		}
	}

	var tried []error
	if opts.URLEnv != "" {
		tried = append(tried, fmt.Errorf("%s: not set", opts.URLEnv))
	}

	if opts.SkipLocal {
		tried = append(tried, errors.New("local server: skipped"))
	} else if err := probe(ctx, opts.LocalURL, opts.ProbeTimeout); err != nil {
		tried = append(tried, fmt.Errorf("local server: %w", err))
	} else {
		return &Server{URL: opts.LocalURL, Source: SourceLocal}, nil
	}

	if opts.SkipCluster {
		tried = append(tried, errors.New("private cluster: skipped"))
	} else if s, err := startCluster(ctx, opts); err != nil {
		tried = append(tried, fmt.Errorf("private cluster: %w", err))
	} else {
		return s, nil
	}

	if opts.SkipContainer {
		tried = append(tried, errors.New("testcontainers: skipped"))
	} else if s, err := startContainer(ctx, opts); err != nil {
		tried = append(tried, fmt.Errorf("testcontainers: %w", err))
	} else {
		return s, nil
	}

	if err := ctx.Err(); err != nil {
		return nil, err
	}
	msgs := make([]string, len(tried))
	for i, e := range tried {
		msgs[i] = e.Error()
	}
	return nil, fmt.Errorf("%w; tried: %s", ErrNoServer, strings.Join(msgs, "; "))
}

// probe connects to url once and disconnects.
func probe(ctx context.Context, url string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgconn.Connect(ctx, url)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// DatabaseURL returns base with its database replaced by name. base is a URL
// (postgres://...) or a keyword/value DSN (host=... dbname=...).
func DatabaseURL(base, name string) (string, error) {
	if strings.HasPrefix(base, "postgres://") || strings.HasPrefix(base, "postgresql://") {
		u, err := url.Parse(base)
		if err != nil {
			return "", fmt.Errorf("parse database url: %w", err)
		}
		u.Path = "/" + name
		u.RawPath = ""
		return u.String(), nil
	}
	if _, err := pgconn.ParseConfig(base); err != nil {
		return "", fmt.Errorf("parse database dsn: %w", err)
	}
	// A later keyword overrides an earlier one.
	quoted := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(name)
	return base + " dbname='" + quoted + "'", nil
}
