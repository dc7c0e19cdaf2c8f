-- Pools are shared with the tenant's descendants only when they say so.
--
-- Until now any tenant could book a gpu pool of any ancestor, root's
-- included, bounded only by quotas someone had set (security review,
-- finding #8). sharing 'none' (the default) keeps a pool to its own tenant;
-- 'descendants' lets the tenants below book it, each child tenant of the
-- pool's tenant (with its descendants) under its own quota for every model
-- or, without one, default_quota GPUs (0: none).
--
-- Existing pools where the owner already granted a descendant a quota are
-- shared, so those grants keep working; every other pool is closed to
-- descendants. Bookings already held stay.

-- +goose Up
ALTER TABLE pools
    ADD COLUMN sharing       text    NOT NULL DEFAULT 'none' CHECK (sharing IN ('none', 'descendants')),
    ADD COLUMN default_quota integer NOT NULL DEFAULT 0 CHECK (default_quota >= 0);

UPDATE pools p SET sharing = 'descendants'
 WHERE EXISTS (SELECT 1 FROM quotas q WHERE q.pool_id = p.id AND q.tenant_id <> p.tenant_id);

-- +goose Down
ALTER TABLE pools DROP COLUMN sharing, DROP COLUMN default_quota;
