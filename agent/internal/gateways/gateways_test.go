package gateways_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/agent/internal/gateways"
)

func TestParse(t *testing.T) {
	t.Parallel()
	l, err := gateways.Parse(" gw-a.example:443, 10.0.0.2:8443,,gw-a.example:443 ", "")
	if err != nil {
		t.Fatal(err)
	}
	if got := l.String(); got != "gw-a.example:443,10.0.0.2:8443" {
		t.Errorf("entries %q", got)
	}
	for _, bad := range []string{"", " , ", "gw-a.example", ":443", "gw:443,nohost"} {
		if _, err := gateways.Parse(bad, ""); err == nil {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
}

// TestNextRotatesFromARandomStart: every entry is handed out in turn, and
// nodes configured alike do not all start on the same one.
func TestNextRotatesFromARandomStart(t *testing.T) {
	t.Parallel()
	const list = "gw-a:1,gw-b:2,gw-c:3"
	starts := map[string]int{}
	for range 300 {
		l, err := gateways.Parse(list, "")
		if err != nil {
			t.Fatal(err)
		}
		first := l.Next()
		starts[first.Addr]++
		seen := map[string]bool{first.Addr: true}
		for range 2 {
			seen[l.Next().Addr] = true
		}
		if len(seen) != 3 {
			t.Fatalf("three calls gave %v", seen)
		}
		if again := l.Next(); again != first {
			t.Fatalf("the fourth call gave %v, want the first %v again", again, first)
		}
	}
	for _, e := range []string{"gw-a:1", "gw-b:2", "gw-c:3"} {
		if starts[e] < 50 {
			t.Errorf("%s was the first entry %d times of 300: %v", e, starts[e], starts)
		}
	}
	l, _ := gateways.Parse("gw-a:1", "gw.example")
	if tg := l.Next(); tg.ServerName != "gw.example" || tg.Addr != "gw-a:1" {
		t.Errorf("server name: %+v", tg)
	}
	l, _ = gateways.Parse("gw-a:1", "")
	if tg := l.Next(); tg.ServerName != "gw-a" {
		t.Errorf("default server name: %+v", tg)
	}
}
