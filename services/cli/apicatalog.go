package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/bettercompute/bettercompute/proto/openapi"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

type apiMethod struct {
	name          string // group.method
	group, method string
	summary       string
	description   string
	request       *schema
}

type apiCatalog struct {
	methods []apiMethod // sorted by name
	defs    map[string]*schema
}

// schema is the part of an OpenAPI v2 schema the help reads.
type schema struct {
	Ref                  string          `json:"$ref"`
	Type                 string          `json:"type"`
	Format               string          `json:"format"`
	Title                string          `json:"title"`
	Description          string          `json:"description"`
	Properties           orderedSchemas  `json:"properties"`
	Items                *schema         `json:"items"`
	Enum                 []string        `json:"enum"`
	Required             []string        `json:"required"`
	AdditionalProperties json.RawMessage `json:"additionalProperties"`
}

// orderedSchemas keeps properties in the document's order (the .proto's).
type orderedSchemas []namedSchema

type namedSchema struct {
	name string
	s    *schema
}

func (o *orderedSchemas) UnmarshalJSON(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	if _, err := dec.Token(); err != nil {
		return err
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		name, _ := tok.(string)
		var s schema
		if err := dec.Decode(&s); err != nil {
			return err
		}
		*o = append(*o, namedSchema{name, &s})
	}
	return nil
}

// loadCatalog reads every POST /api/compute/{group}/{method} of the embedded
// OpenAPI document, so new groups need no change here.
func loadCatalog() (*apiCatalog, error) { return parseCatalog(openapi.Document()) }

func parseCatalog(document []byte) (*apiCatalog, error) {
	var doc struct {
		Paths map[string]map[string]struct {
			Summary     string `json:"summary"`
			Description string `json:"description"`
			Parameters  []struct {
				In     string  `json:"in"`
				Schema *schema `json:"schema"`
			} `json:"parameters"`
		} `json:"paths"`
		Definitions map[string]*schema `json:"definitions"`
	}
	if err := json.Unmarshal(document, &doc); err != nil {
		return nil, fmt.Errorf("the embedded OpenAPI document: %w", err)
	}
	cat := &apiCatalog{defs: doc.Definitions}
	for path, ops := range doc.Paths {
		rest, ok := strings.CutPrefix(path, apiPrefix)
		group, method, ok2 := strings.Cut(rest, "/")
		op, ok3 := ops["post"]
		if !ok || !ok2 || !ok3 || group == "" || method == "" || strings.ContainsAny(method, "/{") {
			continue
		}
		m := apiMethod{name: group + "." + method, group: group, method: method, summary: op.Summary, description: op.Description}
		for _, p := range op.Parameters {
			if p.In == "body" {
				m.request = p.Schema
			}
		}
		cat.methods = append(cat.methods, m)
	}
	sort.Slice(cat.methods, func(i, j int) bool { return cat.methods[i].name < cat.methods[j].name })
	return cat, nil
}

// lookup finds a method by group.method; an unknown one is a usage error
// that suggests close names.
func (c *apiCatalog) lookup(name string) (*apiMethod, error) {
	for i := range c.methods {
		if c.methods[i].name == name {
			return &c.methods[i], nil
		}
	}
	msg := fmt.Sprintf("unknown API method %q", name)
	if s := c.suggest(name); len(s) > 0 {
		msg += "; did you mean " + strings.Join(s, ", ") + "?"
	}
	return nil, serve.Usage(errors.New(msg + " (`better-compute api --help` lists them)"))
}

// suggest returns up to five methods close to name: the same name in another
// case, the methods of a group named alone, then the nearest by edit
// distance.
func (c *apiCatalog) suggest(name string) []string {
	lower := strings.ToLower(name)
	var out []string
	for _, m := range c.methods {
		if strings.ToLower(m.name) == lower {
			return []string{m.name}
		}
	}
	group := strings.ToLower(strings.TrimSuffix(name, "."))
	for _, m := range c.methods {
		if strings.ToLower(m.group) == group {
			out = append(out, m.name)
		}
	}
	if len(out) > 0 {
		return out[:min(len(out), 5)]
	}
	type cand struct {
		name string
		d    int
	}
	var cands []cand
	limit := max(2, utf8.RuneCountInString(name)/3)
	for _, m := range c.methods {
		d := editDistance(lower, strings.ToLower(m.name))
		if _, meth, _ := strings.Cut(lower, "."); meth != "" && strings.EqualFold(meth, m.method) {
			d = min(d, limit) // the right method in a mistyped group
		}
		if d <= limit {
			cands = append(cands, cand{m.name, d})
		}
	}
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].d < cands[j].d })
	for _, cd := range cands[:min(len(cands), 5)] {
		out = append(out, cd.name)
	}
	return out
}

// editDistance is the Levenshtein distance between a and b, in runes.
func editDistance(a, b string) int {
	ra, rb := []rune(a), []rune(b)
	prev := make([]int, len(rb)+1)
	cur := make([]int, len(rb)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(ra); i++ {
		cur[0] = i
		for j := 1; j <= len(rb); j++ {
			cost := 1
			if ra[i-1] == rb[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(rb)]
}

// resolve follows a $ref into the definitions.
func (c *apiCatalog) resolve(s *schema) *schema {
	for i := 0; s != nil && s.Ref != "" && i < 8; i++ {
		s = c.defs[strings.TrimPrefix(s.Ref, "#/definitions/")]
	}
	return s
}
