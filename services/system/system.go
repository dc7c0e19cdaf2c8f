// Package system implements the System API group: what this control plane is
// (Version), whether it is healthy (Health) and who is calling (WhoAmI).
package system

import (
	"context"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/health"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/version"
)

// Deps are what the service reads.
type Deps struct {
	// SchemaVersion returns the database's applied schema version.
	SchemaVersion func(ctx context.Context) (int64, error)
	// RequiredSchemaVersion is the schema version this binary needs.
	RequiredSchemaVersion int64
	// Checks are the process's health checks, shared with /readyz.
	Checks []health.Check
	// Authorizer decides WhoAmI's action; nil answers WhoAmI with
	// UNSUPPORTED.
	Authorizer Authorizer
}

// Authorizer makes one decision.
type Authorizer interface {
	Authorize(ctx context.Context, q authz.Querier, p iam.Principal, action authz.Action, res authz.Resource) error
}

// Service implements computev1.SystemServiceServer.
type Service struct {
	computev1.UnimplementedSystemServiceServer
	deps Deps
}

// New returns the service.
func New(deps Deps) *Service { return &Service{deps: deps} }

// Version reports the build and the schema versions. A database that cannot
// be read reports schema version 0 rather than failing: Version must answer
// when little else does.
func (s *Service) Version(ctx context.Context, _ *computev1.VersionRequest) (*computev1.VersionResponse, error) {
	v := version.Get()
	resp := &computev1.VersionResponse{
		Version:               v.Version,
		Commit:                v.Commit,
		GoVersion:             v.GoVersion,
		RequiredSchemaVersion: s.deps.RequiredSchemaVersion,
	}
	if s.deps.SchemaVersion != nil {
		if sv, err := s.deps.SchemaVersion(ctx); err == nil {
			resp.SchemaVersion = sv
		}
	}
	return resp, nil
}

// Health runs the process's checks.
func (s *Service) Health(ctx context.Context, _ *computev1.HealthRequest) (*computev1.HealthResponse, error) {
	rep := health.Run(ctx, s.deps.Checks)
	resp := &computev1.HealthResponse{Status: computev1.HealthStatus_HEALTH_STATUS_OK}
	if !rep.Ready || rep.Degraded {
		resp.Status = computev1.HealthStatus_HEALTH_STATUS_DEGRADED
	}
	for _, r := range rep.Checks {
		resp.Checks = append(resp.Checks, &computev1.HealthCheck{Name: r.Name, Ok: r.OK, Message: r.Message})
	}
	return resp, nil
}

// WhoAmI returns the authenticated caller, once it may see its own tenant
// (action compute:system:whoami on it).
func (s *Service) WhoAmI(ctx context.Context, _ *computev1.WhoAmIRequest) (*computev1.WhoAmIResponse, error) {
	p, ok := iam.PrincipalFrom(ctx)
	if !ok {
		return nil, fault.New(fault.Unauthenticated, "authorization", "no credential")
	}
	if s.deps.Authorizer == nil {
		return nil, fault.New(fault.Unsupported, "", "whoAmI is not available in this process")
	}
	if err := s.deps.Authorizer.Authorize(ctx, nil, p, authz.SystemWhoAmI, authz.TenantResource(p.TenantID)); err != nil {
		return nil, err
	}
	return &computev1.WhoAmIResponse{IdentityId: p.IdentityID, TenantId: p.TenantID, Kind: p.Kind, Name: p.Name, KeyId: p.KeyID}, nil
}
