package house_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/services/internal/house"
)

func TestSQLLiteralsCatchesPlantedStatements(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("testdata/planted.go.txt")
	if err != nil {
		t.Fatal(err)
	}
	got, err := house.SQLLiterals("planted.go", src)
	if err != nil {
		t.Fatal(err)
	}
	var lines []int
	for _, l := range got {
		lines = append(lines, l.Pos.Line)
	}
	// The four statements, not the prose in the comment, the constant or
	// the two short strings.
	if want := []int{8, 9, 10, 12}; !slices.Equal(lines, want) {
		t.Fatalf("SQL found on lines %v, want %v: %+v", lines, want, got)
	}
}

func TestIsSQL(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"SELECT count(*) FROM nodes":                         true,
		"select 1":                                           true,
		"  INSERT INTO devices (id) VALUES ($1)":             true,
		"UPDATE nodes n SET x = 1":                           true,
		"DELETE FROM commands WHERE id = $1":                 true,
		"WITH u AS (UPDATE nodes SET x = 1) SELECT * FROM u": true,
		"Update the spec when the pool changes":              false,
		"selected nodes are drained":                         false,
		"delete the node from the pool":                      false,
		"with a deadline as late as possible":                false,
		"node %s: update failed":                             false,
	} {
		if got := house.IsSQL(s); got != want {
			t.Errorf("IsSQL(%q) = %v, want %v", s, got, want)
		}
	}
}

// TestSQLOnlyInStores fails on an SQL statement in a non-test Go file of the
// services module: statements belong to the store package under pkg/ named
// for their table.
func TestSQLOnlyInStores(t *testing.T) {
	t.Parallel()
	root := filepath.Join("..", "..")
	n := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && path != root {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		n++
		lits, err := house.SQLLiterals(path, nil)
		if err != nil {
			return err
		}
		for _, l := range lits {
			t.Errorf("%s: SQL outside a store (move it to the pkg/ store named for its table): %.60q", l.Pos, l.Text)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 100 {
		t.Fatalf("walked %d Go files under %s; expected the services module", n, root)
	}
}
