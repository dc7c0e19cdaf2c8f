-- The reconciler runtime's claim bookkeeping.
--
-- A worker claims due work_queue rows in the shards whose leases it holds by
-- stamping them with its id, the lease's fence and a claim deadline. A claim
-- is honoured only while it is younger than claimed_until and was made under
-- the shard's current fence, so a new owner reclaims a dead owner's rows at
-- once, and a crashed worker's claims lapse on their own.

-- +goose Up
ALTER TABLE work_queue
    ADD COLUMN claimed_by    text,
    ADD COLUMN claim_fence   bigint,
    ADD COLUMN claimed_until timestamptz,
    ADD COLUMN last_run_at   timestamptz;

-- Claims reach due rows shard by shard through work_queue_ready (shard,
-- run_after, from 00001); settles go through the primary key (kind, key).
-- Keep kind off the front of any other index: on a small, freshly churned,
-- unanalysed queue the planner picks such an index for claims and settles and
-- scans a whole kind per lease or per key (50x slower, measured).

-- A queue table churns: leave room on each page for HOT updates (claims and
-- settles change no indexed column) and vacuum and analyse it early.
ALTER TABLE work_queue SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02,
                            autovacuum_analyze_scale_factor = 0.02);

-- +goose Down
ALTER TABLE work_queue RESET (fillfactor, autovacuum_vacuum_scale_factor, autovacuum_analyze_scale_factor);
ALTER TABLE work_queue
    DROP COLUMN claimed_by,
    DROP COLUMN claim_fence,
    DROP COLUMN claimed_until,
    DROP COLUMN last_run_at;
