package fault_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

func TestCodesTable(t *testing.T) {
	t.Parallel()
	seen := map[fault.Code]bool{}
	for _, i := range append(append([]fault.Info{}, fault.Codes...), fault.SessionCodes...) {
		if seen[i.Code] {
			t.Errorf("%s listed twice", i.Code)
		}
		seen[i.Code] = true
		if i.Meaning == "" || i.HTTP < 400 || i.GRPC == 0 {
			t.Errorf("%s is missing its meaning or statuses: %+v", i.Code, i)
		}
		if got, ok := fault.Lookup(i.Code); !ok || got.Code != i.Code {
			t.Errorf("Lookup(%s) = %+v, %v", i.Code, got, ok)
		}
	}
	if len(fault.Codes) != 12 || len(seen) != 14 {
		t.Errorf("want the 12 codes of DESIGN §8 and the gateway's 2 session codes, have %d and %d", len(fault.Codes), len(seen))
	}
	if _, ok := fault.Lookup("NOPE"); ok {
		t.Error("Lookup of an unknown code succeeded")
	}
}

func TestErrorChain(t *testing.T) {
	t.Parallel()
	cause := errors.New("dial tcp: refused")
	a := fault.Wrap(cause, fault.Unavailable, "", "database unreachable")
	b := fault.New(fault.InvalidConfig, "server.port", "expected a port, got %d", -1)
	joined := fmt.Errorf("start: %w", errors.Join(a, b))

	if got := fault.CodeOf(joined); got != fault.Unavailable {
		t.Errorf("CodeOf = %s, want the first fault's code", got)
	}
	if !errors.Is(joined, cause) {
		t.Error("the cause is lost")
	}
	all := fault.All(joined)
	if len(all) != 2 || all[0] != a || all[1] != b {
		t.Fatalf("All = %v", all)
	}
	if b.Error() != "INVALID_CONFIG server.port: expected a port, got -1" {
		t.Errorf("Error() = %q", b.Error())
	}
	if fault.CodeOf(errors.New("plain")) != fault.Internal || fault.CodeOf(nil) != "" {
		t.Error("CodeOf of a plain error must be INTERNAL and of nil empty")
	}
}
