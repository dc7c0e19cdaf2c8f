package api

import (
	"context"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Naming a stored secret by reference (metal.enroll bmc.credentialsRef,
// pools.update provider.credentialsRef) is using it: the control plane
// will send what it holds somewhere. The decision is the call's own action
// on every resource already using the secret: a caller may name a secret
// only when it could do the same call on each of them (enroll into that
// machine's pool and labels, update that pool). So a policy scoped to a
// lab pool does not lend the lab's enroller a production machine's BMC
// password, with no new resource type or action to write policies for.
// A secret no resource uses no longer exists (it goes with its last user).

// mayUseSecret decides the caller's action on each of users, the
// resources already naming secret ref; a denial is ACCESS_DENIED on field.
// A decision that fails for another reason is returned as it is.
func (s *Server) mayUseSecret(ctx context.Context, tenant, field, ref string, users []authz.Resource) error {
	for _, u := range users {
		err := s.read(ctx, tenant, u)
		switch code := fault.CodeOf(err); {
		case err == nil:
		case code == fault.AccessDenied || code == fault.NotFound:
			return fault.New(fault.AccessDenied, field,
				"secret %s is used by a %s this call is not allowed on: give the credentials instead", ref, u.Type)
		default:
			return err
		}
	}
	return nil
}
