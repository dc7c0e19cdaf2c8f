// Package version reports what this binary is: its release version and the
// commit it was built from, set at link time with
//
//	-ldflags "-X github.com/bettercompute/bettercompute/pkg/version.Version=v0.1.0
//	          -X github.com/bettercompute/bettercompute/pkg/version.Commit=abc123"
//
// and otherwise read from the module's build information.
package version

import (
	"runtime"
	"runtime/debug"
)

// Set at link time; see the package comment.
var (
	Version = ""
	Commit  = ""
)

// Info is this binary's version.
type Info struct {
	Version   string
	Commit    string
	GoVersion string
}

// Get returns the version, falling back to build information and then to
// "dev" and "unknown".
func Get() Info {
	i := Info{Version: Version, Commit: Commit, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			i.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && i.Commit == "" {
				i.Commit = s.Value
			}
		}
	}
	if i.Version == "" {
		i.Version = "dev"
	}
	if i.Commit == "" {
		i.Commit = "unknown"
	}
	return i
}
