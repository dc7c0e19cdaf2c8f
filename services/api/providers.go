package api

import (
	"context"
	"strings"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/providers"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/secrets"
)

// Provider pools (class "provider"): pools.update "provider" names the
// provider's API and its credentials; instances.create there inserts the
// instance without a host and enqueues the vps.provider workflow
// (services/vps), which makes its machine.

// providerUpdate is a validated pools.update "provider".
type providerUpdate struct {
	endpoint, ref, token string
}

// validProvider checks pools.update's provider settings, naming the field
// (provider.endpoint, provider.credentialsRef, provider.token); the token
// never shows in an error.
func (s *Server) validProvider(ps *computev1.ProviderSettings) (*providerUpdate, error) {
	u := &providerUpdate{endpoint: ps.GetEndpoint(), ref: ps.GetCredentialsRef(), token: ps.GetToken()}
	if err := providers.ValidEndpoint(u.endpoint, s.providers); err != nil {
		return nil, err // INVALID_INPUT on provider.endpoint: private, loopback and metadata hosts refused
	}
	switch {
	case u.ref != "" && u.token != "":
		return nil, fault.New(fault.InvalidInput, "provider.token", "not with provider.credentialsRef: name the credentials or give them, not both")
	case u.ref != "" && (!strings.HasPrefix(u.ref, "sec_") || len(u.ref) > 64):
		return nil, fault.New(fault.InvalidInput, "provider.credentialsRef", "%q is not a secret id (sec_…)", u.ref)
	case u.ref == "":
		if err := providers.ValidToken(u.token); err != nil {
			return nil, fault.New(fault.InvalidInput, "provider.token", "%v (or provider.credentialsRef)", err)
		}
	}
	if s.secrets == nil {
		return nil, fault.New(fault.Unsupported, secrets.ConfigField,
			"this control plane has no secrets key, so it cannot hold provider credentials: set %s", secrets.ConfigField)
	}
	return u, nil
}

// setProvider stores a provider pool's settings in tx: the token as a new
// secret of the pool's tenant, or the named secret once checked to be the
// tenant's and of kind provider.
func (s *Server) setProvider(ctx context.Context, tx pgx.Tx, poolID, class, tenant string, u *providerUpdate) error {
	if class != "provider" {
		return fault.New(fault.InvalidInput, "provider", "pool %s is a %s pool; provider settings apply to provider pools", poolID, class)
	}
	ref := u.ref
	if ref == "" {
		ref = secrets.NewID()
		creds := providers.Credentials{Token: u.token}
		if err := secrets.Put(ctx, tx, s.secrets, secrets.Secret{ID: ref, TenantID: tenant, Kind: secrets.KindProvider, Plain: creds.Marshal()}); err != nil {
			return err
		}
	} else {
		meta, err := secrets.Get(ctx, tx, tenant, ref)
		if fault.CodeOf(err) == fault.NotFound {
			return fault.New(fault.NotFound, "provider.credentialsRef", "secret %q not found in tenant %s", ref, tenant)
		}
		if err != nil {
			return err
		}
		if meta.Kind != secrets.KindProvider {
			return fault.New(fault.InvalidInput, "provider.credentialsRef", "secret %s holds %s, not provider credentials", ref, meta.Kind)
		}
		if err := s.mayUsePoolSecret(ctx, tx, tenant, ref); err != nil {
			return err
		}
	}
	return instances.SetProviderSettings(ctx, tx, instances.ProviderSettings{PoolID: poolID, Endpoint: u.endpoint, CredentialsRef: ref})
}

// mayUsePoolSecret decides pools.update on every pool already naming
// secret ref (see mayUseSecret).
func (s *Server) mayUsePoolSecret(ctx context.Context, tx pgx.Tx, tenant, ref string) error {
	ids, err := instances.PoolsUsingCredentials(ctx, tx, ref)
	if err != nil {
		return err
	}
	users := make([]authz.Resource, 0, len(ids))
	for _, id := range ids {
		res, err := authz.Get(ctx, tx, tenant, authz.TypePool, id, "provider.credentialsRef")
		if err != nil {
			return err
		}
		users = append(users, res)
	}
	return s.mayUseSecret(ctx, tenant, "provider.credentialsRef", ref, users)
}

// createAtProvider is instances.create's work on a provider pool: the
// instance is inserted pending, without a host, and the provider workflow
// enqueued in the same transaction.
func createAtProvider(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, in instances.Instance) (instances.Instance, error) {
	if _, ok, err := instances.GetProviderSettings(ctx, tx, in.PoolID); err != nil {
		return instances.Instance{}, err
	} else if !ok {
		return instances.Instance{}, fault.New(fault.InvalidInput, "poolId", "provider pool %s has no provider yet: set it with pools.update provider", in.PoolID)
	}
	if err := instances.Insert(ctx, tx, in); err != nil {
		return instances.Instance{}, err
	}
	if err := q.Enqueue(ctx, instances.ProviderJob, in.ID); err != nil {
		return instances.Instance{}, err
	}
	return instances.Lock(ctx, tx, in.ID)
}
