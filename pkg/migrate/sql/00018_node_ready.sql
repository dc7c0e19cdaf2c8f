-- The Ready condition of a node, in columns of its own.
--
-- The liveness job (services/lifecycle) owns Ready: True while a gateway
-- heard from the node within nodes.notReadyAfter, Unknown after that, Lost
-- after nodes.lostAfter. It is three-valued, unlike the inventory
-- controller's boolean conditions in nodes.conditions, which that
-- controller rewrites whole on every report; columns of its own keep the
-- two writers from overwriting each other without a jsonb merge in either.
-- None of them is indexed, so the liveness job's updates stay HOT like the
-- gateways' last_seen_at writes (00013).

-- +goose Up
ALTER TABLE nodes
    ADD COLUMN ready        text        NOT NULL DEFAULT 'True' CHECK (ready IN ('True', 'Unknown', 'Lost')),
    ADD COLUMN ready_reason text        NOT NULL DEFAULT '',
    ADD COLUMN ready_since  timestamptz NOT NULL DEFAULT now();

-- +goose Down
ALTER TABLE nodes DROP COLUMN ready, DROP COLUMN ready_reason, DROP COLUMN ready_since;
