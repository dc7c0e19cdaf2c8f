// Package runtimespec is the one rule for what a NodeSpec runtime section
// may hold, read by both sides of the wire: pools.update refuses exactly
// what the node's daemon (bcd's runtime section) would refuse, so a bad
// value never reaches a node. The directories end up in engine
// configuration files (containerd and CRI-O TOML, Docker's daemon.json,
// containers.conf), so anything that could break out of a quoted string is
// refused.
package runtimespec

import (
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// The engines the section wires to CDI.
const (
	Containerd = "containerd"
	CRIO       = "cri-o"
	Docker     = "docker"
	Podman     = "podman"
)

// Engines are the engine names the section takes, in the order the daemon
// configures them.
var Engines = []string{Containerd, CRIO, Docker, Podman}

// Bounds of the section's fields.
const (
	// MaxDirs bounds cdi_spec_dirs.
	MaxDirs = 4
	// MaxDir bounds one directory's length.
	MaxDir = 255
)

// DefaultDir is where the CDI spec goes when cdi_spec_dirs is empty: the
// CDI library's and every engine's default dynamic directory.
const DefaultDir = "/var/run/cdi"

// Roots are the directories a cdi_spec_dirs entry must be or lie under:
// the places engines read CDI specs from. bcd creates the directory and
// writes its spec there as root, so the control plane cannot name an
// arbitrary directory of the node's.
var Roots = []string{"/etc/cdi", "/var/run/cdi", "/run/cdi"}

// Problem is what is wrong with one field: Field is the section's field
// name (engines, cdi_spec_dirs, min_container_toolkit_version).
type Problem struct {
	Field, Msg string
}

// String is "field: message".
func (p Problem) String() string { return p.Field + ": " + p.Msg }

// Dirs are the directories the spec is written to: the section's, or
// DefaultDir.
func Dirs(r *agentv1.RuntimeSettings) []string {
	if d := r.GetCdiSpecDirs(); len(d) > 0 {
		return slices.Clone(d)
	}
	return []string{DefaultDir}
}

// Validate returns what is wrong with r, each problem naming its field.
func Validate(r *agentv1.RuntimeSettings) []Problem {
	var bad []Problem
	add := func(field, format string, a ...any) {
		bad = append(bad, Problem{Field: field, Msg: fmt.Sprintf(format, a...)})
	}
	es := r.GetEngines()
	if len(es) > len(Engines) {
		add("engines", "%d values, at most %d", len(es), len(Engines))
	} else {
		for i, e := range es {
			if !slices.Contains(Engines, e) {
				add("engines", "%q: want containerd, cri-o, docker or podman", clip(e))
				break
			}
			if slices.Contains(es[:i], e) {
				add("engines", "%q named twice", e)
				break
			}
		}
	}
	ds := r.GetCdiSpecDirs()
	if len(ds) > MaxDirs {
		add("cdi_spec_dirs", "%d values, at most %d", len(ds), MaxDirs)
	} else {
		for i, d := range ds {
			if err := dir(d); err != nil {
				add("cdi_spec_dirs", "%q: %v", clip(d), err)
				break
			}
			if slices.Contains(ds[:i], d) {
				add("cdi_spec_dirs", "%q named twice", d)
				break
			}
		}
	}
	if v := r.GetMinContainerToolkitVersion(); v != "" {
		if _, err := ParseVersion(v); err != nil {
			add("min_container_toolkit_version", "%q: %v", clip(v), err)
		}
	}
	return bad
}

// dir accepts a clean absolute path of printable characters that cannot
// close a quoted TOML or JSON string.
func dir(d string) error {
	switch {
	case d == "":
		return fmt.Errorf("empty")
	case len(d) > MaxDir:
		return fmt.Errorf("longer than %d bytes", MaxDir)
	case !path.IsAbs(d):
		return fmt.Errorf("not an absolute path")
	case path.Clean(d) != d:
		return fmt.Errorf("not a clean path (want %s)", path.Clean(d))
	case !underRoot(d):
		return fmt.Errorf("not /etc/cdi, /var/run/cdi, /run/cdi or a directory under one")
	}
	for _, r := range d {
		if r <= ' ' || r == 0x7f || r == '"' || r == '\'' || r == '\\' || r == '#' || r == ';' || r == '$' || r == '`' || r > 0x7e {
			return fmt.Errorf("contains %q", r)
		}
	}
	return nil
}

func underRoot(d string) bool {
	for _, r := range Roots {
		if d == r || strings.HasPrefix(d, r+"/") {
			return true
		}
	}
	return false
}

// Version is a toolkit version, major.minor.patch.
type Version [3]int

// ParseVersion reads "1.14.0" (a leading "v" and a "-rc.1"-style suffix
// allowed; a missing patch is 0).
func ParseVersion(v string) (Version, error) {
	var out Version
	s := strings.TrimPrefix(v, "v")
	if i := strings.IndexAny(s, "-+ "); i >= 0 {
		s = s[:i]
	}
	parts := strings.Split(s, ".")
	if len(v) > 32 || len(parts) < 2 || len(parts) > 3 {
		return out, fmt.Errorf("want a version such as 1.14.0")
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 || n > 9999 || p == "" || (len(p) > 1 && p[0] == '0') {
			return out, fmt.Errorf("want a version such as 1.14.0")
		}
		out[i] = n
	}
	return out, nil
}

// Less reports whether v is older than w.
func (v Version) Less(w Version) bool {
	for i := range v {
		if v[i] != w[i] {
			return v[i] < w[i]
		}
	}
	return false
}

// String is "major.minor.patch".
func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v[0], v[1], v[2]) }

func clip(v string) string {
	if len(v) > 64 {
		return v[:64] + "…"
	}
	return v
}
