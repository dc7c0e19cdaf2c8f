package mcpserver

import (
	"fmt"

	"github.com/google/jsonschema-go/jsonschema"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Default maximums of an input field the tool's bounds do not name: every
// string, list and map an MCP client sends has one, in the input schema the
// client sees and checked by the server before the tool runs.
const (
	defaultMaxString = 256
	defaultMaxItems  = 32
	defaultMaxMap    = 64
)

// bound is one input field's maximum (and minimum, for numbers).
type bound struct {
	maxLen   int      // strings; 0: defaultMaxString
	maxItems int      // lists and maps; 0: the default
	min, max *float64 // numbers: required for every integer field
	enum     []string // strings: the allowed values
}

func num(lo, hi float64) bound { return bound{min: &lo, max: &hi} }

// inputSchema is T's schema with a maximum on every field: bounds by JSON
// name, the defaults for the rest. An integer field without a bound is a
// programming error (every number from the network has a range).
func inputSchema[T any](bounds map[string]bound) *jsonschema.Schema {
	s, err := jsonschema.For[T](nil)
	if err != nil {
		panic(err)
	}
	for name, p := range s.Properties {
		b := bounds[name]
		applyBound(name, p, b)
	}
	for name := range bounds {
		if _, ok := s.Properties[name]; !ok {
			panic(fmt.Sprintf("mcpserver: bound for unknown field %q", name))
		}
	}
	return s
}

func applyBound(name string, p *jsonschema.Schema, b bound) {
	typ := p.Type
	for _, t := range p.Types {
		if t != "null" {
			typ = t
		}
	}
	switch typ {
	case "string":
		p.MaxLength = ptr(or(b.maxLen, defaultMaxString))
		for _, v := range b.enum {
			p.Enum = append(p.Enum, v)
		}
	case "integer", "number":
		if b.min == nil || b.max == nil {
			panic(fmt.Sprintf("mcpserver: integer field %q has no range", name))
		}
		p.Minimum, p.Maximum = b.min, b.max
	case "array":
		p.MaxItems = ptr(or(b.maxItems, defaultMaxItems))
		if p.Items != nil {
			applyBound(name+"[]", p.Items, bound{maxLen: b.maxLen, enum: b.enum})
		}
	case "object":
		p.MaxProperties = ptr(or(b.maxItems, defaultMaxMap))
		p.PropertyNames = &jsonschema.Schema{Type: "string", MaxLength: ptr(or(b.maxLen, defaultMaxString))}
		if p.AdditionalProperties != nil {
			applyBound(name+"{}", p.AdditionalProperties, bound{maxLen: b.maxLen})
		}
	case "boolean":
	default:
		panic(fmt.Sprintf("mcpserver: field %q of type %q has no maximum", name, typ))
	}
}

func ptr[T any](v T) *T { return &v }

func or(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// required is a check the tools make beyond the schema's (which the SDK
// applies first): INVALID_INPUT naming the field.

func required(field, v string) error {
	if v == "" {
		return fault.New(fault.InvalidInput, field, "required")
	}
	return nil
}
