-- Machines (issue 16, DESIGN §13): a bare-metal server of a site, taken
-- from its first PXE boot to a node by the metal workflow (services/metal).
--
-- state is the flow's step: enrolled → inspecting → booting-ramdisk →
-- diagnosing → wiping → ready; metal.deploy: deploying → rebooting →
-- joined; metal.release: (wiping again) → ready; failed (failed_step and
-- failed_reason say where and why; metal.retry resumes at failed_step);
-- rescue (the ramdisk booted for a human, metal.rescue). step_attempts
-- counts tries of the current step, step_deadline is when the current try
-- times out; both reset when the state changes.
--
-- boot is what the site's boot server does when the machine PXE-boots:
-- 'none' (ignore it), 'ramdisk' (boot bcd ramdisk with a one-time boot
-- token) or 'local' (boot its disk). The site agent holding the boot lease
-- is told through site tasks (pxe arming carries the boot token sealed to
-- it). join_token_id is the single-use join token the flow minted last:
-- the ramdisk's boot token, or the one written into cloud-init for the
-- installed system; each names node_id, so both join as that node.
--
-- node_id is reserved at enrollment ("node_…"): the ramdisk and, after a
-- deploy, the installed system join as that node, so the machine keeps its
-- node id across commissioning, deploys and releases.
--
-- BMC credentials are never in this table: bmc_credentials_ref names a row
-- of secrets, whose payload is encrypted at rest (AES-256-GCM, pkg/secrets,
-- with a key only the api and metal processes hold).
--
-- Machines are few (one row per server, deleted with the server); secrets
-- are deleted when the last machine naming them is.

-- +goose Up
CREATE TABLE secrets (
    id         text PRIMARY KEY,
    tenant_id  text NOT NULL REFERENCES tenants (id),
    kind       text NOT NULL CHECK (kind IN ('bmc')),
    -- The key that sealed it (pkg/secrets key id), so keys can rotate.
    key_id     text NOT NULL,
    nonce      bytea NOT NULL,
    ciphertext bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX secrets_tenant ON secrets (tenant_id, id);

CREATE TABLE machines (
    id                    text PRIMARY KEY,
    tenant_id             text NOT NULL REFERENCES tenants (id),
    site_id               text NOT NULL REFERENCES sites (id),
    pool_id               text NOT NULL REFERENCES pools (id),
    name                  text NOT NULL,
    labels                jsonb NOT NULL DEFAULT '{}',
    bmc_address           text NOT NULL,
    bmc_credentials_ref   text NOT NULL REFERENCES secrets (id),
    state                 text NOT NULL DEFAULT 'enrolled'
                          CHECK (state IN ('enrolled', 'inspecting', 'booting-ramdisk', 'diagnosing', 'wiping', 'ready',
                                           'deploying', 'rebooting', 'joined', 'failed', 'rescue')),
    -- What the flow was doing before a deploy or release sent it back into
    -- the ramdisk: 'commission', 'deploy' or 'release'.
    purpose               text NOT NULL DEFAULT 'commission' CHECK (purpose IN ('commission', 'deploy', 'release', 'rescue')),
    step_attempts         integer NOT NULL DEFAULT 0,
    step_started_at       timestamptz NOT NULL DEFAULT now(),
    step_deadline         timestamptz,
    failed_step           text NOT NULL DEFAULT '',
    failed_reason         text NOT NULL DEFAULT '',
    -- What Redfish inspection found (processors, memory, NICs, disks).
    inventory             jsonb NOT NULL DEFAULT '{}',
    -- Its NICs' MAC addresses, lower case, from the inventory.
    macs                  text[] NOT NULL DEFAULT '{}',
    boot                  text NOT NULL DEFAULT 'none' CHECK (boot IN ('none', 'ramdisk', 'local')),
    join_token_id         text,
    node_id               text NOT NULL UNIQUE,
    -- metal.deploy's image {url, sha256, sizeBytes} and cloud-init user data.
    image                 jsonb,
    cloud_init            text NOT NULL DEFAULT '',
    -- Grows on every change of what the site's boot server must do for it.
    generation            bigint NOT NULL DEFAULT 1,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);
CREATE INDEX machines_tenant ON machines (tenant_id, id);
CREATE INDEX machines_site ON machines (site_id, id);
-- Deleting a machine counts the others naming its secret.
CREATE INDEX machines_credentials ON machines (bmc_credentials_ref);

-- +goose Down
DROP TABLE machines;
DROP TABLE secrets;
