// Command placer is Better Compute's placer deployable: `better-compute serve
// --roles placer` as its own binary, with the same configuration and flags.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func main() {
	os.Exit(serve.MainDeployable(config.RolePlacer, os.Args[1:], os.Stdout, os.Stderr))
}
