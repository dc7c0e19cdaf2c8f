// Package serve is the serve path of the command line: the configuration
// flags every command shares, `serve`, `version`, and the exit code a command
// ends with. Each deployable's thin main runs [MainDeployable], which is
// serve with its role fixed, and links nothing else: package cli builds the
// full better-compute command (migrate, dev, the API client, …) on top of
// this one.
package serve

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/telemetry"
	"github.com/bettercompute/bettercompute/pkg/version"
	"github.com/bettercompute/bettercompute/services/app"
)

// Exit codes.
const (
	ExitOK     = 0
	ExitError  = 1
	ExitConfig = 2
)

// Report prints err and returns the exit code: 2 for INVALID_CONFIG,
// UNSUPPORTED and usage errors, 1 for anything else.
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
	var ue UsageError
	if errors.As(err, &ue) {
		return ExitConfig
	}
	return ExitError
}

// UsageError is a command line the command cannot run: a bad flag or
// argument. [Report] exits 2 on it.
type UsageError struct{ error }

// Usage wraps err as a [UsageError].
func Usage(err error) error { return UsageError{err} }

// Globals are the flags every command shares; they override the file and
// environment.
type Globals struct {
	configPath  string
	databaseURL string
	natsURL     string
	logLevel    string
	logFormat   string
}

// Register adds the global flags to fs (a command's persistent flags).
func (g *Globals) Register(fs *pflag.FlagSet) {
	fs.StringVarP(&g.configPath, "config", "c", os.Getenv("BC_CONFIG"), "configuration file (YAML); env BC_CONFIG")
	fs.StringVar(&g.databaseURL, "database-url", "", "PostgreSQL URL (overrides database.url)")
	fs.StringVar(&g.natsURL, "nats-url", "", "NATS server URL(s) (overrides nats.url)")
	fs.StringVar(&g.logLevel, "log-level", "", "debug, info, warn or error (overrides log.level)")
	fs.StringVar(&g.logFormat, "log-format", "", "json or text (overrides log.format)")
}

// Load reads the file and environment, then applies the global flags. The
// caller applies its own flags, then calls [Finish].
func (g *Globals) Load() (*config.Config, error) {
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

// Finish fills defaults and validates.
func Finish(cfg *config.Config) error {
	cfg.Defaults()
	return cfg.Validate()
}

// Flags are serve's own flags (dev takes them too).
type Flags struct {
	roles     []string
	port      int
	noMigrate bool
}

// Register adds the flags to cmd; --roles only when withRoles.
func (f *Flags) Register(cmd *cobra.Command, withRoles bool) {
	if withRoles {
		cmd.Flags().StringSliceVar(&f.roles, "roles", nil, "roles to run, comma-separated: "+rolesHelp()+" (default all)")
	}
	cmd.Flags().IntVar(&f.port, "port", -1, fmt.Sprintf("port for gRPC, REST, /healthz and /readyz (default %d; /metrics is on server.adminAddr)", config.DefaultPort))
	cmd.Flags().BoolVar(&f.noMigrate, "no-migrate", false, "do not apply migrations; refuse to start if the schema is behind")
}

// Apply sets the flags cmd's command line gave on cfg.
func (f *Flags) Apply(cmd *cobra.Command, cfg *config.Config) {
	if cmd.Flags().Changed("roles") {
		cfg.Roles = f.roles
	}
	if cmd.Flags().Changed("port") {
		p := f.port
		cfg.Server.Port = &p
	}
	if f.noMigrate {
		cfg.Server.NoMigrate = true
	}
}

func rolesHelp() string {
	names := make([]string, 0, len(config.AllRoles))
	for _, r := range config.AllRoles {
		names = append(names, string(r))
	}
	return strings.Join(names, ", ") + ", all"
}

// New returns the serve command, reading the global flags from g.
func New(g *Globals, stderr io.Writer) *cobra.Command {
	f := &Flags{}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run control-plane roles against the configured database",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd, g, f, stderr)
		},
	}
	f.Register(cmd, true)
	return cmd
}

func run(cmd *cobra.Command, g *Globals, f *Flags, stderr io.Writer) error {
	cfg, err := g.Load()
	if err != nil {
		return err
	}
	f.Apply(cmd, cfg)
	if err := Finish(cfg); err != nil {
		return err
	}
	logger := telemetry.NewLogger(stderr, cfg.Log.Format, cfg.Log.Level)
	return app.Run(cmd.Context(), cfg, app.Options{Logger: logger})
}

// Version returns the version command.
func Version(stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version of this binary and the schema version it needs",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			v := version.Get()
			fmt.Fprintf(stdout, "better-compute %s (commit %s, %s, schema %d)\n", v.Version, v.Commit, v.GoVersion, migrate.Latest())
			return nil
		},
	}
}

// Deployable returns the command of one deployable's own binary: serve with
// its role fixed, and the same configuration and flags.
func Deployable(role config.Role, stdout, stderr io.Writer) *cobra.Command {
	g := &Globals{}
	f := &Flags{}
	cmd := &cobra.Command{
		Use:           string(role),
		Short:         fmt.Sprintf("Better Compute's %s (the %s role of better-compute serve)", role, role),
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.roles = []string{string(role)}
			_ = cmd.Flags().Set("roles", string(role))
			return run(cmd, g, f, stderr)
		},
	}
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return UsageError{err} })
	g.Register(cmd.PersistentFlags())
	f.Register(cmd, true)
	_ = cmd.Flags().MarkHidden("roles")
	cmd.AddCommand(Version(stdout))
	return cmd
}

// MainDeployable runs a deployable's command with args (without the program
// name) and returns the process exit code.
func MainDeployable(role config.Role, args []string, stdout, stderr io.Writer) int {
	ctx, stop := SignalContext()
	defer stop()
	cmd := Deployable(role, stdout, stderr)
	cmd.SetArgs(args)
	return Report(stderr, cmd.ExecuteContext(ctx))
}

// SignalContext returns a context that SIGINT and SIGTERM cancel, which stops
// a server cleanly.
func SignalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}
