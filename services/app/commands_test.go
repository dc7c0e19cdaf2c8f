package app_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/app"
)

// TestCommandSweeperRole runs the command-sweeper role alone: it expires a
// pending command past its deadline on its own, with no other role.
func TestCommandSweeperRole(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	cfg := testConfig(url)
	cfg.Roles = []string{string(config.RoleCommandSweeper)}
	cfg.Commands.SweepInterval = config.Duration(50 * time.Millisecond)
	cfg.Runtime.Heartbeat = config.Duration(100 * time.Millisecond)
	cfg.Runtime.LeaseTTL = config.Duration(time.Second)
	cfg.Runtime.Poll = config.Duration(50 * time.Millisecond)
	a := start(t, cfg)
	if r := a.Roles(); len(r) != 1 || r[0] != config.RoleCommandSweeper {
		t.Fatalf("roles %v", r)
	}
	db, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	fixture.Node(t, db, fixture.NodeOpts{ID: "node_s"})
	// Already past its deadline, which no enqueue would accept.
	if _, err := db.Exec(t.Context(), `INSERT INTO commands (id, tenant_id, node_id, seq, kind, payload, idempotency_key, not_after)
		VALUES ('cmd_s', 'root', 'node_s', 1, 'diag.nvml', '\x0a00', 'k', now() - interval '1 second')`); err != nil {
		t.Fatal(err)
	}
	poll.UntilNil(t, 20*time.Second, "the command-sweeper role to expire the command", func() error {
		c, err := commands.Lookup(t.Context(), db, "node_s", "cmd_s")
		if err != nil {
			t.Fatal(err)
		}
		if c.State == commands.Expired && c.Reason == "EXPIRED" {
			return nil
		}
		return fmt.Errorf("state %s", c.State)
	})
}

func TestCommandSigningKeyFile(t *testing.T) {
	t.Parallel()
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{"api"}
	cfg.Commands.SigningKeyFile = t.TempDir() + "/missing.key"
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = a.Start(t.Context())
	a.Stop(t.Context())
	if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidConfig || fe.Field != "commands.signingKeyFile" {
		t.Fatalf("a missing signing key: %v, want INVALID_CONFIG commands.signingKeyFile", err)
	}

	// The api signs what it queues, with the key, for the trust domain.
	cfg = testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{"api"}
	cfg.Commands.SigningKeyFile = t.TempDir() + "/command.key"
	if _, err := commands.EnsureSigner(cfg.Commands.SigningKeyFile); err != nil {
		t.Fatal(err)
	}
	a = start(t, cfg)
	if dispatch, admit := a.CommandKinds(); !admit.Signs() || dispatch.Signs() {
		t.Fatalf("api process: admit signs %v, dispatch signs %v; want true, false", admit.Signs(), dispatch.Signs())
	}
}

// TestGatewayCannotForgeDestructiveCommands: a gateway process never reads
// the command-signing key — a configured file that does not even exist
// does not stop it — and its registry signs nothing, so it cannot make a
// destructive command a daemon accepts.
func TestGatewayCannotForgeDestructiveCommands(t *testing.T) {
	t.Parallel()
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{"gateway"}
	cfg.Gateway.Listen = "127.0.0.1:0"
	cfg.JoinService.KeyDir = t.TempDir()
	cfg.Commands.SigningKeyFile = t.TempDir() + "/missing.key"
	a := start(t, cfg)
	dispatch, admit := a.CommandKinds()
	if dispatch.Signs() || admit.Signs() {
		t.Fatal("a gateway process holds the command-signing key")
	}
}
