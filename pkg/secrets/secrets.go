// Package secrets stores secrets encrypted at rest (table secrets, migration
// 00023): today the BMC credentials of bare-metal machines.
//
// A secret's payload is sealed with AES-256-GCM under the sealing key of a
// [Keyring], with its tenant, id and kind as additional data, so a row
// copied onto another secret, or changed in any byte, does not open. The
// row keeps the id of the key that sealed it (hex of the first 8 bytes of
// the key's SHA-256): a keyring of the new key followed by the old ones
// seals with the new key and still opens what the old ones sealed, and
// [Reseal] moves old rows to the new key. The keyring is loaded from
// secrets.keyFile (32 bytes); only the processes that must open secrets
// (api, metal) hold it.
//
// Plaintext never leaves this package except as the return value of
// [Open]; [BMCCredentials] redacts its password from every string and log
// form.
package secrets

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Kind says what a secret holds.
type Kind string

// KindBMC is a machine's BMC credentials ([BMCCredentials] as JSON).
const KindBMC Kind = "bmc"

// KindProvider is a provider pool's API credentials
// (pkg/providers.Credentials as JSON, migration 00027).
const KindProvider Kind = "provider"

// MaxPlainBytes bounds a secret's payload.
const MaxPlainBytes = 16 << 10

// ErrNotFound is in the chain of the NOT_FOUND error of a secret that does
// not exist in the tenant.
var ErrNotFound = errors.New("secret not found")

// Secret is a secret to store: its payload in the clear.
type Secret struct {
	// ID is "sec_…" ([NewID]).
	ID       string
	TenantID string
	Kind     Kind
	// BoundTo is what the secret may be sent to: for a [KindBMC] secret,
	// the BMC address it was created for ("" for none). Users of the
	// secret check it ([Meta.BoundTo]) before naming or opening it.
	BoundTo string
	// Plain is the payload, sealed before it is stored.
	Plain []byte
}

// Meta is what may be known about a stored secret without opening it.
type Meta struct {
	ID       string
	TenantID string
	Kind     Kind
	KeyID    string
	// BoundTo is [Secret.BoundTo].
	BoundTo   string
	CreatedAt time.Time
}

// NewID returns a new secret id, "sec_…".
func NewID() string { return "sec_" + secret.Random(10) }

func notFound(tenant, id string) error {
	return fault.Wrap(ErrNotFound, fault.NotFound, "secretId", "secret %q not found in tenant %s", id, tenant)
}

