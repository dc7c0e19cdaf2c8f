// Command nodespec-controller is Better Compute's nodespec-controller deployable: `better-compute serve
// --roles nodespec-controller` as its own binary, with the same configuration and flags.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func main() {
	os.Exit(serve.MainDeployable(config.RoleNodeSpecController, os.Args[1:], os.Stdout, os.Stderr))
}
