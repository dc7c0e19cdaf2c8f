// Command bcd is Better Compute's node daemon.
package main

import (
	"os"

	"github.com/bettercompute/bettercompute/agent/bcd"
)

func main() {
	os.Exit(bcd.Main(os.Args[1:], os.Stdout, os.Stderr))
}
