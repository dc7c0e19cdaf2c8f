package events_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/events"
)

var nameRE = regexp.MustCompile(`^[a-z][a-zA-Z]*(\.[a-z][a-zA-Z_]*)+$`)

var subjects = []string{"node", "reservation", "command", "pool", "tenant", "identity", "apiKey", "joinToken", "policy", "webhook", "site", "machine", "instance", "rollout", ""}

func TestCatalog(t *testing.T) {
	t.Parallel()
	ts := events.Catalog()
	t.Run("every type is well formed and documented", func(t *testing.T) {
		t.Parallel()
		seen := map[string]bool{}
		for _, typ := range ts {
			if !nameRE.MatchString(typ.Name) {
				t.Errorf("%q does not match %s", typ.Name, nameRE)
			}
			if seen[typ.Name] {
				t.Errorf("%s is listed twice", typ.Name)
			}
			seen[typ.Name] = true
			if strings.TrimSpace(typ.Doc) == "" {
				t.Errorf("%s has no Doc", typ.Name)
			}
			if !slices.Contains(subjects, typ.Subject) {
				t.Errorf("%s: subject %q is not one of %q", typ.Name, typ.Subject, subjects)
			}
			switch {
			case typ.Payload == nil && len(typ.Fields) == 0:
				t.Errorf("%s has neither a payload message nor fields", typ.Name)
			case typ.Payload != nil && len(typ.Fields) > 0:
				t.Errorf("%s has both a payload message and fields", typ.Name)
			}
			for _, f := range typ.Fields {
				if f.Name == "" || f.Type == "" || f.Doc == "" {
					t.Errorf("%s: field %+v needs a name, a type and a doc", typ.Name, f)
				}
			}
		}
	})
	t.Run("sorted by name", func(t *testing.T) {
		t.Parallel()
		if !slices.IsSortedFunc(ts, func(a, b events.Type) int { return strings.Compare(a.Name, b.Name) }) {
			t.Error("Catalog is not sorted by name")
		}
	})
	t.Run("a copy", func(t *testing.T) {
		t.Parallel()
		a := events.Catalog()
		a[0].Name = "changed"
		a[0].Fields = append(a[0].Fields, events.Field{Name: "x"})
		if b := events.Catalog(); b[0].Name == "changed" || len(b[0].Fields) != len(ts[0].Fields) {
			t.Error("changing Catalog's result changed the catalog")
		}
	})
	t.Run("lookup", func(t *testing.T) {
		t.Parallel()
		if typ, ok := events.Lookup("pool.created"); !ok || typ.Subject != "pool" {
			t.Errorf("Lookup(pool.created) = %+v, %v", typ, ok)
		}
		if _, ok := events.Lookup("pool.exploded"); ok {
			t.Error("Lookup(pool.exploded) found a type")
		}
	})
	t.Run("every command state has its type", func(t *testing.T) {
		t.Parallel()
		// pkg/commands writes "command." + state: dynamic, so the source
		// walk below cannot see it.
		for _, st := range commands.States {
			if _, ok := events.Lookup("command." + string(st)); !ok {
				t.Errorf("command.%s is not in the catalog", st)
			}
		}
	})
}

// TestCatalogCoversWriters walks the non-test Go sources of pkg/ and
// services/ for the event types written as literals and fails when one is
// not in the catalog. It finds:
//
//   - the event argument of outcome(resp, "pool.created", …) (services/api);
//   - the Type of outbox.Event{…} literals;
//   - string literals assigned to a variable named event (the gateway's
//     node.converged and node.convergence_failed, joinservice's node.joined
//     and node.reclaimed, reservations.create's reservation.created and
//     reservation.placed);
//   - the type argument of services/capacity's event(ctx, tx, tenant,
//     "reservation.bound", …).
//
// The one type it cannot see is pkg/commands' "command." + state, which
// TestCatalog checks against commands.States.
func TestCatalogCoversWriters(t *testing.T) {
	t.Parallel()
	found := map[string]string{} // type → where
	fset := token.NewFileSet()
	for _, root := range []string{"../../pkg", "../../services"} {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return nil
			}
			f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
			if err != nil {
				return err
			}
			for _, lit := range eventLiterals(f) {
				s, err := strconv.Unquote(lit.Value)
				if err != nil || s == "" {
					continue
				}
				found[s] = fset.Position(lit.Pos()).String()
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(found) < 20 {
		t.Fatalf("found only %d event types in the sources: is the walk still looking in the right places? %v", len(found), found)
	}
	for typ, where := range found {
		if _, ok := events.Lookup(typ); !ok {
			t.Errorf("%s: event type %q is not in the catalog (pkg/events/catalog.go)", where, typ)
		}
	}
}

// eventLiterals returns the string literals in f that name an event type.
func eventLiterals(f *ast.File) []*ast.BasicLit {
	var out []*ast.BasicLit
	str := func(e ast.Expr) {
		if lit, ok := e.(*ast.BasicLit); ok && lit.Kind == token.STRING {
			out = append(out, lit)
		}
	}
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.CallExpr:
			fn, ok := n.Fun.(*ast.Ident)
			switch {
			case !ok:
			case fn.Name == "outcome" && len(n.Args) >= 2:
				str(n.Args[1])
			case fn.Name == "event" && f.Name.Name == "capacity" && len(n.Args) >= 4:
				str(n.Args[3])
			}
		case *ast.CompositeLit:
			sel, ok := n.Type.(*ast.SelectorExpr)
			if !ok || sel.Sel.Name != "Event" {
				break
			}
			if x, ok := sel.X.(*ast.Ident); !ok || x.Name != "outbox" {
				break
			}
			for _, e := range n.Elts {
				if kv, ok := e.(*ast.KeyValueExpr); ok {
					if k, ok := kv.Key.(*ast.Ident); ok && k.Name == "Type" {
						str(kv.Value)
					}
				}
			}
		case *ast.AssignStmt:
			for i, lhs := range n.Lhs {
				if id, ok := lhs.(*ast.Ident); ok && id.Name == "event" && i < len(n.Rhs) {
					str(n.Rhs[i])
				}
			}
		}
		return true
	})
	return out
}