// Put seals s.Plain with kr and stores it as a new secret. An id already
// used is CONFLICT on "secretId".
func Put(ctx context.Context, q Querier, kr *Keyring, s Secret) error {
	switch {
	case kr == nil:
		return fault.New(fault.Unsupported, ConfigField, "no secrets key is configured: set %s", ConfigField)
	case s.ID == "" || s.TenantID == "":
		return errors.New("put secret: id and tenant are required")
	case s.Kind != KindBMC && s.Kind != KindProvider:
		return fmt.Errorf("put secret %s: unknown kind %q", s.ID, s.Kind)
	case len(s.Plain) > MaxPlainBytes:
		return fault.New(fault.InvalidInput, "secret", "at most %d bytes", MaxPlainBytes)
	}
	keyID, nonce, ct := kr.seal(s.TenantID, s.ID, s.Kind, s.Plain)
	_, err := q.Exec(ctx, `INSERT INTO secrets (id, tenant_id, kind, key_id, nonce, ciphertext, bound_to) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		s.ID, s.TenantID, string(s.Kind), keyID, nonce, ct, s.BoundTo)
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23505" {
		return fault.New(fault.Conflict, "secretId", "secret %s already exists", s.ID)
	}
	if err != nil {
		return fmt.Errorf("insert secret %s: %w", s.ID, err)
	}
	return nil
}

// Open reads secret id of tenant and returns its payload. A secret that
// does not exist in the tenant is NOT_FOUND on "secretId" (with
// [ErrNotFound] in its chain); one sealed by a key kr lacks wraps
// [ErrUnknownKey]; one that does not open wraps [ErrTampered]. The payload
// is the caller's: never log it.
func Open(ctx context.Context, q Querier, kr *Keyring, tenant, id string) ([]byte, error) {
	if kr == nil {
		return nil, fault.New(fault.Unsupported, ConfigField, "no secrets key is configured: set %s", ConfigField)
	}
	var (
		kind, keyID       string
		nonce, ciphertext []byte
	)
	err := q.QueryRow(ctx, `SELECT kind, key_id, nonce, ciphertext FROM secrets WHERE tenant_id = $1 AND id = $2`, tenant, id).
		Scan(&kind, &keyID, &nonce, &ciphertext)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, notFound(tenant, id)
	}
	if err != nil {
		return nil, fmt.Errorf("read secret %s: %w", id, err)
	}
	plain, err := kr.open(keyID, tenant, id, Kind(kind), nonce, ciphertext)
	if err != nil {
		return nil, fmt.Errorf("open secret %s: %w", id, err)
	}
	return plain, nil
}

const metaCols = `id, tenant_id, kind, key_id, bound_to, created_at`

func scanMeta(r pgx.Row) (Meta, error) {
	var m Meta
	var kind string
	err := r.Scan(&m.ID, &m.TenantID, &kind, &m.KeyID, &m.BoundTo, &m.CreatedAt)
	m.Kind = Kind(kind)
	return m, err
}

// Get reads what is known of secret id of tenant without opening it;
// NOT_FOUND on "secretId" otherwise.
func Get(ctx context.Context, q Querier, tenant, id string) (Meta, error) {
	return getMeta(ctx, q, tenant, id, "")
}

// Lock is Get FOR UPDATE, in the caller's transaction: a delete that must
// know no one else starts using the secret meanwhile.
func Lock(ctx context.Context, q Querier, tenant, id string) (Meta, error) {
	return getMeta(ctx, q, tenant, id, " FOR UPDATE")
}

func getMeta(ctx context.Context, q Querier, tenant, id, suffix string) (Meta, error) {
	m, err := scanMeta(q.QueryRow(ctx, `SELECT `+metaCols+` FROM secrets WHERE tenant_id = $1 AND id = $2`+suffix, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Meta{}, notFound(tenant, id)
	}
	if err != nil {
		return Meta{}, fmt.Errorf("read secret %s: %w", id, err)
	}
	return m, nil
}

// Delete removes secret id of tenant; NOT_FOUND on "secretId" when there is
// none. A secret a machine still names is refused by the database (the
// caller deletes the machines first).
func Delete(ctx context.Context, q Querier, tenant, id string) error {
	tag, err := q.Exec(ctx, `DELETE FROM secrets WHERE tenant_id = $1 AND id = $2`, tenant, id)
	if err != nil {
		return fmt.Errorf("delete secret %s: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return notFound(tenant, id)
	}
	return nil
}

// Reseal seals again with kr's sealing key up to limit secrets sealed by
// another key of kr, and returns how many it did: after a rotation, run it
// until it returns 0, then the old key can leave the keyring. Each row is
// locked while it is rewritten; one that does not open fails the call.
func Reseal(ctx context.Context, q Querier, kr *Keyring, limit int) (int, error) {
	rows, err := q.Query(ctx, `SELECT id, tenant_id, kind, key_id, nonce, ciphertext FROM secrets
		WHERE key_id <> $1 AND key_id = ANY($2) ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED`, kr.KeyID(), kr.KeyIDs(), limit)
	if err != nil {
		return 0, fmt.Errorf("list secrets to reseal: %w", err)
	}
	type row struct {
		id, tenant, kind, keyID string
		nonce, ct               []byte
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		err := r.Scan(&x.id, &x.tenant, &x.kind, &x.keyID, &x.nonce, &x.ct)
		return x, err
	})
	if err != nil {
		return 0, fmt.Errorf("list secrets to reseal: %w", err)
	}
	for _, x := range list {
		plain, err := kr.open(x.keyID, x.tenant, x.id, Kind(x.kind), x.nonce, x.ct)
		if err != nil {
			return 0, fmt.Errorf("reseal secret %s: %w", x.id, err)
		}
		keyID, nonce, ct := kr.seal(x.tenant, x.id, Kind(x.kind), plain)
		clear(plain)
		if _, err := q.Exec(ctx, `UPDATE secrets SET key_id = $2, nonce = $3, ciphertext = $4 WHERE id = $1`, x.id, keyID, nonce, ct); err != nil {
			return 0, fmt.Errorf("reseal secret %s: %w", x.id, err)
		}
	}
	return len(list), nil
}
