package commands_test

import (
	"os"

	"github.com/bettercompute/bettercompute/pkg/commands"
)

func writeAll(p, s string) error { return os.WriteFile(p, []byte(s), 0o600) }

// kinds is the registry these tests queue, apply and sweep through.
var kinds = commands.Builtin()
