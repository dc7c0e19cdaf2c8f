// Command better-compute is Better Compute's control plane and CLI: version,
// migrate, serve --roles, dev.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/services/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
