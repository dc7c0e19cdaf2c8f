package gateway

import (
	"context"
	"math/rand/v2"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// admission bounds the rate at which sessions open: each costs a
// revocation check and a transaction, and a gateway restarted under
// 10,000 nodes would otherwise have every one of them at the database at
// once. A session waits for its turn (a token bucket of AdmitRate a second,
// AdmitBurst deep) for up to AdmitWait; one that would wait longer is
// refused RESOURCE_EXHAUSTED with a RetryInfo delay — the wait it would
// have had, jittered — which the daemon honours before dialling again, so
// the storm spreads out instead of coming back at once.
type admission struct {
	lim  *rate.Limiter
	wait time.Duration
}

// newAdmission returns nil (no limit) when rate is not positive.
func newAdmission(perSecond float64, burst int, wait time.Duration) *admission {
	if perSecond <= 0 {
		return nil
	}
	return &admission{lim: rate.NewLimiter(rate.Limit(perSecond), max(burst, 1)), wait: wait}
}

// admit waits for the session's turn, or refuses it.
func (a *admission) admit(ctx context.Context, stop <-chan struct{}) error {
	if a == nil {
		return nil
	}
	r := a.lim.Reserve()
	d := r.Delay()
	if d == 0 {
		return nil
	}
	if d > a.wait {
		r.Cancel()
		retry := d/2 + rand.N(d) // [d/2, 3d/2)
		st, err := status.New(codes.ResourceExhausted, "the gateway is admitting sessions at its rate; retry after the delay given").
			WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
		if err != nil {
			return status.Error(codes.ResourceExhausted, "the gateway is admitting sessions at its rate; retry later")
		}
		return st.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		r.Cancel()
		return status.FromContextError(ctx.Err()).Err()
	case <-stop:
		r.Cancel()
		return status.Error(codes.Unavailable, "gateway stopping")
	}
}
