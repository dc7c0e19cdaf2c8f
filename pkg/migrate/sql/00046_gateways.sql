-- Gateways' addresses (issue 30, docs/tunnels.md): each gateway writes the
-- host:port other control-plane processes reach it at (gateway.advertise)
-- when it starts, so an API process relays a tunnel to the gateway holding
-- the node (nodes.gateway_id) over internal mutual TLS. One row per gateway
-- id, replaced on every start; a gateway id no node names and no gateway
-- has written for 30 days is deleted (pkg/gateways.Prune).

-- +goose Up
CREATE TABLE gateways (
    id         text PRIMARY KEY,
    address    text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE gateways;
