package wake_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// subjectRoots start every subject package wake defines.
var subjectRoots = []string{"bc.poke.", "bc.commands.", "bc.nodespec.", "bc.sitetasks.", "bc.webhooks.", "bc.authz.", "bc.events."}

// handWired lists, under root, the non-test Go files' after-commit wakes
// wired by hand (a call of a method named Poke or AfterCommit) and subjects
// spelt out (a string literal starting with a wake subject), outside
// package wake itself.
func handWired(t *testing.T, root string) []string {
	t.Helper()
	self, err := filepath.Abs(".") // package wake
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if abs, _ := filepath.Abs(path); d.Name() == "testdata" || abs == self {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CallExpr:
				if sel, ok := n.Fun.(*ast.SelectorExpr); ok && (sel.Sel.Name == "Poke" || sel.Sel.Name == "AfterCommit") {
					found = append(found, fset.Position(n.Pos()).String()+": ."+sel.Sel.Name+" wakes by hand; use reconcile.Queue's wakes")
				}
			case *ast.BasicLit:
				if n.Kind != token.STRING {
					return true
				}
				v, err := strconv.Unquote(n.Value)
				if err == nil && slices.ContainsFunc(subjectRoots, func(r string) bool { return strings.HasPrefix(v, r) }) {
					found = append(found, fset.Position(n.Pos()).String()+": subject "+n.Value+" spelt out; use package wake's")
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// TestNoHandWiredWakes: every after-commit wake under pkg/ and services/
// goes through reconcile.Queue and package wake, and every subject is
// package wake's.
func TestNoHandWiredWakes(t *testing.T) {
	for _, root := range []string{"..", filepath.Join("..", "..", "services")} {
		if _, err := os.Stat(root); err != nil {
			t.Fatal(err)
		}
		for _, f := range handWired(t, root) {
			t.Error(f)
		}
	}
}

// TestHandWiredCatchesPlanted: the scan finds a planted hand-wired poke,
// after-commit hook and subject literal.
func TestHandWiredCatchesPlanted(t *testing.T) {
	dir := t.TempDir()
	src := `package planted

func f(q interface{ AfterCommit(func()) }, p interface{ Poke(...string) }, publish func(string, []byte) error) {
	q.AfterCommit(func() {})
	p.Poke("node_a")
	_ = publish("bc.webhooks.due", nil)
	_ = "bc.token" // not a subject
}
`
	if err := os.WriteFile(filepath.Join(dir, "planted.go"), []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "planted_test.go"), []byte("package planted\n\nfunc g(p interface{ Poke() }) { p.Poke() }\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	found := handWired(t, dir)
	if len(found) != 3 || !strings.Contains(found[0], ".AfterCommit") || !strings.Contains(found[1], ".Poke") || !strings.Contains(found[2], "bc.webhooks.due") {
		t.Fatalf("found %q, want the AfterCommit, the Poke and the subject of planted.go", found)
	}
}
