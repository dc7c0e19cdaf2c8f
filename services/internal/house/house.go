// Package house states two rules of the services module's layout and
// checks them, for its tests (and docs/architecture.md) to enforce:
//
//   - role packages are leaves ([Lateral]): a package under services/
//     imports only pkg/…, proto/… and third-party packages; the assembling
//     packages (app, cli, dev, cmd/…, chaos) may import any role, and the
//     interface plane (console, mcpserver) may import api. What two roles
//     share lives in pkg/. The depguard rule roles-are-leaves in
//     .golangci.yml says the same to the linter.
//   - SQL lives only in stores ([SQLLiterals]): no non-test file under
//     services/ holds an SQL statement; the store package under pkg/ named
//     for the table does.
package house

import (
	"slices"
	"strings"
)

// Module is the services module's import path.
const Module = "github.com/bettercompute/bettercompute/services"

// Assemblers are the services packages (by their first path element under
// services/) that put roles together and may import any of them.
var Assemblers = []string{"app", "cli", "dev", "cmd", "chaos"}

// InterfacePlane maps the interface packages to the roles they may import:
// the console and the MCP server are API clients.
var InterfacePlane = map[string][]string{
	"console":   {"api"},
	"mcpserver": {"api"},
}

// Edge is one import of a role package from another.
type Edge struct{ From, To string }

func (e Edge) String() string { return e.From + " imports " + e.To }

// role returns the first path element of a services package
// ("github.com/…/services/api/x" is "api") and whether path is one.
func role(path string) (string, bool) {
	rest, ok := strings.CutPrefix(path, Module+"/")
	if !ok {
		return "", false
	}
	r, _, _ := strings.Cut(rest, "/")
	return r, true
}

// Lateral returns the imports in imports (package path to the paths it
// imports) that break the leaves rule, sorted.
func Lateral(imports map[string][]string) []Edge {
	var out []Edge
	for from, to := range imports {
		fr, ok := role(from)
		if !ok || slices.Contains(Assemblers, fr) {
			continue
		}
		for _, imp := range to {
			tr, ok := role(imp)
			if !ok || tr == fr || slices.Contains(InterfacePlane[fr], tr) {
				continue
			}
			out = append(out, Edge{From: from, To: imp})
		}
	}
	slices.SortFunc(out, func(a, b Edge) int { return strings.Compare(a.String(), b.String()) })
	return out
}
