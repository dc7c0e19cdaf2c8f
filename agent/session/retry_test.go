package session

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// TestRetryDelayHonoursTheGatewaysRetryInfo: a refusal with a RetryInfo
// (a gateway admitting a reconnect storm) gives its delay, capped at
// maxRetryDelay, even wrapped; any other error gives none.
func TestRetryDelayHonoursTheGatewaysRetryInfo(t *testing.T) {
	refusal := func(d time.Duration) error {
		st, err := status.New(codes.ResourceExhausted, "busy").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
		if err != nil {
			t.Fatal(err)
		}
		return st.Err()
	}
	cases := []struct {
		name string
		err  error
		want time.Duration
	}{
		{"retry info", refusal(3 * time.Second), 3 * time.Second},
		{"wrapped", fmt.Errorf("session: recv: %w", refusal(1500*time.Millisecond)), 1500 * time.Millisecond},
		{"capped", refusal(time.Hour), maxRetryDelay},
		{"status without details", status.Error(codes.Unavailable, "gone"), 0},
		{"plain error", errors.New("dial: refused"), 0},
		{"nil", nil, 0},
	}
	for _, tc := range cases {
		if got := retryDelay(tc.err); got != tc.want {
			t.Errorf("%s: retryDelay = %s, want %s", tc.name, got, tc.want)
		}
	}
}

// TestRefusalCode: a refusal with an ErrorInfo (the gateway's skew window)
// gives its reason, even wrapped; any other error gives none.
func TestRefusalCode(t *testing.T) {
	st, err := status.New(codes.FailedPrecondition, "too old").WithDetails(&errdetails.ErrorInfo{Reason: RefusedTooOld, Domain: "api.bettercompute",
		Metadata: map[string]string{"field": "hello.agent_version"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := RefusalCode(st.Err()); got != RefusedTooOld {
		t.Errorf("refusal: %q", got)
	}
	if got := RefusalCode(fmt.Errorf("session: %w", st.Err())); got != RefusedTooOld {
		t.Errorf("wrapped: %q", got)
	}
	for _, e := range []error{nil, errors.New("plain"), status.Error(codes.Unavailable, "down")} {
		if got := RefusalCode(e); got != "" {
			t.Errorf("%v: %q", e, got)
		}
	}
}
