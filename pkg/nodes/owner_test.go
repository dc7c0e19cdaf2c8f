package nodes_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// writesNodes matches a statement that writes the nodes table.
var writesNodes = regexp.MustCompile(`(?i)\b(?:UPDATE|INSERT\s+INTO|DELETE\s+FROM)\s+(?:ONLY\s+)?(?:public\.)?(?:"nodes"|nodes\b)`)

// TestOnlyThisPackageWritesNodes enforces the package's rule: no Go file
// outside pkg/nodes but tests writes the nodes table. Move the write here, as
// a function the caller runs in its own transaction.
func TestOnlyThisPackageWritesNodes(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"UPDATE nodes SET x = 1", "update nodes n set", "INSERT INTO nodes (id)", "insert  into\n\t\tnodes(id)",
		"DELETE FROM nodes WHERE", `UPDATE ONLY public."nodes" SET`} {
		if !writesNodes.MatchString(s) {
			t.Fatalf("the pattern misses %q", s)
		}
	}
	for _, s := range []string{"SELECT id FROM nodes", "UPDATE node_inventory SET", "INSERT INTO nodes_archive", "back from nodes.spec"} {
		if writesNodes.MatchString(s) {
			t.Fatalf("the pattern matches %q", s)
		}
	}

	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.work")); err != nil {
		t.Skipf("not in the repository (no go.work at %s)", root)
	}
	own := filepath.Join(root, "pkg", "nodes")
	scanned := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path == own || name == "testdata" || name == "vendor" || name == "node_modules" || (strings.HasPrefix(name, ".") && path != root) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		scanned++
		for _, loc := range writesNodes.FindAllIndex(b, -1) {
			rel, _ := filepath.Rel(root, path)
			line := 1 + strings.Count(string(b[:loc[0]]), "\n")
			t.Errorf("%s:%d: %q writes the nodes table: only pkg/nodes may (add a function there)", rel, line, b[loc[0]:loc[1]])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if scanned < 100 {
		t.Fatalf("scanned only %d Go files under %s", scanned, root)
	}
}
