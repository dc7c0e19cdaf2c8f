-- Site tasks (issue 16, DESIGN §13): how the control plane asks the site
-- agent holding a site's boot lease to act on a machine — read its BMC
-- (bmc.inspect), power it (bmc.power), set a one-time boot (bmc.boot), arm
-- or disarm its PXE answer (pxe.arm, pxe.disarm). The same pattern as node
-- commands: a durable row queued in the producer's transaction, delivered
-- by the gateway holding the lease holder's session (poked after commit,
-- and found by the gateway's resync without the bus), at most once per
-- attempt, its outcome stored.
--
-- payload is the kind's parameters as JSON and never holds a secret; a
-- secret (BMC credentials, a boot token) is in sealed, a JWE compact
-- serialization (ECDH-ES+A256KW, A256GCM; proto/credseal) to the public key
-- of the holder's session (site_agents.seal_key), whose kid is seal_kid.
-- A task sealed to a key that is no longer the holder's is not dispatched:
-- needs_reseal is set and the producer's "metal" job is woken to seal it
-- again (sitetasks.Reseal).
--
-- state: pending → in_flight → succeeded | failed, and pending or in_flight
-- → expired once not_after passes. attempts counts dispatches. A claim
-- records the holder (agent_id), its lease epoch (lease_epoch, the fencing
-- token) and its session's key id (session_kid); a result is stored only
-- from that agent, under that epoch and attempt, while it still holds the
-- lease. An in-flight task whose holder, epoch or session is no longer the
-- site's is dispatched again (a new attempt) to the session that is.
--
-- Retention: finished rows (succeeded, failed, expired) are pruned 7 days
-- after they finished (sitetasks.Prune, by the outbox relay's prune job);
-- a machine has a handful of tasks per step of its flow.
--
-- site_agents.seal_key is the agent's current session's public JWK, said in
-- SiteHello and replaced on every session.

-- +goose Up
CREATE TABLE site_tasks (
    id            text PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants (id),
    site_id       text NOT NULL REFERENCES sites (id) ON DELETE CASCADE,
    -- No foreign key: a task outlives nothing but names its machine.
    machine_id    text NOT NULL,
    kind          text NOT NULL CHECK (kind IN ('bmc.inspect', 'bmc.power', 'bmc.boot', 'pxe.arm', 'pxe.disarm')),
    payload       jsonb NOT NULL DEFAULT '{}',
    sealed        text NOT NULL DEFAULT '',
    seal_kid      text NOT NULL DEFAULT '',
    needs_reseal  boolean NOT NULL DEFAULT false,
    state         text NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'in_flight', 'succeeded', 'failed', 'expired')),
    attempts      integer NOT NULL DEFAULT 0,
    not_after     timestamptz NOT NULL,
    lease_epoch   bigint NOT NULL DEFAULT 0,
    agent_id      text NOT NULL DEFAULT '',
    session_kid   text NOT NULL DEFAULT '',
    result        jsonb,
    error         text NOT NULL DEFAULT '',
    created_at    timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz,
    finished_at   timestamptz,
    CHECK ((sealed = '') = (seal_kid = ''))
);
-- Due work per site: the claim and the resync read only unfinished rows.
CREATE INDEX site_tasks_due ON site_tasks (site_id, created_at) WHERE state IN ('pending', 'in_flight');
CREATE INDEX site_tasks_machine ON site_tasks (machine_id, created_at);
CREATE INDEX site_tasks_finished ON site_tasks (finished_at) WHERE finished_at IS NOT NULL;

ALTER TABLE site_agents ADD COLUMN seal_key text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE site_agents DROP COLUMN seal_key;
DROP TABLE site_tasks;
