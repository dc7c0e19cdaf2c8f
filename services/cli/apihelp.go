package cli

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"unicode/utf8"
)

const apiHelpIntro = `Call one API method over REST: POST <url>/api/compute/<group>/<method> with a
JSON body built from the arguments, and print the JSON answer on stdout.

Arguments (httpie style):
  field=value      a JSON string               name=gpu-a
  field:=json      raw JSON                    count:=2 labels:='{"zone":"a"}'
  field=@file      a file's contents, string   text=@policy.cedar (@- reads stdin)
  field:=@file     a file's contents, JSON     spec:=@spec.json
  a.b=value        a nested object             spec.gpus:=2 (\. is a literal dot)

The URL is --url, else $BETTER_COMPUTE_URL, else client.url in the client config
file, else ` + DefaultURL + `. The API key is --token, else $BETTER_COMPUTE_TOKEN,
else client.token. The client config file is --client-config, else
$BETTER_COMPUTE_CONFIG, else ~/.config/better-compute/client.yaml:

  client:
    url: https://compute.example.com
    token: bck_<id>.<secret>

A refused call prints the error envelope {"code","message","field"} on stderr
and exits 1; a bad argument, an unknown method or a bad client config exits 2.
`

// apiHelp is the api command's long help: the method list, or one method's
// fields when args name one.
func apiHelp(args []string) string {
	cat, err := loadCatalog()
	if err != nil {
		return apiHelpIntro + "\n" + err.Error() + "\n"
	}
	if len(args) > 0 {
		m, err := cat.lookup(args[0])
		if err == nil {
			return cat.methodHelp(m)
		}
		return err.Error() + "\n\n" + apiHelpIntro + cat.methodList()
	}
	return apiHelpIntro + cat.methodList()
}

func (c *apiCatalog) methodList() string {
	var b strings.Builder
	b.WriteString("\nMethods:\n")
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	for _, m := range c.methods {
		fmt.Fprintf(tw, "  %s\t%s\n", m.name, oneLine(firstNonEmpty(m.summary, m.description)))
	}
	_ = tw.Flush()
	b.WriteString("\n`better-compute api <group>.<method> --help` shows a method's fields.")
	return b.String()
}

func (c *apiCatalog) methodHelp(m *apiMethod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: POST %s%s/%s\n\n", m.name, apiPrefix, m.group, m.method)
	if text := strings.TrimSpace(strings.Join([]string{m.summary, m.description}, "\n\n")); text != "" {
		b.WriteString(text + "\n\n")
	}
	req := c.resolve(m.request)
	name := ""
	if m.request != nil {
		name = strings.TrimPrefix(m.request.Ref, "#/definitions/")
	}
	if req == nil || len(req.Properties) == 0 {
		fmt.Fprintf(&b, "The request (%s) has no fields: the body is {}.", name)
		return b.String()
	}
	note := ""
	if len(req.Required) > 0 {
		note = "; * required"
	}
	fmt.Fprintf(&b, "Request fields (%s%s):\n", name, note)
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	for _, p := range req.Properties {
		mark := " "
		if slices.Contains(req.Required, p.name) {
			mark = "*"
		}
		fmt.Fprintf(tw, " %s%s\t%s\t%s\n", mark, p.name, c.typeName(p.s), oneLine(firstNonEmpty(p.s.Description, p.s.Title, c.resolve(p.s).Description)))
	}
	_ = tw.Flush()
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, " ")
	}
	return strings.Join(lines, "\n")
}

// typeName describes a field's JSON type in a few words.
func (c *apiCatalog) typeName(s *schema) string {
	r := c.resolve(s)
	if r == nil {
		return "any"
	}
	switch {
	case len(r.Enum) > 0:
		vals := slices.DeleteFunc(slices.Clone(r.Enum), func(v string) bool { return strings.HasSuffix(v, "_UNSPECIFIED") })
		return "enum " + strings.Join(vals, "|")
	case r.Type == "array":
		return "array of " + c.typeName(r.Items)
	case r.Type == "object" && len(r.AdditionalProperties) > 0 && r.AdditionalProperties[0] == '{':
		var v schema
		if json.Unmarshal(r.AdditionalProperties, &v) == nil {
			return "map of " + c.typeName(&v)
		}
	case s.Ref != "":
		return "object " + strings.TrimPrefix(s.Ref, "#/definitions/")
	case r.Format != "":
		return r.Format
	case r.Type != "":
		return r.Type
	}
	return "object"
}

func firstNonEmpty(ss ...string) string {
	for _, s := range ss {
		if strings.TrimSpace(s) != "" {
			return s
		}
	}
	return ""
}

// oneLine is the first sentence of a comment, on one line and at most 120
// characters.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if i := strings.Index(s, ". "); i >= 0 {
		s = s[:i+1]
	}
	if utf8.RuneCountInString(s) > 120 {
		r := []rune(s)[:119]
		if i := strings.LastIndexByte(string(r), ' '); i > 60 {
			return string(r)[:i] + "…"
		}
		return string(r) + "…"
	}
	return s
}
