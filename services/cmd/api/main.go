// Command api is Better Compute's api deployable: `better-compute serve
// --roles api` as its own binary, with the same configuration and flags.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func main() {
	os.Exit(serve.MainDeployable(config.RoleAPI, os.Args[1:], os.Stdout, os.Stderr))
}
