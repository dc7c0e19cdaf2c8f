package cli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/spf13/cobra"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/version"
	"github.com/bettercompute/bettercompute/services/mcpserver"
)

// newMCP is `better-compute mcp`: the MCP server on stdin/stdout, calling
// the remote API over gRPC as the caller's own API key.
func newMCP(stdout, stderr io.Writer) *cobra.Command {
	f := &apiFlags{}
	var readOnly bool
	cmd := &cobra.Command{
		Use:   "mcp",
		Short: "Serve the Model Context Protocol on stdio, as your API key",
		Long: "mcp serves the MCP tools (nodes_list, nodes_get, nodes_drain, commands_run, commands_get, reservations_create, " +
			"reservations_get, reservations_release, capacity_get, events_list) on stdin and stdout for an MCP client that " +
			"starts it, and calls the API at the URL (--url, $" + EnvURL + ", client.url, " + DefaultURL + ") over gRPC with the " +
			"API key (--token, $" + EnvToken + ", client.token): every tool runs as that key's identity. --read-only offers " +
			"only the read tools. Logs go to stderr. See docs/mcp.md.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runMCP(cmd.Context(), f, readOnly, cmd.InOrStdin(), stdout, stderr)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.url, "url", "", "API base URL (default $"+EnvURL+", client.url, "+DefaultURL+")")
	fl.StringVar(&f.token, "token", "", "API key sent as a bearer token (default $"+EnvToken+", client.token)")
	fl.StringVar(&f.clientConfig, "client-config", "", "client config file (default $"+EnvClientConfig+", ~/.config/better-compute/client.yaml)")
	fl.DurationVar(&f.timeout, "timeout", 30*time.Second, "how long to wait for the API to answer the first identity check")
	fl.BoolVar(&readOnly, "read-only", false, "offer only the read tools")
	return cmd
}

// runMCP checks the key with system.whoAmI, then serves MCP on stdin and
// stdout until stdin ends or ctx is cancelled.
func runMCP(ctx context.Context, f *apiFlags, readOnly bool, stdin io.Reader, stdout, stderr io.Writer) error {
	cc, err := resolveClient(f, os.Getenv)
	if err != nil {
		return err
	}
	if cc.Token == "" {
		return fault.New(fault.InvalidConfig, "client.token",
			"better-compute mcp runs every tool as your API key: pass --token or set $%s", EnvToken)
	}
	conn, err := client.New(cc.URL, client.WithToken(cc.Token))
	if err != nil {
		return fault.Wrap(err, fault.InvalidConfig, "client.url", "%v", err)
	}
	defer func() { _ = conn.Close() }()
	wctx, cancel := context.WithTimeout(ctx, f.timeout)
	who, err := computev1.NewSystemServiceClient(conn).WhoAmI(wctx, &computev1.WhoAmIRequest{})
	cancel()
	if err != nil {
		return fmt.Errorf("the API at %s: %s", cc.URL, client.EnvelopeOf(err))
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	fmt.Fprintf(stderr, "better-compute mcp: serving on stdio as %s (%s) of tenant %s, API %s\n",
		who.GetName(), who.GetIdentityId(), who.GetTenantId(), cc.URL)
	srv := mcpserver.NewServer(mcpserver.Config{Conn: conn, ReadOnly: readOnly, Version: version.Get().Version, Logger: logger})
	err = srv.Run(ctx, &mcp.IOTransport{Reader: io.NopCloser(stdin), Writer: nopWriteCloser{stdout}})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

type nopWriteCloser struct{ io.Writer }

func (nopWriteCloser) Close() error { return nil }
