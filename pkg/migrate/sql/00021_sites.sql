-- Sites (issue 16, DESIGN §13): a site is a place with machines that boot
-- over the network — a rack, a room, a data centre — served by site agents
-- (`bcd site`). Operators create a site, mint site tokens for it
-- ("bcst_<id>.<secret>", only SHA-256 of the secret stored, spent like join
-- tokens), and each `bcd site` that enrolls with one becomes a site agent
-- with a certificate of role site.
--
-- The boot lease: exactly one site agent per site serves PXE (proxy DHCP,
-- TFTP, iPXE scripts); it holds sites.boot_holder until boot_expires_at and
-- renews it. A standby takes the lease only once it has lapsed, and every
-- take bumps boot_epoch, the fencing token: a write on behalf of the site's
-- boot server names the epoch it holds and is refused when it is stale, so
-- an agent that was paused past its lease changes nothing when it resumes.
--
-- Sites and site agents are few (one row each per site and per agent), so
-- they need no retention; site_tokens grow with every token minted and are
-- pruned 30 days after they expire or are revoked (sites.prune, the same
-- cadence as join tokens').

-- +goose Up
CREATE TABLE sites (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants (id),
    name            text NOT NULL,
    description     text NOT NULL DEFAULT '',
    labels          jsonb NOT NULL DEFAULT '{}',
    generation      bigint NOT NULL DEFAULT 1,
    boot_holder     text,
    boot_epoch      bigint NOT NULL DEFAULT 0,
    boot_expires_at timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);
CREATE INDEX sites_tenant ON sites (tenant_id, id);

CREATE TABLE site_tokens (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    site_id     text NOT NULL REFERENCES sites (id) ON DELETE CASCADE,
    name        text NOT NULL DEFAULT '',
    secret_hash bytea NOT NULL,
    uses        integer NOT NULL CHECK (uses > 0),
    uses_left   integer NOT NULL CHECK (uses_left >= 0 AND uses_left <= uses),
    created_by  text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    revoked_at  timestamptz
);
CREATE INDEX site_tokens_site ON site_tokens (tenant_id, site_id, id);

CREATE TABLE site_agents (
    id           text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants (id),
    site_id      text NOT NULL REFERENCES sites (id) ON DELETE CASCADE,
    token_id     text REFERENCES site_tokens (id) ON DELETE SET NULL,
    hostname     text NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz,
    revoked_at   timestamptz
);
CREATE INDEX site_agents_site ON site_agents (site_id, id);

-- +goose Down
DROP TABLE site_agents;
DROP TABLE site_tokens;
DROP TABLE sites;
