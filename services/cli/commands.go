package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/telemetry"
	"github.com/bettercompute/bettercompute/services/cli/serve"
	"github.com/bettercompute/bettercompute/services/dev"
)

func newMigrate(g *serve.Globals, stdout, stderr io.Writer) *cobra.Command {
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
				return serve.Usage(fmt.Errorf("unknown migrate action %q; expected up or status", action))
			}
			cfg, err := g.Load()
			if err != nil {
				return err
			}
			if err := serve.Finish(cfg); err != nil {
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

func newDev(g *serve.Globals, stdout, stderr io.Writer) *cobra.Command {
	f := &serve.Flags{}
	var simNodes, simMachines int
	var prometheus bool
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run every role in one process with an embedded NATS server and a local PostgreSQL",
		Long: "dev runs the whole control plane on this machine. PostgreSQL is database.url when set, else the " +
			"local server at 127.0.0.1:5432, else a private cluster under dev.dataDir (./.data); NATS is nats.url " +
			"when set, else an embedded server storing under dev.dataDir. The gateway listens on gateway.listen " +
			"(127.0.0.1:8443) with a node CA under dev.dataDir/pki, and --sim-nodes simulated daemons join a pool \"sim\".",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.Load()
			if err != nil {
				return err
			}
			f.Apply(cmd, cfg)
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
			if err := serve.Finish(cfg); err != nil {
				return err
			}
			logger := telemetry.NewLogger(stderr, cfg.Log.Format, cfg.Log.Level)
			return dev.Run(cmd.Context(), cfg, logger, stdout, dev.RunOptions{Prometheus: prometheus, SimMig: true})
		},
	}
	f.Register(cmd, true)
	cmd.Flags().IntVar(&simNodes, "sim-nodes", 3, "simulated node daemons (mock DGX H200) to join to the pool \"sim\"; 0 for none (dev.simNodes)")
	cmd.Flags().BoolVar(&prometheus, "prometheus", true, "start Prometheus, when installed, scraping the simulated nodes' telemetry (docs/node-telemetry.md); false: never")
	cmd.Flags().IntVar(&simMachines, "sim-machines", 3, "simulated bare-metal machines (fake BMCs) at a simulated site \"sim\": all reach ready, one is deployed and joins; 0 for none (dev.simMachines)")
	return cmd
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
				return serve.Usage(err)
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
