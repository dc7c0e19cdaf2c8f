// Package cli is the better-compute command line: version, migrate, serve,
// dev, bootstrap, pki, the API client and the rest. The serve path it shares
// with each deployable's own binary (the global flags, serve, version, the
// exit codes) is package [serve]; only the better-compute main imports this
// one, so a deployable links neither dev nor the client commands.
package cli

import (
	"io"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// Main runs the better-compute command with args (without the program name)
// and returns the process exit code. SIGINT and SIGTERM cancel the command's
// context, which stops a server cleanly.
func Main(args []string, stdout, stderr io.Writer) int {
	ctx, stop := serve.SignalContext()
	defer stop()
	root := NewRoot(stdout, stderr)
	root.SetArgs(args)
	return serve.Report(stderr, root.ExecuteContext(ctx))
}

// NewRoot returns the better-compute command tree.
func NewRoot(stdout, stderr io.Writer) *cobra.Command {
	g := &serve.Globals{}
	root := &cobra.Command{
		Use:           "better-compute",
		Short:         "Better Compute: the control plane for fleets of GPU servers",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return serve.Usage(err) })
	g.Register(root.PersistentFlags())
	root.AddCommand(
		serve.Version(stdout),
		newMigrate(g, stdout, stderr),
		serve.New(g, stderr),
		newDev(g, stdout, stderr),
		newProbe(stdout),
		newAPI(stdout, stderr),
		newAudit(stdout, stderr),
		newEvents(stdout, stderr),
		newCommandsCmd(stdout, stderr),
		newWebhooks(stdout, stderr),
		newBootstrap(g, stdout, stderr),
		newPKI(stdout),
		newArtifacts(stdout),
		newJoinScript(stdout, stderr),
		newMCP(stdout, stderr),
		newTunnel(stdout, stderr),
		newSSH(stdout, stderr),
	)
	return root
}
