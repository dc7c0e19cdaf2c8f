package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

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
	if err := checkLimits(req); err != nil {
		return nil, err
	}
	md, _ := metadata.FromIncomingContext(ctx)
	ctx = withRequestID(ctx, first(md, RequestIDHeader))
	if dl, ok := ctx.Deadline(); !ok || time.Until(dl) > s.maxDL {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.maxDL)
		defer cancel()
	}
	if m.Anonymous {
		if !s.anon.Allow(s.clientAddr(ctx, md)) {
			return nil, fault.New(fault.RateLimited, "", "too many requests without a credential from this address; retry later")
		}
		return handler(ctx, req)
	}
	p, err := s.authenticate(ctx, s.clientAddr(ctx, md), first(md, "authorization"))
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

// authenticate checks a request's Authorization header (cached) and the
// identity's rate limit. The credential is checked first: a valid one is
// never refused for its client address's failures (one address may be many
// users behind a NAT or an ingress). Each failed authentication spends the
// address's budget; once it is spent, failures answer RATE_LIMITED instead
// of UNAUTHENTICATED until it refills.
func (s *Server) authenticate(ctx context.Context, addr, header string) (iam.Principal, error) {
	token, err := bearer(header)
	if err == nil {
		var p iam.Principal
		if p, err = s.authn.Authenticate(ctx, token); err == nil {
			if !s.limiter.Allow(p.IdentityID) {
				return iam.Principal{}, fault.New(fault.RateLimited, "", "identity %s is over its request rate; retry later", p.IdentityID)
			}
			return p, nil
		}
	}
	if fault.CodeOf(err) == fault.Unauthenticated && !s.failedAuth.Allow(addr) {
		return iam.Principal{}, fault.New(fault.RateLimited, "", "too many failed authentications from this address; retry later")
	}
	return iam.Principal{}, err
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
		return fault.New(fault.Unsupported, "", "method %s is not served here", info.FullMethod).Status().Err()
	}
	ctx := ss.Context()
	md, _ := metadata.FromIncomingContext(ctx)
	ctx = withRequestID(ctx, first(md, RequestIDHeader))
	if m.Anonymous && !m.OwnCredential && !s.anon.Allow(s.clientAddr(ctx, md)) {
		return fault.New(fault.RateLimited, "", "too many requests without a credential from this address; retry later").Status().Err()
	}
	if m.OwnCredential {
		ctx = withClientAddr(ctx, s.clientAddr(ctx, md))
	}
	if !m.Anonymous {
		p, err := s.authenticate(ctx, s.clientAddr(ctx, md), first(md, "authorization"))
		if err != nil {
			return fault.ToStatus(err).Err()
		}
		ctx = iam.WithPrincipal(ctx, p)
	}
	err := handler(srv, &contextStream{ServerStream: ss, ctx: ctx})
	if err != nil {
		return fault.ToStatus(err).Err()
	}
	return nil
}

// contextStream is a server stream with the context streamAuth built.
type contextStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (c *contextStream) Context() context.Context { return c.ctx }

// RecvMsg receives a request, moves deprecated field names to their new
// ones (normalizeRenamed) and holds it to the field limits (checkLimits).
func (c *contextStream) RecvMsg(m any) error {
	if err := c.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if _, err := normalizeRenamed(m); err != nil {
		return fault.ToStatus(err).Err()
	}
	if err := checkLimits(m); err != nil {
		return fault.ToStatus(err).Err()
	}
	return nil
}

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

// outgoingHeaderMatcher names the REST headers of gRPC response metadata:
// "Deprecation" as itself (a request used a deprecated field name, see
// Renamed); the rest as grpc-gateway does by default, Grpc-Metadata-<key>.
func outgoingHeaderMatcher(key string) (string, bool) {
	if key == DeprecationHeader {
		return "Deprecation", true
	}
	return runtime.MetadataHeaderPrefix + key, true
}

// clientAddr is the address a request came from, the key of the
// per-address limits (see package clientaddr for the trusted proxies'
// X-Forwarded-For). A REST request reaches the gRPC server through the
// in-process gateway, which appends the HTTP client's address to its
// X-Forwarded-For: the last entry is the HTTP peer, the rest what the
// client sent. The console and the MCP server send the client address they
// resolved (api.AsCaller). A direct gRPC client is its connection's peer,
// or — when that is a trusted proxy — what its x-forwarded-for says.
func (s *Server) clientAddr(ctx context.Context, md metadata.MD) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	xff := md.Get("x-forwarded-for")
	if p.Addr.Network() == InternalNetwork && len(xff) > 0 {
		last := xff[len(xff)-1]
		i := strings.LastIndexByte(last, ',')
		httpPeer := strings.TrimSpace(last[i+1:])
		rest := append(slices.Clone(xff[:len(xff)-1]), last[:max(i, 0)])
		return s.proxies.Resolve(httpPeer, rest)
	}
	return s.proxies.Resolve(hostOf(p.Addr.String()), xff)
}

// hostOf is the host of a host:port address (the whole string if it has no
// port).
func hostOf(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return host
}
