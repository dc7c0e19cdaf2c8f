// Command outbox-relay is Better Compute's outbox-relay deployable: `better-compute serve
// --roles outbox-relay` as its own binary, with the same configuration and flags.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func main() {
	os.Exit(serve.MainDeployable(config.RoleOutboxRelay, os.Args[1:], os.Stdout, os.Stderr))
}
