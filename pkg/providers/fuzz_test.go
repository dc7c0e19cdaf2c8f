package providers

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/bettercompute/bettercompute/pkg/outbound"
)

// FuzzProviderResponse feeds the client's response parsing what a hostile
// or broken provider may answer — any status, Retry-After and body — as
// once and machine read them: no panic; a 2xx body is either a machine with
// a valid id and a short printable state or an "invalid response"; any
// other status is an *Error of the kind its status says, whose tenant
// reason is "HTTP status NNN" (never the provider's text), whose message is
// bounded valid UTF-8, and whose Retry-After is within an hour.
func FuzzProviderResponse(f *testing.F) {
	for _, s := range []struct {
		status int
		ra     string
		body   string
	}{
		{200, "", `{"id":"m-1","state":"running"}`},
		{201, "", `{"id":"m-1","state":"pending","extra":[1,2]}`},
		{200, "", `{"id":"../../x","state":"running"}`},
		{200, "", `{"id":"m-1","state":"run\nning"}`},
		{200, "", `{"id":"m-1"}`},
		{200, "", `not json`},
		{200, "", `{"id":1}`},
		{404, "", `{"message":"no such machine"}`},
		{409, "", `{"message":"` + strings.Repeat("é", 300) + `"}`},
		{429, "7", `{"message":"slow down"}`},
		{429, "Wed, 21 Oct 2015 07:28:00 GMT", ``},
		{503, "99999999999999999999", `{"message":"internal: 10.0.0.7:5432 refused"}`},
		{302, "", ``},
		{400, "-1", `{"message":null}`},
	} {
		f.Add(s.status, s.ra, []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, status int, ra string, body []byte) {
		if status < 100 || status > 999 {
			return // net/http answers no such status
		}
		raw, err := answer("get machine m-1", status, ra, body)
		if status >= 200 && status < 300 && len(body) <= MaxResponseBytes {
			if err != nil {
				t.Fatalf("%d: %v", status, err)
			}
			m, perr := parseMachine(raw)
			if perr != nil {
				return
			}
			if !ValidID(m.ID) || m.State == "" || len(m.State) > 32 || !utf8.ValidString(m.State) || strings.ContainsAny(m.State, " \t\r\n") {
				t.Fatalf("%q: accepted machine %+v", body, m)
			}
			return
		}
		var pe *Error
		if !errors.As(err, &pe) {
			t.Fatalf("%d: %v, want *Error", status, err)
		}
		if pe.Reason() != outbound.StatusReason(status) && pe.Reason() != outbound.ReasonInvalidResponse {
			t.Fatalf("%d %q: tenant reason %q", status, body, pe.Reason())
		}
		if len(pe.Message) > 256+len("…") || !utf8.ValidString(pe.Message) {
			t.Fatalf("%d: message %q not bounded valid UTF-8", status, pe.Message)
		}
		if pe.RetryAfter < 0 || pe.RetryAfter > time.Hour {
			t.Fatalf("Retry-After %q: %s", ra, pe.RetryAfter)
		}
		want := ErrRejected
		switch {
		case status == http.StatusNotFound:
			want = ErrNotFound
		case status == http.StatusConflict:
			want = ErrConflict
		case status == http.StatusTooManyRequests:
			want = ErrRateLimited
		case status >= 500 || (status >= 200 && status < 300):
			want = ErrTransient
		}
		if !errors.Is(err, want) {
			t.Fatalf("%d: %v, want %v", status, err, want)
		}
	})
}
