-- IAM and admission: identities, API keys, policies, the authorization
-- projection, pools; audit and idempotency grow the columns admission needs.
--
-- Tenant ids are paths: a child of root is "acme", a child of acme is
-- "acme.ml". A tenant's ancestors are therefore known from its id alone, which
-- lets the API deny a caller outside a request's tenant before any query.

-- +goose Up
ALTER TABLE tenants ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';
ALTER TABLE tenants ADD CONSTRAINT tenants_id_is_path
    CHECK (parent_id IS NULL OR CASE
        WHEN parent_id = 'root' THEN position('.' IN id) = 0
        ELSE starts_with(id, parent_id || '.') AND position('.' IN substr(id, length(parent_id) + 2)) = 0
    END);

-- Users and service accounts. An identity belongs to one tenant; revoking it
-- (revoked_at) stops every key it holds.
CREATE TABLE identities (
    id         text PRIMARY KEY,
    tenant_id  text NOT NULL REFERENCES tenants (id),
    kind       text NOT NULL CHECK (kind IN ('user', 'service')),
    name       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    UNIQUE (tenant_id, name)
);

-- API keys bck_<id>.<secret>: only SHA-256 of the secret is kept.
CREATE TABLE api_keys (
    id          text PRIMARY KEY,
    identity_id text NOT NULL REFERENCES identities (id),
    tenant_id   text NOT NULL REFERENCES tenants (id),
    name        text NOT NULL DEFAULT '',
    secret_hash bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz,
    revoked_at  timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, id);
CREATE INDEX api_keys_identity ON api_keys (identity_id);

-- Cedar policies attached to a tenant. A decision on a resource evaluates the
-- policies of the resource's tenant and of every ancestor. version grows on
-- every put, so parsed policies can be cached by (tenant, name, version).
CREATE TABLE policies (
    tenant_id  text NOT NULL REFERENCES tenants (id),
    name       text NOT NULL,
    body       text NOT NULL,
    version    bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, name)
);

-- The authorization projection: what a decision needs to know about each
-- resource. Admission writes a draft row in its first transaction and makes it
-- live (draft = false) with the resource in its second. A tenant's own row has
-- tenant_id = its id, which does not exist yet while the row is a draft, so
-- tenant_id has no foreign key.
CREATE TABLE authz_projection (
    type       text NOT NULL,
    id         text NOT NULL,
    tenant_id  text NOT NULL,
    pool_id    text,
    labels     jsonb NOT NULL DEFAULT '{}',
    draft      boolean NOT NULL DEFAULT true,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (type, id)
);
CREATE INDEX authz_projection_tenant ON authz_projection (tenant_id, type);

-- Pools of capacity. class says what they hold.
CREATE TABLE pools (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    name        text NOT NULL,
    class       text NOT NULL CHECK (class IN ('gpu', 'vps-host', 'provider')),
    description text NOT NULL DEFAULT '',
    labels      jsonb NOT NULL DEFAULT '{}',
    generation  bigint NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);

-- Audit rows name the API method and the tenant of the caller as well.
ALTER TABLE audit ADD COLUMN method text NOT NULL DEFAULT '';
ALTER TABLE audit ADD COLUMN actor_tenant_id text NOT NULL DEFAULT '';
CREATE INDEX audit_tenant_id ON audit (tenant_id, id);

-- +goose Down
DROP INDEX audit_tenant_id;
ALTER TABLE audit DROP COLUMN actor_tenant_id;
ALTER TABLE audit DROP COLUMN method;
DROP TABLE pools;
DROP TABLE authz_projection;
DROP TABLE policies;
DROP TABLE api_keys;
DROP TABLE identities;
ALTER TABLE tenants DROP CONSTRAINT tenants_id_is_path;
ALTER TABLE tenants DROP COLUMN labels;
