// Package bootstrap makes the first credential of a fresh control plane: an
// identity in the root tenant, an API key for it, and the policy that gives
// the root tenant's identities every right. Nothing is hard-coded to bypass
// authorization; root's rights are that policy, which an operator can read,
// narrow or replace with the policies API.
package bootstrap

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/outbox"
)

// IdentityName is the name of the root identity bootstrap creates.
const IdentityName = "root-admin"

// PolicyName is the name of the root tenant's policy bootstrap installs.
const PolicyName = "root-admin"

// RootPolicy gives identities of the root tenant (and only those: members of
// other tenants are "in" root too, through the tree) every action on every
// resource.
const RootPolicy = `// Installed by better-compute bootstrap: identities of the root tenant may do anything.
@id("root-admin")
permit (principal, action, resource)
when { principal.tenant == Tenant::"root" };
`

// DB is what Bootstrap needs: a pool.
type DB interface {
	db.Beginner
}

// Credential is what Bootstrap made.
type Credential struct {
	// Token is the API key, bck_<id>.<secret>; it is not stored anywhere.
	Token string
	// IdentityID is the root identity.
	IdentityID string
	// KeyID is the key's id.
	KeyID string
}

// Run creates the root identity unless it exists, installs [RootPolicy]
// under [PolicyName] (replacing a changed one), and mints a new key. Running
// it again makes another key for the same identity.
func Run(ctx context.Context, pool DB) (Credential, error) {
	var cred Credential
	err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
		ident, err := findOrCreate(ctx, tx)
		if err != nil {
			return err
		}
		if _, err := authz.PutPolicy(ctx, tx, authz.Policy{TenantID: iam.RootTenant, Name: PolicyName, Body: RootPolicy}); err != nil {
			return err
		}
		key := iam.NewKey()
		if _, err := iam.CreateKey(ctx, tx, iam.APIKey{ID: key.ID, IdentityID: ident.ID, TenantID: iam.RootTenant, Name: "bootstrap"}, key.Hash); err != nil {
			return err
		}
		for _, res := range []authz.Resource{
			{Type: authz.TypeIdentity, ID: ident.ID, TenantID: iam.RootTenant},
			{Type: authz.TypeAPIKey, ID: key.ID, TenantID: iam.RootTenant},
			authz.TenantResource(iam.RootTenant),
		} {
			if err := authz.Put(ctx, tx, res); err != nil {
				return err
			}
		}
		if err := audit.Write(ctx, tx, audit.Record{
			TenantID: iam.RootTenant, Actor: "bootstrap", ActorTenantID: iam.RootTenant,
			Action: string(authz.APIKeysCreate), Resource: authz.Resource{Type: authz.TypeAPIKey, ID: key.ID}.UID(),
			Decision: audit.Allow, Detail: map[string]any{"identityId": ident.ID, "policy": PolicyName},
		}); err != nil {
			return err
		}
		if _, err := outbox.Write(ctx, tx, outbox.Event{TenantID: iam.RootTenant, Type: "apiKey.created", Resource: key.ID,
			Payload: map[string]any{"id": key.ID, "identityId": ident.ID, "tenantId": iam.RootTenant}}); err != nil {
			return err
		}
		cred = Credential{Token: key.Token, IdentityID: ident.ID, KeyID: key.ID}
		return nil
	})
	if err != nil {
		return Credential{}, fmt.Errorf("bootstrap: %w", err)
	}
	return cred, nil
}

func findOrCreate(ctx context.Context, tx pgx.Tx) (iam.Identity, error) {
	var id string
	err := tx.QueryRow(ctx, `SELECT id FROM identities
		WHERE tenant_id = $1 AND (name = $2 OR name LIKE $2 || '-%') AND revoked_at IS NULL
		ORDER BY created_at DESC LIMIT 1`, iam.RootTenant, IdentityName).Scan(&id)
	if err == nil {
		return iam.GetIdentity(ctx, tx, iam.RootTenant, id)
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return iam.Identity{}, fmt.Errorf("find root identity: %w", err)
	}
	// A revoked root-admin keeps its name; the new one takes a suffixed name.
	name := IdentityName
	var n int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM identities WHERE tenant_id = $1 AND name LIKE $2`,
		iam.RootTenant, IdentityName+"%").Scan(&n); err != nil {
		return iam.Identity{}, fmt.Errorf("find root identity: %w", err)
	}
	if n > 0 {
		name = fmt.Sprintf("%s-%d", IdentityName, n+1)
	}
	return iam.CreateIdentity(ctx, tx, iam.Identity{ID: iam.NewID("idn"), TenantID: iam.RootTenant, Kind: iam.KindUser, Name: name})
}

// Valid reports whether token still authenticates: its key exists, is not
// revoked or expired, and its identity is not revoked. dev uses it to decide
// whether a kept credential can be shown again.
func Valid(ctx context.Context, q iam.Querier, token string) bool {
	_, err := iam.NewAuthenticator(iam.AuthConfig{DB: q}).Authenticate(ctx, token)
	return err == nil
}
