-- The ramdisk (issue 16, DESIGN §13): `bcd ramdisk` joins a machine in
-- commissioning as the node its machine reserved, with a restricted
-- certificate, and signs every result with that certificate's key.
--
-- join_tokens.node_id names the node a join with the token creates, or
-- takes back when it exists (its old certificates revoked): the metal
-- workflow mints the ramdisk's boot token and the installed system's token
-- naming machines.node_id, so a machine keeps its node id. role says what
-- the token makes: 'node' (bcd join) or 'ramdisk' (bcd ramdisk, which needs
-- a named node).
--
-- A node joined by a ramdisk is 'commissioning': never adopted, never
-- placed (placement books adopted nodes only), until the installed system
-- joins with a node token naming it and it is adopting again.
--
-- node_certificates.role is 'ramdisk' for the ramdisk's certificates (valid
-- at most 2 h, never renewed; the gateway sends their sessions only the
-- flow's commands) and public_key the leaf's key (PKIX DER), so a result's
-- signature is checked against the key the control plane certified, not
-- one the report names.
--
-- commands.node_signature is the node's signature over the final update
-- (proto/resultsig) with the outcome and reason it signed, as JSON; NULL
-- when the update was unsigned.

-- +goose Up
ALTER TABLE join_tokens
    ADD COLUMN node_id text,
    ADD COLUMN role    text NOT NULL DEFAULT 'node' CHECK (role IN ('node', 'ramdisk'));
ALTER TABLE join_tokens ADD CONSTRAINT join_tokens_ramdisk_names_node CHECK (role = 'node' OR node_id IS NOT NULL);

ALTER TABLE nodes DROP CONSTRAINT nodes_state_check;
ALTER TABLE nodes ADD CONSTRAINT nodes_state_check
    CHECK (state IN ('adopting', 'adopted', 'draining', 'drained', 'failed', 'retired', 'commissioning'));

ALTER TABLE node_certificates
    ADD COLUMN role       text NOT NULL DEFAULT 'node' CHECK (role IN ('node', 'ramdisk')),
    ADD COLUMN public_key bytea;

ALTER TABLE commands ADD COLUMN node_signature jsonb;

-- +goose Down
ALTER TABLE commands DROP COLUMN node_signature;
ALTER TABLE node_certificates DROP COLUMN role, DROP COLUMN public_key;
UPDATE nodes SET state = 'failed' WHERE state = 'commissioning';
ALTER TABLE nodes DROP CONSTRAINT nodes_state_check;
ALTER TABLE nodes ADD CONSTRAINT nodes_state_check
    CHECK (state IN ('adopting', 'adopted', 'draining', 'drained', 'failed', 'retired'));
ALTER TABLE join_tokens DROP CONSTRAINT join_tokens_ramdisk_names_node;
ALTER TABLE join_tokens DROP COLUMN node_id, DROP COLUMN role;
