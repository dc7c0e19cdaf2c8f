-- Site agent certificates (issue 16, DESIGN §13): every certificate the node
-- CA issues to a site agent (`bcd site`, SPIFFE ID
-- spiffe://<trust domain>/site/<site id>/agent/<agent id>), by serial
-- (lowercase hex), so gateways and Renew refuse an unrecorded or revoked one
-- exactly as they do node certificates (node_certificates, 00004).
-- Revoking a site agent (sites.revokeAgent) revokes its certificates.
--
-- Retention: an agent renews a 24 h certificate a few times a day, so the
-- table grows by a few rows per agent per day. Rows whose certificate
-- expired more than events.certificateGrace ago are pruned with nodes'
-- (nodeca.PruneExpired, run by the outbox relay's prune job): an expired
-- certificate fails verification whatever its row says. Deleting the agent
-- deletes its rows.

-- +goose Up
CREATE TABLE site_agent_certificates (
    serial     text PRIMARY KEY,
    agent_id   text NOT NULL REFERENCES site_agents (id) ON DELETE CASCADE,
    not_before timestamptz NOT NULL,
    not_after  timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX site_agent_certificates_agent ON site_agent_certificates (agent_id);
CREATE INDEX site_agent_certificates_not_after ON site_agent_certificates (not_after);

-- +goose Down
DROP TABLE site_agent_certificates;
