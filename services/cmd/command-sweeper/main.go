// Command command-sweeper is Better Compute's command-sweeper deployable: `better-compute serve
// --roles command-sweeper` as its own binary, with the same configuration and flags.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func main() {
	os.Exit(serve.MainDeployable(config.RoleCommandSweeper, os.Args[1:], os.Stdout, os.Stderr))
}
