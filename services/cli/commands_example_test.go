package cli

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// TestCommandsExample runs the spec's commands.run and commands.get example
// verbatim, with $BETTER_COMPUTE_TENANT expanded to root, against the real
// server.
func TestCommandsExample(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	port := 0
	cfg := &config.Config{Database: config.Database{URL: url}, Server: config.Server{Host: "127.0.0.1", Port: &port}}
	cfg.Defaults()
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	db, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	cred, err := bootstrap.Run(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}
	const node = "node_cli1"
	fixture.Pool(t, db, fixture.PoolOpts{ID: "pool_cli"})
	fixture.Node(t, db, fixture.NodeOpts{ID: node, Pool: "pool_cli", State: nodes.StateAdopted})
	if err := authz.Put(t.Context(), db, authz.Resource{Type: authz.TypeNode, ID: node, TenantID: "root", PoolID: "pool_cli"}); err != nil {
		t.Fatal(err)
	}
	flags := []string{"--url", "http://" + a.Addr(), "--token", cred.Token, "--client-config", emptyClientConfig(t)}

	// better-compute api commands.run tenantId=$BETTER_COMPUTE_TENANT nodeId=node_… kind=inventory.refresh payload:='{"sections": ["gpus"], "rescan": true}' idempotencyKey=refresh-1
	code, out, stderr := execCLI(t, "", append([]string{"api", "commands.run", "tenantId=root", "nodeId=" + node,
		"kind=inventory.refresh", `payload:={"sections": ["gpus"], "rescan": true}`, "idempotencyKey=refresh-1"}, flags...)...)
	if code != serve.ExitOK {
		t.Fatalf("commands.run: exit %d\n%s%s", code, out, stderr)
	}
	var run struct {
		Command struct {
			ID      string `json:"id"`
			State   string `json:"state"`
			Payload struct {
				Sections []string `json:"sections"`
				Rescan   bool     `json:"rescan"`
			} `json:"payload"`
		} `json:"command"`
	}
	if err := json.Unmarshal([]byte(out), &run); err != nil || run.Command.State != "pending" || !run.Command.Payload.Rescan || run.Command.Payload.Sections[0] != "gpus" {
		t.Fatalf("commands.run printed %s (%v)", out, err)
	}

	// better-compute api commands.get tenantId=$BETTER_COMPUTE_TENANT nodeId=node_… commandId=cmd_…
	code, out, stderr = execCLI(t, "", append([]string{"api", "commands.get", "tenantId=root", "nodeId=" + node, "commandId=" + run.Command.ID}, flags...)...)
	if code != serve.ExitOK {
		t.Fatalf("commands.get: exit %d\n%s%s", code, out, stderr)
	}
	var got struct {
		Command struct {
			ID   string `json:"id"`
			Kind string `json:"kind"`
		} `json:"command"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || got.Command.ID != run.Command.ID || got.Command.Kind != "inventory.refresh" {
		t.Fatalf("commands.get printed %s (%v)", out, err)
	}
}
