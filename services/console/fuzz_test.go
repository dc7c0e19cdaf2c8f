package console

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// FuzzConsoleForms feeds the console's parsers what a browser (or anyone)
// can send: a form body, a query string and a cookie. Every form field and
// query parameter read is trimmed and bounded or refused INVALID_INPUT
// naming it; a label filter is key=value pairs with non-empty trimmed keys,
// at most maxLabelFilters; an events type filter becomes a pattern the
// event catalog accepts; a session cookie is taken only when shaped like a
// session id; clip never splits a rune. Nothing panics.
func FuzzConsoleForms(f *testing.F) {
	f.Add("kind=diag.nvml&idem=a-1&csrf=x", "pool=sim&label=gpu%3Dh100&type=node", "bc_console=abc")
	f.Add("reason=%00%1b[2J&deadlineSeconds=-1", "label=%3D,%2C,k%3D&type=*", "")
	f.Add("gpus=99999999999999999999&name="+strings.Repeat("x", 300), "type=node.*.*&subject=%ff", "bc_console="+strings.Repeat("A", sessionIDLen))
	f.Add("%zz=1&&=&a", "label=a%3Db,c%3Dd,a%3De&type=.", "bc_console=\x00")
	f.Fuzz(func(t *testing.T, body, rawQuery, cookie string) {
		r := httptest.NewRequest(http.MethodPost, "/console/x", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		r.URL.RawQuery = rawQuery
		if cookie != "" {
			r.Header.Set("Cookie", cookie)
		}
		limits := map[string]int{"kind": maxField, "idem": maxField, "reason": maxReason, "deadlineSeconds": 16,
			"pool": maxField, "gpus": 8, "name": 64, "model": maxField, "migProfile": maxProfile}
		for name, limit := range limits {
			v, err := field(r, name, limit)
			checkBounded(t, "field", name, limit, v, err)
		}
		qlimits := map[string]int{"pool": maxField, "label": 4 * maxField, "condition": maxField, "type": 128,
			"subject": maxField, "node": maxField, "action": maxField}
		for name, limit := range qlimits {
			v, err := query(r, name, limit)
			checkBounded(t, "query", name, limit, v, err)
		}
		if label, err := query(r, "label", 4*maxField); err == nil {
			labels, err := parseLabels(label)
			if err != nil {
				checkFault(t, "label", err)
			} else {
				if len(labels) > maxLabelFilters {
					t.Fatalf("parseLabels(%q): %d labels, at most %d", label, len(labels), maxLabelFilters)
				}
				for k, v := range labels {
					if k == "" || strings.TrimSpace(k) != k || strings.TrimSpace(v) != v {
						t.Fatalf("parseLabels(%q): label %q=%q not trimmed or empty", label, k, v)
					}
				}
			}
		}
		if typ, err := query(r, "type", 128); err == nil {
			p, err := eventPattern(typ)
			if err == nil && p != "" {
				if _, exact := events.Lookup(p); !exact && events.CheckPattern(p) != nil {
					t.Fatalf("eventPattern(%q) = %q, which the catalog refuses", typ, p)
				}
			}
		}
		if id, ok := sessionID(r); ok && len(id) != sessionIDLen {
			t.Fatalf("sessionID took %q", id)
		}
		for n := range 8 {
			if c := clip(body, n); utf8.ValidString(body) && !utf8.ValidString(c) {
				t.Fatalf("clip(%q, %d) = %q splits a rune", body, n, c)
			}
		}
	})
}

func checkBounded(t *testing.T, what, name string, limit int, v string, err error) {
	t.Helper()
	if err != nil {
		checkFault(t, name, err)
		return
	}
	if len(v) > limit || strings.TrimSpace(v) != v {
		t.Fatalf("%s %q: %q is over %d bytes or not trimmed", what, name, v, limit)
	}
}

func checkFault(t *testing.T, name string, err error) {
	t.Helper()
	if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != name {
		t.Fatalf("%s: %v, want INVALID_INPUT naming %q", name, err, name)
	}
}
