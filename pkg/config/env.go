package config

import (
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"
	"unicode"

	"gopkg.in/yaml.v3"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// EnvPrefix starts every environment override.
const EnvPrefix = "BC_"

// EnvName returns the BC_ variable for a YAML path such as
// "server.shutdownTimeout" (BC_SERVER_SHUTDOWN_TIMEOUT).
func EnvName(path string) string {
	var b strings.Builder
	b.WriteString(EnvPrefix)
	for i, part := range strings.Split(path, ".") {
		if i > 0 {
			b.WriteByte('_')
		}
		rs := []rune(part)
		for j, r := range rs {
			// A word starts at an upper-case letter after a lower-case one
			// (shutdownTimeout) or at the last capital of an acronym that a
			// lower-case letter follows (TTLSeconds); leaseTTL → LEASE_TTL.
			if j > 0 && unicode.IsUpper(r) && (unicode.IsLower(rs[j-1]) || (j+1 < len(rs) && unicode.IsLower(rs[j+1]) && unicode.IsUpper(rs[j-1]))) {
				b.WriteByte('_')
			}
			b.WriteRune(unicode.ToUpper(r))
		}
	}
	return b.String()
}

// EnvVars lists every field's YAML path with its environment variables (the
// BC_ name first, then any conventional alias), for documentation and help.
func EnvVars() [][2]string {
	var out [][2]string
	walkFields(reflect.ValueOf(&Config{}).Elem(), "", func(path string, f reflect.StructField, _ reflect.Value) {
		names := EnvName(path)
		if alias := f.Tag.Get("env"); alias != "" {
			names += ", " + alias
		}
		out = append(out, [2]string{path, names})
	})
	return out
}

func walkFields(v reflect.Value, prefix string, fn func(path string, f reflect.StructField, fv reflect.Value)) {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "" || name == "-" {
			continue
		}
		path := name
		if prefix != "" {
			path = prefix + "." + name
		}
		fv := v.Field(i)
		if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeFor[Duration]() {
			walkFields(fv, path, fn)
			continue
		}
		fn(path, f, fv)
	}
}

func applyEnv(c *Config, lookup func(string) (string, bool)) error {
	var errs []error
	walkFields(reflect.ValueOf(c).Elem(), "", func(path string, f reflect.StructField, fv reflect.Value) {
		name := EnvName(path)
		val, ok := lookup(name)
		if !ok {
			if alias := f.Tag.Get("env"); alias != "" {
				name = alias
				val, ok = lookup(alias)
			}
		}
		if !ok {
			return
		}
		if err := setFromString(fv, val); err != nil {
			errs = append(errs, fault.New(fault.InvalidConfig, path, "%v (from %s)", err, name))
		}
	})
	return errors.Join(errs...)
}

func setFromString(fv reflect.Value, s string) error {
	switch fv.Interface().(type) {
	case Duration:
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("expected a duration such as 15s, got %q", s)
		}
		fv.Set(reflect.ValueOf(Duration(d)))
		return nil
	case *int:
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("expected an integer, got %q", s)
		}
		fv.Set(reflect.ValueOf(&n))
		return nil
	case []Duration:
		var ds []Duration
		for p := range strings.SplitSeq(s, ",") {
			if p = strings.TrimSpace(p); p == "" {
				continue
			}
			d, err := time.ParseDuration(p)
			if err != nil {
				return fmt.Errorf("expected comma-separated durations such as 5s,5m, got %q", s)
			}
			ds = append(ds, Duration(d))
		}
		fv.Set(reflect.ValueOf(ds))
		return nil
	case []string:
		var parts []string
		for p := range strings.SplitSeq(s, ",") {
			if p = strings.TrimSpace(p); p != "" {
				parts = append(parts, p)
			}
		}
		fv.Set(reflect.ValueOf(parts))
		return nil
	}
	switch fv.Kind() {
	case reflect.String:
		fv.SetString(s)
	case reflect.Int, reflect.Int32, reflect.Int64:
		n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil {
			return fmt.Errorf("expected an integer, got %q", s)
		}
		fv.SetInt(n)
	case reflect.Float64:
		f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil {
			return fmt.Errorf("expected a number, got %q", s)
		}
		fv.SetFloat(f)
	case reflect.Bool:
		b, err := strconv.ParseBool(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("expected true or false, got %q", s)
		}
		fv.SetBool(b)
	default:
		return fmt.Errorf("cannot be set from the environment")
	}
	return nil
}

// decodeYAML decodes the file field by field, so that every problem names
// its field by YAML path: unknown fields, wrong types and bad values alike.
func decodeYAML(b []byte, c *Config) error {
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return fault.Wrap(err, fault.InvalidConfig, "config", "the configuration file is not valid YAML: %v", err)
	}
	if len(doc.Content) == 0 {
		return nil // an empty file
	}
	var errs []error
	decodeNode(doc.Content[0], reflect.ValueOf(c).Elem(), "", &errs)
	return errors.Join(errs...)
}

func decodeNode(n *yaml.Node, v reflect.Value, path string, errs *[]error) {
	where := path
	if where == "" {
		where = "config"
	}
	if n.Kind != yaml.MappingNode {
		*errs = append(*errs, fault.New(fault.InvalidConfig, where, "expected a mapping of fields (line %d)", n.Line))
		return
	}
	fields := map[string]int{}
	t := v.Type()
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ",")
		if name != "" && name != "-" {
			fields[name] = i
		}
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		key, val := n.Content[i], n.Content[i+1]
		field := key.Value
		if path != "" {
			field = path + "." + key.Value
		}
		idx, ok := fields[key.Value]
		if !ok {
			*errs = append(*errs, fault.New(fault.InvalidConfig, field, "unknown field (line %d of the configuration file)", key.Line))
			continue
		}
		fv := v.Field(idx)
		if fv.Kind() == reflect.Struct && fv.Type() != reflect.TypeFor[Duration]() {
			decodeNode(val, fv, field, errs)
			continue
		}
		if err := val.Decode(fv.Addr().Interface()); err != nil {
			*errs = append(*errs, fault.New(fault.InvalidConfig, field, "expected %s, got %q (line %d)", typeWord(fv.Type()), val.Value, val.Line))
		}
	}
}

func typeWord(t reflect.Type) string {
	switch {
	case t == reflect.TypeFor[Duration]():
		return "a duration such as 15s"
	case t.Kind() == reflect.Pointer:
		return typeWord(t.Elem())
	case t.Kind() == reflect.Int, t.Kind() == reflect.Int32, t.Kind() == reflect.Int64:
		return "an integer"
	case t.Kind() == reflect.Float64:
		return "a number"
	case t.Kind() == reflect.Bool:
		return "true or false"
	case t.Kind() == reflect.Slice:
		return "a list"
	}
	return "a string"
}
