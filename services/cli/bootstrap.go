package cli

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func newBootstrap(g *serve.Globals, stdout, _ io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "bootstrap",
		Short: "Create the first root credential and print it once",
		Long: "bootstrap creates an identity in the root tenant (root-admin) unless one exists, installs the " +
			"root tenant's policy that gives its identities every right, mints an API key and prints it. The key " +
			"is not stored anywhere: keep it. Running bootstrap again mints another key. It uses the same " +
			"configuration as migrate and needs the schema to be migrated.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
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
			ctx := cmd.Context()
			pool, err := db.Open(ctx, db.Config{URL: cfg.Database.URL, PgBouncer: cfg.Database.PgBouncer, ApplicationName: "better-compute bootstrap"})
			if err != nil {
				return err
			}
			defer pool.Close()
			if _, err := migrate.Check(ctx, pool); err != nil {
				return err
			}
			cred, err := bootstrap.Run(ctx, pool)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "Root credential for identity %s (shown once; keep it):\n\n  %s\n\n", cred.IdentityID, cred.Token)
			fmt.Fprintf(stdout, "Use it as: Authorization: Bearer %s\n", cred.Token)
			return nil
		},
	}
}
