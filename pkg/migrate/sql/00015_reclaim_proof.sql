-- Reclaims must be proven, and hardware keys are unique per tenant.
--
-- A join token that allows reclaim names the nodes it may take back
-- (reclaim_node_ids): hardware claims (serials, GPU UUIDs) are
-- self-asserted and readable through nodes.get, so a bare "reclaim" token
-- let anyone holding one take over any node of its tenant that they could
-- describe, revoking the real node's certificates.
--
-- Hardware keys were unique across all tenants, so one tenant could block
-- another's join by joining first with the other's claims. They are unique
-- per tenant now; the same hardware in two tenants is an operator-visible
-- conflict (the node.hardware_conflict event in the root tenant), not a
-- silent block.

-- +goose Up
ALTER TABLE join_tokens ADD COLUMN reclaim_node_ids text[] NOT NULL DEFAULT '{}';
ALTER TABLE nodes DROP CONSTRAINT nodes_hardware_key_key;
ALTER TABLE nodes ADD CONSTRAINT nodes_tenant_hardware_key UNIQUE (tenant_id, hardware_key);
CREATE INDEX nodes_hardware_key ON nodes (hardware_key);

-- +goose Down
DROP INDEX nodes_hardware_key;
ALTER TABLE nodes DROP CONSTRAINT nodes_tenant_hardware_key;
ALTER TABLE nodes ADD CONSTRAINT nodes_hardware_key_key UNIQUE (hardware_key);
ALTER TABLE join_tokens DROP COLUMN reclaim_node_ids;
