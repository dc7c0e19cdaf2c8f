// Command controllers is Better Compute's controllers deployable: `better-compute serve
// --roles controllers` as its own binary, with the same configuration and flags.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func main() {
	os.Exit(serve.MainDeployable(config.RoleControllers, os.Args[1:], os.Stdout, os.Stderr))
}
