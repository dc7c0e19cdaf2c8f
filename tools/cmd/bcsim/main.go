// Command bcsim is the load simulator: it runs many simulated bcd node
// daemons (the real agent code with a mock DGX H200 NVML each, see
// agent/sim) in one process against a gateway over mutual TLS, and prints,
// as it goes, how many of them hold a session.
//
//	bcsim --gateway 127.0.0.1:8443 --ca .data/pki/ca.pem \
//	      --joinservice-key .data/pki/joinservice.pub --token bcjt_… --nodes 1000
//
// Nodes already joined under --root are reused (no token needed for them).
package main

import (
	"context"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bcsim:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		gateway     = flag.String("gateway", "127.0.0.1:8443", "the gateway's host:port")
		serverName  = flag.String("server-name", "", "the name in the gateway's certificate (default: the host of --gateway)")
		caFile      = flag.String("ca", "", "the node CA bundle (PEM) that verifies the gateway; required")
		keyFile     = flag.String("joinservice-key", "", "joinservice's public key (PEM); required for nodes that have not joined")
		token       = flag.String("token", "", "a join token with a use for every node that has not joined")
		nodes       = flag.Int("nodes", 100, "how many simulated nodes to run")
		root        = flag.String("root", "bcsim-state", "state directory (one per node); joined nodes are reused")
		concurrency = flag.Int("join-concurrency", 16, "joins in flight")
		every       = flag.Duration("every", time.Second, "how often to print the session count")
		verbose     = flag.Bool("v", false, "log the agents' warnings to stderr")
	)
	flag.Parse()
	if *caFile == "" || *nodes < 1 {
		flag.Usage()
		return errors.New("--ca and --nodes ≥ 1 are required")
	}
	raiseFileLimit()

	caPEM, err := os.ReadFile(*caFile)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %s", *caFile)
	}
	var pub []byte
	var keyID string
	if *keyFile != "" {
		keyPEM, err := os.ReadFile(*keyFile)
		if err != nil {
			return err
		}
		if pub, keyID, err = join.ParsePublicKey(keyPEM); err != nil {
			return err
		}
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	fmt.Printf("joining and starting %d nodes against %s\n", *nodes, *gateway)
	var sessions atomic.Int64
	fleet, err := sim.Start(ctx, sim.Config{
		Gateway: *gateway, ServerName: *serverName, RootCAs: roots, Token: *token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: *root,
		JoinConcurrency: *concurrency, Logger: logger,
		OnSession: func(up bool) {
			if up {
				sessions.Add(1)
			} else {
				sessions.Add(-1)
			}
		},
	}, *nodes)
	if err != nil {
		return err
	}
	defer fleet.Stop()
	fmt.Printf("%d nodes ready in %s (%.1f/s)\n", *nodes, time.Since(start).Round(time.Millisecond), float64(*nodes)/time.Since(start).Seconds())

	t := time.NewTicker(*every)
	defer t.Stop()
	last := int64(-1)
	for {
		select {
		case <-ctx.Done():
			fmt.Println("stopping")
			return nil
		case <-t.C:
			if n := sessions.Load(); n != last {
				fmt.Printf("%s  sessions %d/%d\n", time.Since(start).Round(time.Second), n, *nodes)
				last = n
			}
		}
	}
}

// raiseFileLimit lifts the soft open-files limit to the hard one: every
// simulated node holds a connection.
func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) == nil && l.Cur < l.Max {
		l.Cur = l.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
	}
}
