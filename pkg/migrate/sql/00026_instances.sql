-- VPS instances (issue 17, DESIGN §14): hosted pools (class 'vps-host')
-- place vCPU, memory, disk and GPUs of their hosts; an instance is desired
-- state of the host it is placed on.
--
-- The guarantee: no host is ever oversubscribed in any dimension. Each host
-- of a vps-host pool has one host_capacity row with its totals (what the
-- host has, minus the pool's reserve) and what the instances placed on it
-- use. Placement, resize and delete change the used counters in the same
-- transaction as the instance, and the CHECK constraints below make a used
-- counter above its total impossible, whatever the code above them does:
-- two concurrent creates that both fit alone but not together serialize on
-- the row, and the second one's update would violate the constraint. GPUs
-- are claimed per device in instance_gpus, whose partial unique index holds
-- at most one active claim per (node, device), like bookings_active_atom.

-- +goose Up

-- A pool's VPS settings (pools.update "vps"): the reserve every host keeps
-- for itself, and the host size to assume where a node's inventory does not
-- report it (the inventory's host.cpuCount, host.memoryBytes and
-- host.diskBytes win when present).
CREATE TABLE vps_pool_settings (
    pool_id            text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    host_vcpus         integer NOT NULL DEFAULT 0 CHECK (host_vcpus >= 0),
    host_memory_mib    bigint  NOT NULL DEFAULT 0 CHECK (host_memory_mib >= 0),
    host_disk_gib      bigint  NOT NULL DEFAULT 0 CHECK (host_disk_gib >= 0),
    reserve_vcpus      integer NOT NULL DEFAULT 0 CHECK (reserve_vcpus >= 0),
    reserve_memory_mib bigint  NOT NULL DEFAULT 0 CHECK (reserve_memory_mib >= 0),
    reserve_disk_gib   bigint  NOT NULL DEFAULT 0 CHECK (reserve_disk_gib >= 0),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

-- One row per node of a vps-host pool. A total that shrinks below what is
-- in use is kept at the used amount (the host takes nothing more).
CREATE TABLE host_capacity (
    node_id          text PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    pool_id          text NOT NULL REFERENCES pools (id),
    vcpus_total      integer NOT NULL,
    memory_mib_total bigint  NOT NULL,
    disk_gib_total   bigint  NOT NULL,
    vcpus_used       integer NOT NULL DEFAULT 0,
    memory_mib_used  bigint  NOT NULL DEFAULT 0,
    disk_gib_used    bigint  NOT NULL DEFAULT 0,
    -- How many instances hold capacity here: a host with any is partially
    -- used, and packing fills it first.
    instances        integer NOT NULL DEFAULT 0 CHECK (instances >= 0),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT host_capacity_vcpus  CHECK (vcpus_used >= 0 AND vcpus_used <= vcpus_total),
    CONSTRAINT host_capacity_memory CHECK (memory_mib_used >= 0 AND memory_mib_used <= memory_mib_total),
    CONSTRAINT host_capacity_disk   CHECK (disk_gib_used >= 0 AND disk_gib_used <= disk_gib_total)
);
CREATE INDEX host_capacity_pool ON host_capacity (pool_id);

CREATE TABLE instances (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL REFERENCES tenants (id),
    pool_id             text NOT NULL REFERENCES pools (id),
    -- The host it is placed on; NULL before placement and in provider pools.
    node_id             text REFERENCES nodes (id),
    vcpus               integer NOT NULL CHECK (vcpus BETWEEN 1 AND 1024),
    memory_mib          bigint  NOT NULL CHECK (memory_mib BETWEEN 1 AND 16777216),
    disk_gib            bigint  NOT NULL CHECK (disk_gib BETWEEN 1 AND 65536),
    gpu_count           integer NOT NULL DEFAULT 0 CHECK (gpu_count BETWEEN 0 AND 16),
    gpu_model           text NOT NULL DEFAULT '',
    image               text NOT NULL,
    ssh_keys            text[] NOT NULL DEFAULT '{}',
    user_data           text NOT NULL DEFAULT '' CHECK (octet_length(user_data) <= 65536),
    -- Desired power state.
    power               text NOT NULL DEFAULT 'running' CHECK (power IN ('running', 'stopped')),
    state               text NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'placed', 'running', 'stopped', 'failed', 'deleting', 'deleted')),
    reason              text NOT NULL DEFAULT '',
    -- Bumped by every change of desired state (power, size, presence).
    generation          bigint NOT NULL DEFAULT 1,
    -- What the host (or the provider) last reported.
    observed_generation bigint NOT NULL DEFAULT 0,
    observed_state      text NOT NULL DEFAULT '',
    observed_reason     text NOT NULL DEFAULT '',
    observed_at         timestamptz,
    provider_machine_id text NOT NULL DEFAULT '',
    -- The caller's idempotency key of the create (admission keeps the
    -- replay; the provider workflow keys its calls by id).
    idempotency_key     text NOT NULL DEFAULT '',
    -- Instance-hours of held capacity per dimension, accrued up to
    -- accrued_at (pkg/instances.Accrue).
    vcpu_hours          double precision NOT NULL DEFAULT 0,
    memory_mib_hours    double precision NOT NULL DEFAULT 0,
    disk_gib_hours      double precision NOT NULL DEFAULT 0,
    gpu_hours           double precision NOT NULL DEFAULT 0,
    accrued_at          timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    placed_at           timestamptz,
    deleted_at          timestamptz
);
CREATE INDEX instances_tenant ON instances (tenant_id, created_at DESC, id DESC);
CREATE INDEX instances_node ON instances (node_id) WHERE state NOT IN ('deleting', 'deleted');
CREATE INDEX instances_live_pool ON instances (pool_id, tenant_id) WHERE state NOT IN ('deleting', 'deleted');
CREATE INDEX instances_deleted ON instances (deleted_at) WHERE state = 'deleted';

-- The GPUs an instance holds, by device (passed through by PCI address).
CREATE TABLE instance_gpus (
    instance_id text NOT NULL REFERENCES instances (id) ON DELETE CASCADE,
    node_id     text NOT NULL REFERENCES nodes (id),
    device_id   text NOT NULL,
    model       text NOT NULL DEFAULT '',
    pci_bus_id  text NOT NULL DEFAULT '',
    active      boolean NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz,
    PRIMARY KEY (instance_id, node_id, device_id)
);
-- The guarantee for GPUs: a device has at most one active claim.
CREATE UNIQUE INDEX instance_gpus_active_device ON instance_gpus (node_id, device_id) WHERE active;

-- Quotas on instances: per tenant (with its descendants) and pool, at most
-- this much held at once in each dimension; NULL is no limit.
CREATE TABLE instance_quotas (
    pool_id    text NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    tenant_id  text NOT NULL REFERENCES tenants (id),
    vcpus      bigint CHECK (vcpus >= 0),
    memory_mib bigint CHECK (memory_mib >= 0),
    disk_gib   bigint CHECK (disk_gib >= 0),
    gpus       bigint CHECK (gpus >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool_id, tenant_id)
);

-- +goose Down
DROP TABLE instance_quotas;
DROP TABLE instance_gpus;
DROP TABLE instances;
DROP TABLE host_capacity;
DROP TABLE vps_pool_settings;
