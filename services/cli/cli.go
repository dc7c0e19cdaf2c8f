// Package cli is the better-compute command line: version, migrate, serve,
// dev. Each deployable's thin main runs [Deployable], which is `serve` with
// its role fixed.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Exit codes.
const (
	ExitOK     = 0
	ExitError  = 1
	ExitConfig = 2
)

// Main runs the better-compute command with args (without the program name)
// and returns the process exit code. SIGINT and SIGTERM cancel the command's
// context, which stops a server cleanly.
func Main(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signalContext()
	defer stop()
	root := NewRoot(stdout, stderr)
	root.SetArgs(args)
	return Report(stderr, root.ExecuteContext(ctx))
}

// report prints err and returns the exit code: 2 for INVALID_CONFIG and
// usage errors, 1 for anything else.
func Report(stderr io.Writer, err error) int {
	if err == nil {
		return ExitOK
	}
	if faults := fault.All(err); len(faults) > 0 {
		code := ExitError
		for _, fe := range faults {
			fmt.Fprintf(stderr, "error: %v\n", fe)
			if fe.Code == fault.InvalidConfig {
				code = ExitConfig
			}
		}
		if fault.CodeOf(err) == fault.Unsupported {
			code = ExitConfig
		}
		return code
	}
	fmt.Fprintf(stderr, "error: %v\n", err)
	var ue usageError
	if errors.As(err, &ue) {
		return ExitConfig
	}
	return ExitError
}

type usageError struct{ error }

// globals are the flags every command shares; they override the file and
// environment.
type globals struct {
	configPath  string
	databaseURL string
	natsURL     string
	logLevel    string
	logFormat   string
}

func (g *globals) register(fs *pflag.FlagSet) {
	fs.StringVarP(&g.configPath, "config", "c", os.Getenv("BC_CONFIG"), "configuration file (YAML); env BC_CONFIG")
	fs.StringVar(&g.databaseURL, "database-url", "", "PostgreSQL URL (overrides database.url)")
	fs.StringVar(&g.natsURL, "nats-url", "", "NATS server URL(s) (overrides nats.url)")
	fs.StringVar(&g.logLevel, "log-level", "", "debug, info, warn or error (overrides log.level)")
	fs.StringVar(&g.logFormat, "log-format", "", "json or text (overrides log.format)")
}

// load reads the file and environment, then applies the global flags. The
// caller applies its own flags, then calls finish.
func (g *globals) load() (*config.Config, error) {
	cfg, err := config.Load(config.LoadOptions{Path: g.configPath})
	if err != nil {
		return nil, err
	}
	set := func(dst *string, v string) {
		if v != "" {
			*dst = v
		}
	}
	set(&cfg.Database.URL, g.databaseURL)
	set(&cfg.NATS.URL, g.natsURL)
	set(&cfg.Log.Level, g.logLevel)
	set(&cfg.Log.Format, g.logFormat)
	return cfg, nil
}

// finish fills defaults and validates.
func finish(cfg *config.Config) error {
	cfg.Defaults()
	return cfg.Validate()
}

// NewRoot returns the better-compute command tree.
func NewRoot(stdout, stderr io.Writer) *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:           "better-compute",
		Short:         "Better Compute: the control plane for fleets of GPU servers",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	g.register(root.PersistentFlags())
	root.AddCommand(
		newVersion(stdout),
		newMigrate(g, stdout, stderr),
		newServe(g, stderr),
		newDev(g, stdout, stderr),
		newProbe(stdout),
		newAPI(stdout, stderr),
		newAudit(stdout, stderr),
		newEvents(stdout, stderr),
		newWebhooks(stdout, stderr),
		newBootstrap(g, stdout, stderr),
		newPKI(stdout),
		newJoinScript(stdout, stderr),
		newMCP(stdout, stderr),
	)
	return root
}

func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}
