package fault

import (
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the ErrorInfo domain of every Better Compute API error.
const ErrorDomain = "api.bettercompute"

// Status returns the gRPC status the API answers with for e: its code's
// status and message, with the code and field as an ErrorInfo detail.
func (e *Error) Status() *status.Status {
	info, _ := Lookup(e.Code)
	st := status.New(info.GRPC, e.Message)
	md := map[string]string{}
	if e.Field != "" {
		md["field"] = e.Field
	}
	if withInfo, err := st.WithDetails(&errdetails.ErrorInfo{Reason: string(e.Code), Domain: ErrorDomain, Metadata: md}); err == nil {
		return withInfo
	}
	return st
}

// ToStatus turns an error returned by a handler into the gRPC status the API
// answers with. An *Error in err's chain gives [Error.Status]; a status error
// passes through; anything else is INTERNAL with a generic message, the cause
// staying in the log.
func ToStatus(err error) *status.Status {
	fe, ok := As(err)
	if st, isStatus := status.FromError(err); isStatus && !ok {
		return st
	}
	if !ok {
		fe = New(Internal, "", "internal error")
	}
	return fe.Status()
}
