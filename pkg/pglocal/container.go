package pglocal

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// tcLogger sends testcontainers' log lines to slog instead of stderr.
type tcLogger struct{ l *slog.Logger }

func (t tcLogger) Printf(format string, v ...any) {
	t.l.Debug("testcontainers: " + fmt.Sprintf(format, v...))
}

// dockerHealthy reports why no Docker engine can run containers, or nil. It
// recovers from panics, which testcontainers raises for some broken setups.
func dockerHealthy(ctx context.Context, logger tcLogger) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("docker provider panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	p, err := testcontainers.ProviderDefault.GetProvider(testcontainers.WithLogger(logger))
	if err != nil {
		return fmt.Errorf("no docker engine: %w", err)
	}
	defer p.Close()
	if err := p.Health(ctx); err != nil {
		return fmt.Errorf("docker engine unhealthy: %w", err)
	}
	return nil
}

// startContainer runs a postgres container when a Docker engine is healthy.
func startContainer(ctx context.Context, opts Options) (_ *Server, err error) {
	logger := tcLogger{opts.Logger}
	if err := dockerHealthy(ctx, logger); err != nil {
		return nil, err
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("testcontainers panicked: %v", r)
		}
	}()

	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()
	ctr, err := tcpostgres.Run(ctx, opts.ContainerImage,
		testcontainers.WithLogger(logger),
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.WithUsername(superuser),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return nil, fmt.Errorf("run %s: %w", opts.ContainerImage, err)
	}
	u, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return nil, fmt.Errorf("container url: %w", err)
	}
	// ConnectionString omits the database when it equals the user's name.
	if pu, perr := url.Parse(u); perr == nil && (pu.Path == "" || pu.Path == "/") {
		pu.Path = "/postgres"
		u = pu.String()
	}
	opts.Logger.InfoContext(ctx, "started postgres container", "image", opts.ContainerImage, "id", ctr.GetContainerID())
	return &Server{
		URL:    u,
		Source: SourceContainer,
		stop: func() error {
			return testcontainers.TerminateContainer(ctr)
		},
	}, nil
}
