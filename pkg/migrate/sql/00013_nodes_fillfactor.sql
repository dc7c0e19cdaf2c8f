-- Room on every page of nodes for updated rows.
--
-- A node's row is rewritten whenever it is seen (liveness, one statement
-- per gateway every interval), reports convergence or gets a new spec:
-- 10,000 nodes rewrite 10,000 rows every few seconds. None of those
-- columns is indexed, so each update can be HOT — the new version on the
-- same page, no index entries, pruned without a vacuum — but only when the
-- page has room. With the default fillfactor (100) a page is full after
-- the first insert and every update moves the row and adds an entry to
-- each of the table's indexes, which only a vacuum removes (autovacuum may
-- be off). The setting applies to pages written from now on; a table
-- rewrite (VACUUM FULL, pg_repack) applies it to existing ones.

-- +goose Up
ALTER TABLE nodes SET (fillfactor = 50);

-- +goose Down
ALTER TABLE nodes RESET (fillfactor);
