// Package bcd is the node daemon's command line: `bcd node`, `bcd join`,
// `bcd site` and `bcd ramdisk`. This release has only `bcd version`; the others
// answer that they are not built yet rather than pretending to run.
//
// The agent stays light: it never imports pgx or the control plane's packages
// (a test guards its dependency list).
package bcd

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// Version is set at link time (-X .../agent/bcd.Version=v0.1.0).
var Version = ""

// notBuilt are the subcommands later releases add.
var notBuilt = map[string]string{
	"node":    "run the node daemon (session, desired state, commands)",
	"join":    "join this server to a control plane with a join token",
	"site":    "run the site agent (PXE, image cache, BMC access)",
	"ramdisk": "run the commissioning agent",
}

// Main runs bcd with args (without the program name) and returns the exit
// code.
func Main(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stdout)
		return 0
	}
	switch cmd := args[0]; {
	case cmd == "version":
		fmt.Fprintf(stdout, "bcd %s (%s)\n", version(), runtime.Version())
		return 0
	case notBuilt[cmd] != "":
		fmt.Fprintf(stderr, "error: UNSUPPORTED: bcd %s is not built yet in this release\n", cmd)
		return 1
	default:
		fmt.Fprintf(stderr, "error: unknown command %q\n", cmd)
		usage(stderr)
		return 2
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: bcd <command>\n\ncommands:\n  version   print the version")
	for _, c := range []string{"join", "node", "site", "ramdisk"} {
		fmt.Fprintf(w, "  %-9s %s (not built yet)\n", c, notBuilt[c])
	}
}

func version() string {
	if Version != "" {
		return Version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
