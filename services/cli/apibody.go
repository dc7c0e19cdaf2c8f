package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// buildBody turns the arguments into the JSON request body, httpie style:
//
//	field=value     a JSON string
//	field:=json     raw JSON
//	field=@file     a file's contents as a string (@- reads stdin)
//	field:=@file    a file's contents as JSON
//
// A dotted field (a.b=v) sets a nested object; `\.` is a literal dot. Every
// problem is a usage error naming the argument.
func buildBody(args []string, stdin io.Reader) ([]byte, error) {
	root := map[string]any{}
	stdinUsed := false
	for _, arg := range args {
		i := strings.IndexByte(arg, '=')
		if i < 0 {
			return nil, serve.Usage(fmt.Errorf("argument %q: expected field=string or field:=json", arg))
		}
		key, val, raw := arg[:i], arg[i+1:], false
		if strings.HasSuffix(key, ":") {
			key, raw = key[:len(key)-1], true
		}
		path, err := splitFieldPath(key)
		if err != nil {
			return nil, serve.Usage(fmt.Errorf("argument %q: %w", arg, err))
		}
		if name, ok := strings.CutPrefix(val, "@"); ok {
			var b []byte
			switch {
			case name == "-" && stdinUsed:
				return nil, serve.Usage(fmt.Errorf("argument %q: stdin is already read by an earlier argument", arg))
			case name == "-":
				stdinUsed = true
				b, err = io.ReadAll(stdin)
			case name == "":
				err = errors.New("expected a file name after @")
			default:
				b, err = os.ReadFile(name)
			}
			if err != nil {
				return nil, serve.Usage(fmt.Errorf("argument %q: %w", arg, err))
			}
			val = string(b)
			if !raw && !utf8.ValidString(val) {
				return nil, serve.Usage(fmt.Errorf("argument %q: the file is not UTF-8 text", arg))
			}
		}
		var v any = val
		if raw {
			if err := checkJSON(val); err != nil {
				return nil, serve.Usage(fmt.Errorf("argument %q: invalid JSON after \":=\": %w", arg, err))
			}
			v = json.RawMessage(val)
		}
		if err := setField(root, path, v); err != nil {
			return nil, serve.Usage(fmt.Errorf("argument %q: %w", arg, err))
		}
	}
	return json.Marshal(root)
}

// checkJSON reports whether s is exactly one JSON value.
func checkJSON(s string) error {
	dec := json.NewDecoder(strings.NewReader(s))
	var v json.RawMessage
	if err := dec.Decode(&v); err != nil {
		if errors.Is(err, io.EOF) {
			return errors.New("empty value")
		}
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("more than one JSON value")
	}
	return nil
}

// splitFieldPath splits a.b.c into its parts; `\.` is a literal dot.
func splitFieldPath(key string) ([]string, error) {
	if key == "" {
		return nil, errors.New("empty field name")
	}
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(key); i++ {
		switch {
		case key[i] == '\\' && i+1 < len(key) && key[i+1] == '.':
			cur.WriteByte('.')
			i++
		case key[i] == '.':
			parts = append(parts, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(key[i])
		}
	}
	parts = append(parts, cur.String())
	if slices.Contains(parts, "") {
		return nil, fmt.Errorf("field %q has an empty part", key)
	}
	return parts, nil
}

func setField(root map[string]any, path []string, v any) error {
	m := root
	for i, p := range path[:len(path)-1] {
		switch next := m[p].(type) {
		case nil:
			n := map[string]any{}
			m[p] = n
			m = n
		case map[string]any:
			m = next
		default:
			return fmt.Errorf("%s is already set to a value, not an object", strings.Join(path[:i+1], "."))
		}
	}
	last := path[len(path)-1]
	switch m[last].(type) {
	case nil:
		m[last] = v
		return nil
	case map[string]any:
		return fmt.Errorf("%s is already an object set by a dotted field", strings.Join(path, "."))
	}
	return fmt.Errorf("%s is given twice", strings.Join(path, "."))
}
