-- nodes.clearRepair's own budget (issue 26 item 7): each clear is a row
-- here, and a node may be cleared at most health.maxRepairClearsPerNode
-- times in 7 days (RATE_LIMITED naming the node). A clear resets the
-- node's remediation budget (remediations.cleared_at) but never this one:
-- nothing updates or deletes these rows but the retention (health.prune,
-- 30 days, like remediations) and the node's deletion.
--
-- The brakes table needs no change for the rest of item 7: its scopes now
-- also hold a token bucket per tenant ('rate:<tenant>', deleted once full
-- again) and a gateway's breakers per tenant ('gateway:<id>/tenant:<t>');
-- rows of the old 'gateway:<id>' scopes close and go on the next liveness
-- pass.

-- +goose Up
CREATE TABLE repair_clears (
    node_id    text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    tenant_id  text NOT NULL REFERENCES tenants (id),
    cleared_at timestamptz NOT NULL
);
CREATE INDEX repair_clears_node ON repair_clears (node_id, cleared_at);
CREATE INDEX repair_clears_at ON repair_clears (cleared_at);

-- +goose Down
DROP TABLE repair_clears;
