package commands_test

import "os"

func writeAll(p, s string) error { return os.WriteFile(p, []byte(s), 0o600) }
