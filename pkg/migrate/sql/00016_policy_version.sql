-- A per-tenant policy version, so an authorizer can cache a tenant's compiled
-- policies and learn that they changed with one indexed read of the tenants
-- it decides on (pkg/authz, docs/security.md "Policy evaluation cost").
-- policies.put and policies.delete bump it in their transaction; the bump also
-- locks the tenant's row, which serializes a tenant's policy writes so the
-- per-tenant policy count cap cannot be raced past.

-- +goose Up
ALTER TABLE tenants ADD COLUMN policy_version bigint NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE tenants DROP COLUMN policy_version;
