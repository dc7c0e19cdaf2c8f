-- The work queue's primary key leads with key, not kind.
--
-- With (kind, key), the planner could AND the claim's (shard, run_after)
-- index with the primary key's kind prefix. Once a kind had churned through
-- some 30,000 keys — deleted rows whose index entries stay until a vacuum,
-- and autovacuum may be off — that bitmap read every entry of the kind, dead
-- or alive, for each of the 256 shards a claim probes: claims went from
-- 0.5 ms to 470 ms and throughput fell by an order of magnitude (measured,
-- pkg/reconcile BenchmarkThroughput). Nothing filters on kind alone; every
-- settle names both columns, and ON CONFLICT (kind, key) infers this index
-- whatever its column order.

-- +goose Up
ALTER TABLE work_queue DROP CONSTRAINT work_queue_pkey;
ALTER TABLE work_queue ADD CONSTRAINT work_queue_pkey PRIMARY KEY (key, kind);

-- +goose Down
ALTER TABLE work_queue DROP CONSTRAINT work_queue_pkey;
ALTER TABLE work_queue ADD CONSTRAINT work_queue_pkey PRIMARY KEY (kind, key);
