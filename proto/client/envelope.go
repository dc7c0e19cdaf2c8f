package client

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of every Better Compute API
// error.
const ErrorDomain = "api.bettercompute"

// Code is a stable, machine-readable error code of the API (DESIGN §8). Its
// string value never changes once released.
type Code string

// The API's error codes.
const (
	CodeInvalidInput    Code = "INVALID_INPUT"
	CodeInvalidConfig   Code = "INVALID_CONFIG"
	CodeUnauthenticated Code = "UNAUTHENTICATED"
	CodeAccessDenied    Code = "ACCESS_DENIED"
	CodeNotFound        Code = "NOT_FOUND"
	CodeConflict        Code = "CONFLICT"
	CodeUnsupported     Code = "UNSUPPORTED"
	CodeQuotaExceeded   Code = "QUOTA_EXCEEDED"
	CodeNoCapacity      Code = "NO_CAPACITY"
	CodeRateLimited     Code = "RATE_LIMITED"
	CodeUnavailable     Code = "UNAVAILABLE"
	CodeInternal        Code = "INTERNAL"
)

// Codes lists every code, in the order of DESIGN §8.
var Codes = []Code{
	CodeInvalidInput, CodeInvalidConfig, CodeUnauthenticated, CodeAccessDenied,
	CodeNotFound, CodeConflict, CodeUnsupported, CodeQuotaExceeded,
	CodeNoCapacity, CodeRateLimited, CodeUnavailable, CodeInternal,
}

// Envelope is the API's error: a stable code, a human message and, where one
// input is at fault, the field that is (a path such as "labels.zone"). Over
// REST it is the JSON body of every error answer, {"code","message","field"};
// over gRPC it travels as the status message and an ErrorInfo detail.
type Envelope struct {
	Code    Code   `json:"code"`
	Message string `json:"message"`
	Field   string `json:"field,omitempty"`
}

// String renders "CODE field: message", the field omitted when empty.
func (e Envelope) String() string {
	if e.Field != "" {
		return fmt.Sprintf("%s %s: %s", e.Code, e.Field, e.Message)
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// EnvelopeOf returns the envelope of an error returned by a call: the code and
// field from the status's ErrorInfo detail in [ErrorDomain] when there is one
// (every error the API's handlers return), else a code derived from the gRPC
// status code (errors made outside the handlers: transport failures,
// deadlines, unknown methods). A context's cancellation or deadline is
// UNAVAILABLE; any other non-status error is INTERNAL with the error's text.
// It returns the zero Envelope for a nil error.
func EnvelopeOf(err error) Envelope {
	if err == nil {
		return Envelope{}
	}
	st, ok := status.FromError(err)
	if !ok {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			st = status.FromContextError(err)
		} else {
			return Envelope{Code: CodeInternal, Message: err.Error()}
		}
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == ErrorDomain {
			return Envelope{Code: Code(ei.GetReason()), Message: st.Message(), Field: ei.GetMetadata()["field"]}
		}
	}
	return Envelope{Code: codeFromGRPC(st.Code()), Message: st.Message()}
}

// codeFromGRPC maps a status made outside the API's handlers onto a code, as
// the server does for REST.
func codeFromGRPC(c codes.Code) Code {
	switch c {
	case codes.InvalidArgument, codes.OutOfRange:
		return CodeInvalidInput
	case codes.Unauthenticated:
		return CodeUnauthenticated
	case codes.PermissionDenied:
		return CodeAccessDenied
	case codes.NotFound:
		return CodeNotFound
	case codes.AlreadyExists, codes.Aborted, codes.FailedPrecondition:
		return CodeConflict
	case codes.Unimplemented:
		return CodeUnsupported
	case codes.ResourceExhausted:
		return CodeRateLimited
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
		return CodeUnavailable
	}
	return CodeInternal
}
