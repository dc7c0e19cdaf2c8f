package fault_test

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

func TestStatus(t *testing.T) {
	t.Parallel()
	st := fault.New(fault.NotFound, "node_id", "no node %q", "n1").Status()
	if st.Code() != codes.NotFound || st.Message() != `no node "n1"` {
		t.Fatalf("status = %v %q", st.Code(), st.Message())
	}
	var info *errdetails.ErrorInfo
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			info = ei
		}
	}
	if info == nil || info.GetDomain() != fault.ErrorDomain || info.GetReason() != string(fault.NotFound) || info.GetMetadata()["field"] != "node_id" {
		t.Fatalf("ErrorInfo = %v", info)
	}
}

func TestToStatus(t *testing.T) {
	t.Parallel()
	wrapped := fmt.Errorf("drain: %w", fault.New(fault.Conflict, "", "busy"))
	if st := fault.ToStatus(wrapped); st.Code() != codes.Aborted || st.Message() != "busy" {
		t.Errorf("wrapped fault: %v %q", st.Code(), st.Message())
	}
	plain := status.Error(codes.Unavailable, "down")
	if st := fault.ToStatus(plain); st.Code() != codes.Unavailable || st.Message() != "down" || len(st.Details()) != 0 {
		t.Errorf("status error did not pass through: %v", st)
	}
	if st := fault.ToStatus(errors.New("pq: secret detail")); st.Code() != codes.Internal || st.Message() != "internal error" {
		t.Errorf("plain error: %v %q", st.Code(), st.Message())
	}
}
