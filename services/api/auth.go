package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// RequestIDHeader carries a caller's request id (REST header, gRPC
// metadata); the server makes one when it is absent.
const RequestIDHeader = "x-request-id"

// tenantScoped is every request that names its tenant.
type tenantScoped interface{ GetTenantId() string }

// unaryAuth runs before every handler: request id and deadline, then — for
// methods that need a credential — authentication (cached), the identity's
// rate limit and the tenant pre-check, all before the handler touches the
// database.
func (s *Server) unaryAuth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m, ok := s.methods[info.FullMethod]
	if !ok {
		if !strings.HasPrefix(info.FullMethod, "/"+APIPackage+".") {
			return handler(ctx, req) // gRPC health
		}
		return nil, fault.New(fault.Unsupported, "", "method %s is not served here", info.FullMethod)
	}
	md, _ := metadata.FromIncomingContext(ctx)
	ctx = withRequestID(ctx, first(md, RequestIDHeader))
	if dl, ok := ctx.Deadline(); !ok || time.Until(dl) > s.maxDL {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.maxDL)
		defer cancel()
	}
	if m.Anonymous {
		return handler(ctx, req)
	}
	p, err := s.authenticate(ctx, first(md, "authorization"))
	if err != nil {
		return nil, err
	}
	if r, ok := req.(tenantScoped); ok {
		if err := precheck(p, r.GetTenantId()); err != nil {
			return nil, err
		}
	}
	return handler(iam.WithPrincipal(ctx, p), req)
}

// authenticate checks an Authorization header value (cached) and the
// identity's rate limit.
func (s *Server) authenticate(ctx context.Context, header string) (iam.Principal, error) {
	token, err := bearer(header)
	if err != nil {
		return iam.Principal{}, err
	}
	p, err := s.authn.Authenticate(ctx, token)
	if err != nil {
		return iam.Principal{}, err
	}
	if !s.limiter.allow(p.IdentityID) {
		return iam.Principal{}, fault.New(fault.RateLimited, "", "identity %s is over its request rate; retry later", p.IdentityID)
	}
	return p, nil
}

// precheck is the tenant pre-check: a request's tenant must be well formed
// and covered by the caller's, before anything touches the database.
func precheck(p iam.Principal, tenant string) error {
	switch {
	case tenant == "":
		return fault.New(fault.InvalidInput, "tenantId", "required")
	case !iam.ValidTenantID(tenant):
		return fault.New(fault.InvalidInput, "tenantId", "%q is not a tenant id", tenant)
	case !p.Covers(tenant):
		return fault.New(fault.AccessDenied, "tenantId", "%s of tenant %s may not act in tenant %s", p.IdentityID, p.TenantID, tenant)
	}
	return nil
}

// streamAuth is unaryAuth for streaming methods: request id and
// authentication before the handler; the handler, which reads the request,
// makes the tenant pre-check. Streams have no deadline of the server's.
func (s *Server) streamAuth(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	m, ok := s.methods[info.FullMethod]
	if !ok {
		if !strings.HasPrefix(info.FullMethod, "/"+APIPackage+".") {
			return handler(srv, ss) // reflection
		}
		return ToStatus(fault.New(fault.Unsupported, "", "method %s is not served here", info.FullMethod)).Err()
	}
	ctx := ss.Context()
	md, _ := metadata.FromIncomingContext(ctx)
	ctx = withRequestID(ctx, first(md, RequestIDHeader))
	if !m.Anonymous {
		p, err := s.authenticate(ctx, first(md, "authorization"))
		if err != nil {
			return ToStatus(err).Err()
		}
		ctx = iam.WithPrincipal(ctx, p)
	}
	err := handler(srv, &contextStream{ServerStream: ss, ctx: ctx})
	if err != nil {
		return ToStatus(err).Err()
	}
	return nil
}

// contextStream is a server stream with the context streamAuth built.
type contextStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (c *contextStream) Context() context.Context { return c.ctx }

func first(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// bearer extracts the token of an "Authorization: Bearer <token>" value.
func bearer(h string) (string, error) {
	if h == "" {
		return "", fault.New(fault.Unauthenticated, "authorization", "no credential: send Authorization: Bearer bck_<id>.<secret>")
	}
	scheme, token, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "bearer") || strings.TrimSpace(token) == "" {
		return "", fault.New(fault.Unauthenticated, "authorization", "malformed credential: expected Bearer bck_<id>.<secret>")
	}
	return strings.TrimSpace(token), nil
}

type requestIDKey struct{}

func withRequestID(ctx context.Context, id string) context.Context {
	if id == "" || len(id) > 128 {
		b := make([]byte, 12)
		_, _ = rand.Read(b)
		id = hex.EncodeToString(b)
	}
	return context.WithValue(ctx, requestIDKey{}, id)
}

// RequestID returns the request id of a call.
func RequestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

// headerMatcher forwards the REST headers the API reads to gRPC metadata
// (Authorization is forwarded by grpc-gateway itself).
func headerMatcher(key string) (string, bool) {
	if strings.EqualFold(key, RequestIDHeader) {
		return RequestIDHeader, true
	}
	return "", false
}

// limiter is a token bucket per identity on the server's clock.
type limiter struct {
	mu    sync.Mutex
	rps   rate.Limit
	burst int
	now   func() time.Time
	by    map[string]*rate.Limiter
}

func newLimiter(rps float64, burst int, now func() time.Time) *limiter {
	return &limiter{rps: rate.Limit(rps), burst: burst, now: now, by: map[string]*rate.Limiter{}}
}

func (l *limiter) allow(identity string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	lim, ok := l.by[identity]
	if !ok {
		if len(l.by) >= 100_000 {
			clear(l.by) // forgetting buckets only ever lets more through
		}
		lim = rate.NewLimiter(l.rps, l.burst)
		l.by[identity] = lim
	}
	return lim.AllowN(l.now(), 1)
}
