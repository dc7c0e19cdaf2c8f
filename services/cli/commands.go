package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/telemetry"
	"github.com/bettercompute/bettercompute/pkg/version"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/dev"
)

func newVersion(stdout io.Writer) *cobra.Command {
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

func newMigrate(g *globals, stdout, stderr io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate [up|status]",
		Short: "Apply the database migrations (up, the default) or list them (status)",
		Long: "migrate applies every pending migration under a lock, so two migrators never interleave; " +
			"run it once per deploy, then start services with --no-migrate.",
		Args:      cobra.MaximumNArgs(1),
		ValidArgs: []string{"up", "status"},
		RunE: func(cmd *cobra.Command, args []string) error {
			action := "up"
			if len(args) == 1 {
				action = args[0]
			}
			if action != "up" && action != "status" {
				return usageError{fmt.Errorf("unknown migrate action %q; expected up or status", action)}
			}
			cfg, err := g.load()
			if err != nil {
				return err
			}
			if err := finish(cfg); err != nil {
				return err
			}
			if err := cfg.RequireDatabase(); err != nil {
				return err
			}
			logger := telemetry.NewLogger(stderr, cfg.Log.Format, cfg.Log.Level)
			ctx := cmd.Context()
			pool, err := db.Open(ctx, db.Config{URL: cfg.Database.URL, PgBouncer: cfg.Database.PgBouncer, ApplicationName: "better-compute migrate"})
			if err != nil {
				return err
			}
			defer pool.Close()
			m, err := migrate.New(pool, migrate.Config{TableLock: cfg.Database.PgBouncer, Logger: logger})
			if err != nil {
				return err
			}
			defer func() { _ = m.Close() }()
			if action == "up" {
				applied, err := m.Up(ctx)
				if err != nil {
					return err
				}
				current, err := migrate.Current(ctx, pool)
				if err != nil {
					return err
				}
				fmt.Fprintf(stdout, "applied %d migration(s); schema is at version %d\n", len(applied), current)
				return nil
			}
			st, err := m.Status(ctx)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "VERSION\tNAME\tSTATE")
			for _, s := range st {
				state := "pending"
				if s.Applied {
					state = "applied"
				}
				fmt.Fprintf(tw, "%d\t%s\t%s\n", s.Version, s.Name, state)
			}
			return tw.Flush()
		},
	}
	return cmd
}

// serveFlags are serve's own flags.
type serveFlags struct {
	roles     []string
	port      int
	noMigrate bool
}

func (f *serveFlags) register(cmd *cobra.Command, withRoles bool) {
	if withRoles {
		cmd.Flags().StringSliceVar(&f.roles, "roles", nil, "roles to run, comma-separated: "+rolesHelp()+" (default all)")
	}
	cmd.Flags().IntVar(&f.port, "port", -1, fmt.Sprintf("port for gRPC, REST, /healthz, /readyz and /metrics (default %d)", config.DefaultPort))
	cmd.Flags().BoolVar(&f.noMigrate, "no-migrate", false, "do not apply migrations; refuse to start if the schema is behind")
}

func (f *serveFlags) apply(cmd *cobra.Command, cfg *config.Config) {
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

func newServe(g *globals, stderr io.Writer) *cobra.Command {
	f := &serveFlags{}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run control-plane roles against the configured database",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runServe(cmd, g, f, stderr)
		},
	}
	f.register(cmd, true)
	return cmd
}

func runServe(cmd *cobra.Command, g *globals, f *serveFlags, stderr io.Writer) error {
	cfg, err := g.load()
	if err != nil {
		return err
	}
	f.apply(cmd, cfg)
	if err := finish(cfg); err != nil {
		return err
	}
	logger := telemetry.NewLogger(stderr, cfg.Log.Format, cfg.Log.Level)
	return app.Run(cmd.Context(), cfg, app.Options{Logger: logger})
}

func newDev(g *globals, stdout, stderr io.Writer) *cobra.Command {
	f := &serveFlags{}
	var simNodes, simMachines int
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run every role in one process with an embedded NATS server and a local PostgreSQL",
		Long: "dev runs the whole control plane on this machine. PostgreSQL is database.url when set, else the " +
			"local server at 127.0.0.1:5432, else a private cluster under dev.dataDir (./.data); NATS is nats.url " +
			"when set, else an embedded server storing under dev.dataDir. The gateway listens on gateway.listen " +
			"(127.0.0.1:8443) with a node CA under dev.dataDir/pki, and --sim-nodes simulated daemons join a pool \"sim\".",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			f.apply(cmd, cfg)
			if cmd.Flags().Changed("sim-nodes") {
				cfg.Dev.SimNodes = &simNodes
			}
			if cmd.Flags().Changed("sim-machines") {
				cfg.Dev.SimMachines = &simMachines
			}
			if cfg.Server.Host == "" {
				cfg.Server.Host = "127.0.0.1"
			}
			if cfg.Log.Format == "" {
				cfg.Log.Format = "text"
			}
			if err := finish(cfg); err != nil {
				return err
			}
			logger := telemetry.NewLogger(stderr, cfg.Log.Format, cfg.Log.Level)
			return dev.Run(cmd.Context(), cfg, logger, stdout)
		},
	}
	f.register(cmd, true)
	cmd.Flags().IntVar(&simNodes, "sim-nodes", 3, "simulated node daemons (mock DGX H200) to join to the pool \"sim\"; 0 for none (dev.simNodes)")
	cmd.Flags().IntVar(&simMachines, "sim-machines", 3, "simulated bare-metal machines (fake BMCs) at a simulated site \"sim\": all reach ready, one is deployed and joins; 0 for none (dev.simMachines)")
	return cmd
}

// Deployable returns the command of one deployable's own binary: serve with
// its role fixed, and the same configuration and flags.
func Deployable(role config.Role, stdout, stderr io.Writer) *cobra.Command {
	g := &globals{}
	f := &serveFlags{}
	cmd := &cobra.Command{
		Use:           string(role),
		Short:         fmt.Sprintf("Better Compute's %s (the %s role of better-compute serve)", role, role),
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.roles = []string{string(role)}
			_ = cmd.Flags().Set("roles", string(role))
			return runServe(cmd, g, f, stderr)
		},
	}
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	g.register(cmd.PersistentFlags())
	f.register(cmd, true)
	_ = cmd.Flags().MarkHidden("roles")
	cmd.AddCommand(newVersion(stdout))
	return cmd
}

// MainDeployable runs a deployable's command and returns the exit code.
func MainDeployable(role config.Role, args []string, stdout, stderr io.Writer) int {
	ctx, stop := signalContext()
	defer stop()
	cmd := Deployable(role, stdout, stderr)
	cmd.SetArgs(args)
	return Report(stderr, cmd.ExecuteContext(ctx))
}

func newProbe(stdout io.Writer) *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "probe URL",
		Short: "GET URL and exit 0 on a 2xx answer (a container health check without curl)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, args[0], nil)
			if err != nil {
				return usageError{err}
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			defer func() { _ = resp.Body.Close() }()
			if resp.StatusCode/100 != 2 {
				return fmt.Errorf("%s answered %s", args[0], resp.Status)
			}
			fmt.Fprintf(stdout, "%s %s\n", args[0], resp.Status)
			return nil
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 3*time.Second, "how long to wait for the answer")
	return cmd
}
