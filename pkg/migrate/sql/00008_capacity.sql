-- Capacity: reservations of GPUs, the bookings that hold their atoms, the
-- quotas that bound them, and the capacity rollup.
--
-- A booking is (reservation, node, device): one bookable atom (a whole GPU
-- today; a MIG slice once the mig section exists, with device_id naming the
-- slice). An active booking holds its atom; the partial unique index
-- bookings_active_atom makes a second active booking of the same atom
-- impossible, whatever the code above it does. A finished booking stays, with
-- active false, for usage and history.

-- +goose Up
CREATE TABLE reservations (
    id               text PRIMARY KEY,
    tenant_id        text NOT NULL REFERENCES tenants (id),
    pool_id          text NOT NULL REFERENCES pools (id),
    gpu_count        integer NOT NULL CHECK (gpu_count BETWEEN 1 AND 1024),
    model            text NOT NULL DEFAULT '',
    min_memory_bytes bigint NOT NULL DEFAULT 0,
    same_node        boolean NOT NULL DEFAULT false,
    node_labels      jsonb NOT NULL DEFAULT '{}',
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'placed', 'bound', 'released', 'expired', 'failed')),
    -- Why it is pending or failed.
    reason           text NOT NULL DEFAULT '',
    start_time       timestamptz,
    end_time         timestamptz CHECK (end_time IS NULL OR start_time IS NULL OR end_time > start_time),
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    bound_at         timestamptz,
    finished_at      timestamptz,
    -- GPU-hours used, as capacity.usage last computed them.
    gpu_hours        double precision NOT NULL DEFAULT 0
);
CREATE INDEX reservations_tenant ON reservations (tenant_id, created_at DESC, id DESC);
CREATE INDEX reservations_live ON reservations (pool_id, state) WHERE state IN ('pending', 'placed', 'bound');

CREATE TABLE bookings (
    reservation_id text NOT NULL REFERENCES reservations (id),
    node_id        text NOT NULL REFERENCES nodes (id),
    device_id      text NOT NULL,
    model          text NOT NULL DEFAULT '',
    tenant_id      text NOT NULL,
    pool_id        text NOT NULL,
    active         boolean NOT NULL DEFAULT true,
    created_at     timestamptz NOT NULL DEFAULT now(),
    released_at    timestamptz,
    PRIMARY KEY (reservation_id, node_id, device_id)
);
-- The guarantee: an atom has at most one active booking.
CREATE UNIQUE INDEX bookings_active_atom ON bookings (node_id, device_id) WHERE active;
CREATE INDEX bookings_active_pool ON bookings (pool_id, tenant_id) WHERE active;

-- Quotas: at most gpu_limit GPUs (of model, or all when '') booked at once
-- in pool by tenant and its descendants.
CREATE TABLE quotas (
    pool_id    text NOT NULL REFERENCES pools (id),
    tenant_id  text NOT NULL REFERENCES tenants (id),
    model      text NOT NULL DEFAULT '',
    gpu_limit  integer NOT NULL CHECK (gpu_limit >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool_id, tenant_id, model)
);

-- The capacity.rollup reconciler's last count per pool and model ('' is the
-- whole pool), and per pool and tenant.
CREATE TABLE capacity_rollup (
    pool_id     text NOT NULL REFERENCES pools (id),
    model       text NOT NULL,
    free        integer NOT NULL,
    booked      integer NOT NULL,
    unavailable integer NOT NULL,
    computed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool_id, model)
);
CREATE TABLE capacity_tenant_usage (
    pool_id     text NOT NULL REFERENCES pools (id),
    tenant_id   text NOT NULL,
    booked      integer NOT NULL,
    gpu_hours   double precision NOT NULL,
    computed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool_id, tenant_id)
);

-- +goose Down
DROP TABLE capacity_tenant_usage;
DROP TABLE capacity_rollup;
DROP TABLE quotas;
DROP TABLE bookings;
DROP TABLE reservations;
