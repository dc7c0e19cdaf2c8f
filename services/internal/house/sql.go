package house

import (
	"go/ast"
	"go/parser"
	"go/token"
	"regexp"
	"strconv"
)

// sqlStatement matches the text of a string literal that is an SQL
// statement: it starts with a statement's keyword and goes on with what
// such a statement needs next (SELECT a list ... FROM, INSERT INTO, UPDATE
// t SET, DELETE FROM, WITH x AS, …), so prose that merely starts with
// "Update" or "select" is not one.
var sqlStatement = regexp.MustCompile(`(?is)^\s*(` +
	`select\s.+\sfrom\s|select\s+(count|exists|1\b|now\(|pg_|coalesce|\$\d)|` +
	`insert\s+into\s|` +
	`update\s+[a-z_][a-z0-9_.]*(\s+[a-z_]+)?\s+set\s|` +
	`delete\s+from\s|` +
	`with\s+(recursive\s+)?[a-z_][a-z0-9_]*(\s*\([^)]*\))?\s+as\s*(not\s+)?(materialized\s*)?\(|` +
	`lock\s+table\s|truncate\s+[a-z_]|create\s+(table|index|unique|temp|database)|alter\s+table\s|drop\s+table\s)`)

// IsSQL reports whether s reads as an SQL statement.
func IsSQL(s string) bool { return sqlStatement.MatchString(s) }

// Literal is an SQL statement found in a Go file.
type Literal struct {
	Pos  token.Position
	Text string
}

// SQLLiterals returns the string literals of the Go file at path (src, if
// not nil, is its content) that are SQL statements.
func SQLLiterals(path string, src any) ([]Literal, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, src, parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	var out []Literal
	ast.Inspect(f, func(n ast.Node) bool {
		text, ok := stringValue(n)
		if !ok {
			return true
		}
		if IsSQL(text) {
			out = append(out, Literal{Pos: fset.Position(n.Pos()), Text: text})
		}
		return false
	})
	return out, nil
}

// stringValue returns the text of a string literal, or of a concatenation
// of them (other operands read as a placeholder), and whether n is one.
func stringValue(n ast.Node) (string, bool) {
	switch n := n.(type) {
	case *ast.BasicLit:
		if n.Kind != token.STRING {
			return "", false
		}
		s, err := strconv.Unquote(n.Value)
		return s, err == nil
	case *ast.BinaryExpr:
		if n.Op != token.ADD {
			return "", false
		}
		x, xok := stringValue(n.X)
		y, yok := stringValue(n.Y)
		if !xok && !yok {
			return "", false
		}
		if !xok {
			x = "x"
		}
		if !yok {
			y = "x"
		}
		return x + y, true
	}
	return "", false
}
