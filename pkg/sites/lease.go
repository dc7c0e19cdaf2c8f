package sites

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Boot lease defaults.
const (
	// DefaultLeaseTTL is how long a boot lease lasts unless renewed; the
	// holder renews it every third of that.
	DefaultLeaseTTL = 15 * time.Second
	// MaxLeaseTTL bounds what a caller may ask for.
	MaxLeaseTTL = 5 * time.Minute
)

// Lease is a site agent's view of its site's boot lease.
type Lease struct {
	SiteID string
	// Holder is the agent holding it now.
	Holder string
	// Epoch is the fencing token: it grows by one every time the lease
	// changes hands (or is taken again after it lapsed).
	Epoch int64
	// ExpiresAt is when it lapses unless renewed (database time).
	ExpiresAt time.Time
}

// Held reports whether agent holds l.
func (l Lease) Held(agent string) bool { return l.Holder == agent }

// AcquireLease takes or renews the boot lease of site for agent, for ttl.
// agent takes it when no one holds it, when it already does (a renewal:
// same epoch), or when the holder's lease has lapsed (a take-over: epoch +
// 1). Otherwise the lease is left alone and the current holder's lease is
// returned, so the caller sees who serves the site and until when. One
// conditional UPDATE, by database time.
func AcquireLease(ctx context.Context, q Querier, site, agent string, ttl time.Duration) (Lease, error) {
	if ttl <= 0 || ttl > MaxLeaseTTL {
		return Lease{}, fault.New(fault.InvalidInput, "ttl", "expected a lease of up to %s, got %s", MaxLeaseTTL, ttl)
	}
	l := Lease{SiteID: site}
	err := q.QueryRow(ctx, `
		UPDATE sites SET
		    boot_epoch = CASE WHEN boot_holder IS NOT DISTINCT FROM $2 AND boot_expires_at > now() THEN boot_epoch ELSE boot_epoch + 1 END,
		    boot_holder = $2,
		    boot_expires_at = now() + make_interval(secs => $3)
		WHERE id = $1 AND (boot_holder IS NULL OR boot_holder = $2 OR boot_expires_at <= now())
		RETURNING boot_holder, boot_epoch, boot_expires_at`, site, agent, ttl.Seconds()).Scan(&l.Holder, &l.Epoch, &l.ExpiresAt)
	if err == nil {
		return l, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return Lease{}, fmt.Errorf("acquire boot lease of %s: %w", site, err)
	}
	return ReadLease(ctx, q, site)
}

// ReadLease reads the boot lease of site as it stands.
func ReadLease(ctx context.Context, q Querier, site string) (Lease, error) {
	l := Lease{SiteID: site}
	var expires *time.Time
	err := q.QueryRow(ctx, `SELECT coalesce(boot_holder, ''), boot_epoch, boot_expires_at FROM sites WHERE id = $1`, site).
		Scan(&l.Holder, &l.Epoch, &expires)
	if errors.Is(err, pgx.ErrNoRows) {
		return Lease{}, fault.New(fault.NotFound, "siteId", "site %q not found", site)
	}
	if err != nil {
		return Lease{}, fmt.Errorf("read boot lease of %s: %w", site, err)
	}
	if expires != nil {
		l.ExpiresAt = *expires
	}
	return l, nil
}

// ReleaseLease gives up agent's lease of site, if it holds it, so a
// standby takes over at once instead of after the lease lapses.
func ReleaseLease(ctx context.Context, q Querier, site, agent string) error {
	if _, err := q.Exec(ctx, `UPDATE sites SET boot_expires_at = now() WHERE id = $1 AND boot_holder = $2 AND boot_expires_at > now()`,
		site, agent); err != nil {
		return fmt.Errorf("release boot lease of %s: %w", site, err)
	}
	return nil
}

// ErrFenced is wrapped by a [CheckFence] refusal.
var ErrFenced = errors.New("stale boot lease")

// CheckFence refuses (CONFLICT on "bootEpoch", wrapping [ErrFenced]) unless
// agent holds site's boot lease at epoch and it has not lapsed. Call it in
// the transaction that makes a write on behalf of the boot server: it locks
// the site row FOR SHARE, so no take-over commits between the check and the
// write.
func CheckFence(ctx context.Context, q Querier, site, agent string, epoch int64) error {
	var ok bool
	err := q.QueryRow(ctx, `SELECT boot_holder IS NOT DISTINCT FROM $2 AND boot_epoch = $3 AND boot_expires_at > now()
		FROM sites WHERE id = $1 FOR SHARE`, site, agent, epoch).Scan(&ok)
	if errors.Is(err, pgx.ErrNoRows) {
		return fault.New(fault.NotFound, "siteId", "site %q not found", site)
	}
	if err != nil {
		return fmt.Errorf("check boot lease of %s: %w", site, err)
	}
	if !ok {
		return fault.Wrap(ErrFenced, fault.Conflict, "bootEpoch", "site agent %s does not hold the boot lease of %s at epoch %d", agent, site, epoch)
	}
	return nil
}
