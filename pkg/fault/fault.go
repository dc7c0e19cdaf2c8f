// Package fault defines Better Compute's stable error codes and the error type
// that carries them, with the offending field, from wherever a failure is found
// to the edge (CLI, gRPC, REST) that reports it.
//
// Codes are data, kept in one table ([Codes]); the edges map them to transport
// statuses and never invent their own.
package fault

import (
	"errors"
	"fmt"
	"net/http"

	"google.golang.org/grpc/codes"
)

// Code is a stable, machine-readable error code. Clients switch on it; its
// string value never changes once released.
type Code string

// The codes of DESIGN §8, then the gateway's refusals of an agent outside
// its version-skew window (gateway.agentVersions). Add a code here and to
// [Codes] (or [SessionCodes]), nowhere else.
const (
	InvalidInput    Code = "INVALID_INPUT"
	InvalidConfig   Code = "INVALID_CONFIG"
	Unauthenticated Code = "UNAUTHENTICATED"
	AccessDenied    Code = "ACCESS_DENIED"
	NotFound        Code = "NOT_FOUND"
	Conflict        Code = "CONFLICT"
	Unsupported     Code = "UNSUPPORTED"
	QuotaExceeded   Code = "QUOTA_EXCEEDED"
	NoCapacity      Code = "NO_CAPACITY"
	RateLimited     Code = "RATE_LIMITED"
	Unavailable     Code = "UNAVAILABLE"
	Internal        Code = "INTERNAL"
	AgentTooOld     Code = "AGENT_TOO_OLD"
	AgentTooNew     Code = "AGENT_TOO_NEW"
)

// Info describes a code: what it means and whether retrying the same request
// can succeed.
type Info struct {
	Code      Code
	Meaning   string
	Retryable bool
	// GRPC is the gRPC status code the API answers with.
	GRPC codes.Code
	// HTTP is the REST status code the API answers with.
	HTTP int
}

// Codes is the table of every code, in a stable order.
var Codes = []Info{
	{InvalidInput, "the request is malformed or a field is out of range", false, codes.InvalidArgument, http.StatusBadRequest},
	{InvalidConfig, "the configuration is invalid; nothing was started", false, codes.FailedPrecondition, http.StatusInternalServerError},
	{Unauthenticated, "no valid credential was presented", false, codes.Unauthenticated, http.StatusUnauthorized},
	{AccessDenied, "the caller may not do this", false, codes.PermissionDenied, http.StatusForbidden},
	{NotFound, "the resource does not exist or is not visible to the caller", false, codes.NotFound, http.StatusNotFound},
	{Conflict, "the request conflicts with the current state or an earlier request under the same idempotency key", false, codes.Aborted, http.StatusConflict},
	{Unsupported, "the operation or kind is not supported here", false, codes.Unimplemented, http.StatusBadRequest},
	{QuotaExceeded, "the tenant's quota does not allow this", false, codes.ResourceExhausted, http.StatusForbidden},
	{NoCapacity, "no capacity matches the request now", true, codes.ResourceExhausted, http.StatusServiceUnavailable},
	{RateLimited, "too many requests from this identity; retry later", true, codes.ResourceExhausted, http.StatusTooManyRequests},
	{Unavailable, "a dependency is unavailable; retry later", true, codes.Unavailable, http.StatusServiceUnavailable},
	{Internal, "an unexpected error; it has been logged", true, codes.Internal, http.StatusInternalServerError},
}

// SessionCodes are the codes the gateway refuses a node daemon's session
// with (agent/v1 NodeService.Session); no API method answers them, so they
// are not in [Codes], the API's table.
var SessionCodes = []Info{
	{AgentTooOld, "the node daemon's version is older than the oldest the gateway accepts (gateway.agentVersions); upgrade it", false, codes.FailedPrecondition, http.StatusPreconditionFailed},
	{AgentTooNew, "the node daemon's version is newer than the newest the gateway accepts (gateway.agentVersions); upgrade the control plane or roll the node back", false, codes.FailedPrecondition, http.StatusPreconditionFailed},
}

// Lookup returns the Info of a code (of [Codes] or [SessionCodes]) and
// whether it is known.
func Lookup(c Code) (Info, bool) {
	for _, table := range [][]Info{Codes, SessionCodes} {
		for _, i := range table {
			if i.Code == c {
				return i, true
			}
		}
	}
	return Info{}, false
}

// Error is an error with a stable code, a human message and, where one input
// is at fault, the field that is (a dotted path such as "database.url").
type Error struct {
	Code    Code
	Field   string
	Message string
	// Err is an underlying cause, kept for logs and errors.Is; it is not shown
	// to API callers.
	Err error
}

// Error renders "CODE field: message" (the field is omitted when empty).
func (e *Error) Error() string {
	if e.Field != "" {
		return fmt.Sprintf("%s %s: %s", e.Code, e.Field, e.Message)
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// New returns an *Error with a formatted message.
func New(code Code, field, format string, args ...any) *Error {
	return &Error{Code: code, Field: field, Message: fmt.Sprintf(format, args...)}
}

// Wrap returns an *Error that keeps err as its cause.
func Wrap(err error, code Code, field, format string, args ...any) *Error {
	return &Error{Code: code, Field: field, Message: fmt.Sprintf(format, args...), Err: err}
}

// As returns the first *Error in err's chain (including joined errors).
func As(err error) (*Error, bool) {
	var fe *Error
	if errors.As(err, &fe) {
		return fe, true
	}
	return nil, false
}

// CodeOf returns the code of the first *Error in err's chain, Internal for any
// other non-nil error and "" for nil.
func CodeOf(err error) Code {
	if err == nil {
		return ""
	}
	if fe, ok := As(err); ok {
		return fe.Code
	}
	return Internal
}

// MessageOf returns the message of the first *Error in err's chain (without
// its code and field), or err's own text for any other error.
func MessageOf(err error) string {
	if fe, ok := As(err); ok {
		return fe.Message
	}
	return err.Error()
}

// All returns every *Error in err, looking through errors.Join trees and
// wrapping, in order.
func All(err error) []*Error {
	var out []*Error
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		// This walks the error tree node by node, which errors.As cannot.
		if fe, ok := e.(*Error); ok { //nolint:errorlint // see above
			out = append(out, fe)
			return
		}
		switch u := e.(type) { //nolint:errorlint // see above
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}
