-- BMC credentials and certificates (issue 26 items 2 and 3).
--
-- secrets.bound_to is what a secret may be sent to: for a 'bmc' secret,
-- the normalized BMC address (https://host[:port]) it was created for. A
-- machine naming the secret must have that address (metal.enroll refuses
-- another; the workflow refuses to open it for another). Existing BMC
-- secrets are bound to the address of the machines using them when they
-- all agree; a secret shared by machines with different addresses stays
-- unbound ('') and can no longer be named by a new enrollment.
--
-- machines: (site_id, bmc_address) is unique (the same BMC enrolled twice
-- is two records of one server, which commissioning would wipe). A
-- database holding such duplicates refuses this migration, naming them:
-- delete the extra machines first.
--
-- bmc_ca_pem pins the BMC's CA; bmc_certificate_sha256 pins its
-- certificate (given at enrollment, or trusted on first use: the one the
-- first BMC task saw); bmc_insecure skips verification (an explicit
-- opt-in). Existing machines verify from now on: their next BMC task pins
-- the certificate it sees.

-- +goose Up
ALTER TABLE secrets ADD COLUMN bound_to text NOT NULL DEFAULT '';
UPDATE secrets s SET bound_to = coalesce((
    SELECT min(m.bmc_address) FROM machines m WHERE m.bmc_credentials_ref = s.id
    HAVING count(DISTINCT m.bmc_address) = 1), '')
 WHERE s.kind = 'bmc';

-- +goose StatementBegin
DO $$
DECLARE dup text;
BEGIN
    SELECT string_agg(site_id || ' ' || bmc_address || ': ' || ids, '; ') INTO dup FROM (
        SELECT site_id, bmc_address, string_agg(id, ', ' ORDER BY id) AS ids FROM machines
         GROUP BY site_id, bmc_address HAVING count(*) > 1) d;
    IF dup IS NOT NULL THEN
        RAISE EXCEPTION 'machines enrolled twice with one BMC address (delete the extra ones first): %', dup;
    END IF;
END $$;
-- +goose StatementEnd
CREATE UNIQUE INDEX machines_site_bmc_address ON machines (site_id, bmc_address);

ALTER TABLE machines
    ADD COLUMN bmc_ca_pem             text NOT NULL DEFAULT '' CHECK (length(bmc_ca_pem) <= 65536),
    ADD COLUMN bmc_certificate_sha256 text NOT NULL DEFAULT '' CHECK (bmc_certificate_sha256 ~ '^([0-9a-f]{64})?$'),
    ADD COLUMN bmc_insecure           boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT machines_bmc_insecure_alone CHECK (NOT bmc_insecure OR (bmc_ca_pem = '' AND bmc_certificate_sha256 = ''));

-- +goose Down
ALTER TABLE machines DROP CONSTRAINT machines_bmc_insecure_alone;
ALTER TABLE machines DROP COLUMN bmc_insecure, DROP COLUMN bmc_certificate_sha256, DROP COLUMN bmc_ca_pem;
DROP INDEX machines_site_bmc_address;
ALTER TABLE secrets DROP COLUMN bound_to;
