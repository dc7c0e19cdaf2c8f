package api

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"regexp"
	"strings"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Envelope is the REST error body, and what the gRPC status details carry:
// the stable code, a message and the offending field where there is one.
type Envelope struct {
	Code    fault.Code `json:"code"`
	Message string     `json:"message"`
	Field   string     `json:"field,omitempty"`
}

// FromStatus reads the envelope back from a gRPC status: the ErrorInfo when
// present, else a code derived from the gRPC code.
func FromStatus(st *status.Status) Envelope {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == fault.ErrorDomain {
			return Envelope{Code: fault.Code(ei.GetReason()), Message: st.Message(), Field: ei.GetMetadata()["field"]}
		}
	}
	if st.Code() == codes.ResourceExhausted && strings.Contains(st.Message(), "larger than max") {
		return Envelope{Code: fault.InvalidInput, Message: st.Message()}
	}
	return Envelope{Code: codeFromGRPC(st.Code()), Message: st.Message()}
}

// codeFromGRPC maps statuses made outside our handlers (the gateway's own
// decoding errors, deadlines, the transport) onto our codes.
func codeFromGRPC(c codes.Code) fault.Code {
	switch c {
	case codes.InvalidArgument, codes.OutOfRange:
		return fault.InvalidInput
	case codes.Unauthenticated:
		return fault.Unauthenticated
	case codes.PermissionDenied:
		return fault.AccessDenied
	case codes.NotFound:
		return fault.NotFound
	case codes.AlreadyExists, codes.Aborted, codes.FailedPrecondition:
		return fault.Conflict
	case codes.Unimplemented:
		return fault.Unsupported
	case codes.ResourceExhausted:
		return fault.RateLimited // a message over the size limit is answered by grpc-go itself; see FromStatus
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
		return fault.Unavailable
	}
	return fault.Internal
}

// unaryErrors maps every handler error to the envelope's status and logs the
// unexpected ones.
func unaryErrors(logger *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if err == nil {
			return resp, nil
		}
		st := fault.ToStatus(err)
		if FromStatus(st).Code == fault.Internal {
			logger.ErrorContext(ctx, "request failed", "method", info.FullMethod, "err", err)
		}
		return nil, st.Err()
	}
}

// writeEnvelope writes the REST error body for a gRPC status.
func writeEnvelope(w http.ResponseWriter, st *status.Status) {
	env := FromStatus(st)
	code := http.StatusInternalServerError
	if info, ok := fault.Lookup(env.Code); ok {
		code = info.HTTP
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(env)
}

// gatewayErrorHandler is grpc-gateway's error handler: the REST envelope.
func gatewayErrorHandler(ctx context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, _ *http.Request, err error) {
	if md, ok := runtime.ServerMetadataFromContext(ctx); ok && (len(md.HeaderMD.Get(DeprecationHeader)) > 0 || len(md.TrailerMD.Get(DeprecationHeader)) > 0) {
		w.Header().Set("Deprecation", "true") // a refused request also learns it used a deprecated name
	}
	st, ok := status.FromError(err)
	if !ok {
		st = fault.ToStatus(err)
	}
	var herr *runtime.HTTPStatusError
	if errors.As(err, &herr) {
		st = routingStatus(herr.HTTPStatus)
	}
	writeEnvelope(w, decodeStatus(st))
}

var (
	unknownFieldRE = regexp.MustCompile(`unknown field "([^"]+)"`)
	badValueRE     = regexp.MustCompile(`invalid value for [a-z0-9]+ field ([A-Za-z0-9_]+)`)
	badKeyRE       = regexp.MustCompile(`invalid value for [a-z0-9]+ key`)
)

// decodeStatus turns the gateway's own body-decoding errors (made before any
// handler runs) into the envelope, naming the field where protojson does.
func decodeStatus(st *status.Status) *status.Status {
	if st.Code() != codes.InvalidArgument || hasEnvelope(st) {
		return st
	}
	msg := st.Message()
	switch {
	case strings.Contains(msg, "request body too large"):
		return fault.New(fault.InvalidInput, "", "request body exceeds %d bytes", MaxRequestBytes).Status()
	case unknownFieldRE.MatchString(msg):
		f := unknownFieldRE.FindStringSubmatch(msg)[1]
		return fault.New(fault.InvalidInput, f, "unknown field %q", f).Status()
	case badValueRE.MatchString(msg):
		f := badValueRE.FindStringSubmatch(msg)[1]
		if f == "key" || f == "value" {
			f = "" // a map entry's: protojson does not name the map
		}
		return fault.New(fault.InvalidInput, f, "wrong type or value: %s", strings.TrimPrefix(msg, "proto: ")).Status()
	case badKeyRE.MatchString(msg):
		return fault.New(fault.InvalidInput, "", "wrong map key: %s", strings.TrimPrefix(msg, "proto: ")).Status()
	}
	return fault.New(fault.InvalidInput, "", "malformed request body: %s", strings.TrimPrefix(msg, "proto: ")).Status()
}

func hasEnvelope(st *status.Status) bool {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == fault.ErrorDomain {
			return true
		}
	}
	return false
}

// routingStatus answers a request that matched no method.
func routingStatus(httpStatus int) *status.Status {
	switch httpStatus {
	case http.StatusMethodNotAllowed:
		return fault.New(fault.Unsupported, "", "every API method is POST /api/compute/{group}/{method}").Status()
	default:
		return fault.New(fault.NotFound, "", "no API method at this path; see /api/compute/openapi.json").Status()
	}
}

func routingErrorHandler(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, httpStatus int) {
	writeEnvelope(w, routingStatus(httpStatus))
}
