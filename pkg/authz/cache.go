package authz

import (
	"container/list"
	"context"
	"crypto/sha256"
	"fmt"
	"strings"
	"time"

	"github.com/cedar-policy/cedar-go"
	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/wake"
)

// Defaults of [Options].
const (
	// DefaultRecheck is how long a tenant's cached policies are trusted
	// without reading its version, while the bus is up.
	DefaultRecheck = time.Second
	// DefaultCacheBytes bounds the Cedar text behind the cached policies.
	DefaultCacheBytes = 64 << 20
	// DefaultCacheTenants bounds the tenants cached.
	DefaultCacheTenants = 4096
	// DefaultCacheChains bounds the composed policy sets (one per tenant
	// chain decided on) cached.
	DefaultCacheChains = 4096
)

// Options tune an Authorizer's policy cache. The zero value is production's.
type Options struct {
	// Recheck is how long, while the authorizer listens on a connected bus
	// ([Authorizer.Listen]), a tenant's cached policies are used without
	// reading its policy version; 0 means [DefaultRecheck]. Without a bus
	// (none, disconnected, or messages dropped) every decision reads the
	// versions of its tenants: one indexed statement.
	Recheck time.Duration
	// MaxBytes bounds the Cedar text of the cached tenants' policies; 0 means
	// [DefaultCacheBytes]. MaxTenants and MaxChains bound the entries; 0
	// means [DefaultCacheTenants] and [DefaultCacheChains]. The least
	// recently used go first.
	MaxBytes, MaxTenants, MaxChains int
	// Now is the clock of Recheck; nil means time.Now.
	Now func() time.Time
}

// CacheStats counts the cache's work, for tests and metrics.
type CacheStats struct {
	// Parses is the number of policy documents parsed.
	Parses int64
	// Reads is the number of statements that read versions or policies.
	Reads int64
	// Tenants, Chains and Bytes are what the cache holds now.
	Tenants, Chains, Bytes int
}

// tenantEntry is one tenant's compiled policies at one policy version.
type tenantEntry struct {
	id      string
	version int64
	// checked is when version was last read from the database; zero means
	// the entry must be checked before it is used.
	checked  time.Time
	policies []compiledPolicy
	// byName keeps each document's parse, reused by a later load while the
	// body is the same.
	byName map[string]parsedBody
	bytes  int
	elem   *list.Element
}

type compiledPolicy struct {
	id     cedar.PolicyID
	policy *cedar.Policy
}

type parsedBody struct {
	sum  [sha256.Size]byte
	list cedar.PolicyList // nil when the stored body no longer parses
}

// chainEntry is the policy set composed of a chain's tenant entries.
type chainEntry struct {
	key     string
	tenants []*tenantEntry
	set     *cedar.PolicySet
	elem    *list.Element
}

// entryOverhead is counted per cached policy besides its text.
const entryOverhead = 256

func (o Options) withDefaults() Options {
	if o.Recheck <= 0 {
		o.Recheck = DefaultRecheck
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultCacheBytes
	}
	if o.MaxTenants <= 0 {
		o.MaxTenants = DefaultCacheTenants
	}
	if o.MaxChains <= 0 {
		o.MaxChains = DefaultCacheChains
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// Listen subscribes the authorizer to policy wakes (wake.Policies) on nc, so a change
// committed by any process reaches its cache at once; while it listens on a
// connected bus it trusts a cached tenant for [Options.Recheck] without
// reading its version. Calling it again replaces the subscription.
func (a *Authorizer) Listen(nc *nats.Conn) error {
	if nc == nil {
		return nil
	}
	sub, err := wake.SubscribePolicies(nc, a.Invalidate)
	if err != nil {
		return err
	}
	a.mu.Lock()
	old := a.sub
	a.nc, a.sub = nc, sub
	a.reconnects, a.dropped = nc.Stats().Reconnects, 0
	a.invalidateLocked("")
	a.mu.Unlock()
	if old != nil {
		_ = old.Unsubscribe()
	}
	return nil
}

// Close ends the subscription of [Authorizer.Listen]; decisions then read
// versions every time.
func (a *Authorizer) Close() {
	a.mu.Lock()
	sub := a.sub
	a.nc, a.sub = nil, nil
	a.mu.Unlock()
	if sub != nil {
		_ = sub.Unsubscribe()
	}
}

// Invalidate makes the next decision on tenant recheck its policy version
// ("" means every tenant). A policy change calls it after the commit
// through reconcile.Queue.WakePolicies.
func (a *Authorizer) Invalidate(tenant string) {
	a.mu.Lock()
	a.invalidateLocked(tenant)
	a.mu.Unlock()
}

func (a *Authorizer) invalidateLocked(tenant string) {
	a.epoch++
	if tenant == "" {
		for _, e := range a.tenants {
			e.checked = time.Time{}
		}
		return
	}
	if e := a.tenants[tenant]; e != nil {
		e.checked = time.Time{}
	}
}

// Stats returns the cache's counters.
func (a *Authorizer) Stats() CacheStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return CacheStats{Parses: a.parses, Reads: a.reads, Tenants: len(a.tenants), Chains: len(a.chains), Bytes: a.bytes}
}

// busHealthyLocked reports whether the authorizer hears every policy change
// message: it listens on a connected bus and has lost none since it last
// looked. A reconnect or a dropped message invalidates everything, since
// messages may have been missed.
func (a *Authorizer) busHealthyLocked() bool {
	if a.sub == nil || a.nc == nil || !a.sub.IsValid() || !a.nc.IsConnected() {
		return false
	}
	healthy := true
	if r := a.nc.Stats().Reconnects; r != a.reconnects {
		a.reconnects, healthy = r, false
	}
	if d, err := a.sub.Dropped(); err != nil || d != a.dropped {
		a.dropped, healthy = d, false
	}
	if !healthy {
		a.invalidateLocked("")
	}
	return healthy
}

// loaded is what one read returned for one tenant.
type loaded struct {
	version int64
	bodies  []namedBody
}

type namedBody struct{ name, body string }

// policySet returns the policy set of the tenants (a chain, root last),
// from the cache where it is current. shared says q is the Authorizer's own
// database (not a transaction), whose reads may be cached.
func (a *Authorizer) policySet(ctx context.Context, q Querier, tenants []string, shared bool) (*cedar.PolicySet, error) {
	key := strings.Join(tenants, "\x00")
	now := a.opts.Now()
	a.mu.Lock()
	healthy := a.busHealthyLocked()
	cur := make([]*tenantEntry, len(tenants))
	var need []int
	for i, t := range tenants {
		e := a.tenants[t]
		cur[i] = e
		if e != nil {
			a.tenantLRU.MoveToFront(e.elem)
		}
		if e == nil || !shared || !healthy || e.checked.IsZero() || now.Sub(e.checked) >= a.opts.Recheck {
			need = append(need, i)
		}
	}
	if len(need) == 0 {
		if ce := a.chains[key]; ce != nil && sameEntries(ce.tenants, cur) {
			a.chainLRU.MoveToFront(ce.elem)
			a.mu.Unlock()
			return ce.set, nil
		}
	}
	epoch := a.epoch
	a.mu.Unlock()

	if len(need) > 0 {
		ids := make([]string, len(need))
		known := make([]int64, len(need))
		for j, i := range need {
			ids[j], known[j] = tenants[i], -1
			if cur[i] != nil {
				known[j] = cur[i].version
			}
		}
		got, err := readPolicies(ctx, q, ids, known)
		a.mu.Lock()
		a.reads++
		a.mu.Unlock()
		if err != nil {
			return nil, err
		}
		fresh := make(map[int]*tenantEntry, len(need))
		for j, i := range need {
			l := got[ids[j]]
			if l == nil {
				l = &loaded{} // a tenant without a row: version 0, no policies
			}
			if cur[i] != nil && l.version == cur[i].version {
				continue // unchanged: the read returned no bodies
			}
			fresh[i] = a.compile(ids[j], l, cur[i])
		}
		a.mu.Lock()
		current := epoch == a.epoch
		for _, i := range need {
			t := tenants[i]
			if e := fresh[i]; e != nil {
				cur[i] = e
				if !shared {
					continue
				}
				if current {
					e.checked = now
				}
				a.storeLocked(e)
			} else if shared && current && a.tenants[t] == cur[i] {
				cur[i].checked = now
			}
		}
		a.evictLocked()
	} else {
		a.mu.Lock()
	}
	defer a.mu.Unlock()
	if ce := a.chains[key]; ce != nil && sameEntries(ce.tenants, cur) {
		a.chainLRU.MoveToFront(ce.elem)
		return ce.set, nil
	}
	ps := cedar.NewPolicySet()
	for _, e := range cur {
		for _, p := range e.policies {
			ps.Add(p.id, p.policy)
		}
	}
	if shared && a.allCachedLocked(cur) {
		if old := a.chains[key]; old != nil {
			a.chainLRU.Remove(old.elem)
		}
		ce := &chainEntry{key: key, tenants: cur, set: ps}
		ce.elem = a.chainLRU.PushFront(ce)
		a.chains[key] = ce
		a.evictLocked()
	}
	return ps, nil
}

// allCachedLocked reports whether every entry is the cached one of its
// tenant, so that a chain never holds an evicted tenant's policies.
func (a *Authorizer) allCachedLocked(es []*tenantEntry) bool {
	for _, e := range es {
		if a.tenants[e.id] != e {
			return false
		}
	}
	return true
}

func sameEntries(a, b []*tenantEntry) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// readPolicies reads, in one statement (one snapshot), the policy version of
// each tenant and, for those whose version is not the known one, all their
// policies.
func readPolicies(ctx context.Context, q Querier, ids []string, known []int64) (map[string]*loaded, error) {
	rows, err := q.Query(ctx, `
		SELECT k.id, t.policy_version, p.name, p.body
		FROM unnest($1::text[], $2::bigint[]) AS k (id, known)
		JOIN tenants t ON t.id = k.id
		LEFT JOIN policies p ON p.tenant_id = t.id AND t.policy_version <> k.known`, ids, known)
	if err != nil {
		return nil, fmt.Errorf("read policies: %w", err)
	}
	defer rows.Close()
	got := make(map[string]*loaded, len(ids))
	for rows.Next() {
		var (
			id         string
			version    int64
			name, body *string
		)
		if err := rows.Scan(&id, &version, &name, &body); err != nil {
			return nil, fmt.Errorf("read policies: %w", err)
		}
		l := got[id]
		if l == nil {
			l = &loaded{version: version}
			got[id] = l
		}
		if name != nil && body != nil {
			l.bodies = append(l.bodies, namedBody{*name, *body})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read policies: %w", err)
	}
	return got, nil
}

// compile builds the entry of tenant from what was read, reusing prev's
// parse of every body that did not change.
func (a *Authorizer) compile(tenant string, l *loaded, prev *tenantEntry) *tenantEntry {
	e := &tenantEntry{id: tenant, version: l.version, byName: map[string]parsedBody{}}
	var parses int64
	for _, b := range l.bodies {
		key := tenant + "/" + b.name
		sum := sha256.Sum256([]byte(b.body))
		pb, ok := parsedBody{}, false
		if prev != nil {
			pb, ok = prev.byName[b.name]
			ok = ok && pb.sum == sum
		}
		if !ok {
			parses++
			list, err := Parse(key, b.body)
			if err != nil {
				// Stored policies were validated on put; one that no
				// longer parses (after a cedar-go upgrade) takes part in
				// nothing.
				list = nil
			}
			pb = parsedBody{sum: sum, list: list}
		}
		e.byName[b.name] = pb
		e.bytes += len(b.body) + entryOverhead
		for i, pol := range pb.list {
			e.policies = append(e.policies, compiledPolicy{id: cedar.PolicyID(fmt.Sprintf("%s#%d", key, i)), policy: pol})
		}
	}
	a.mu.Lock()
	a.parses += parses
	a.mu.Unlock()
	return e
}

// storeLocked puts e in the cache in place of the tenant's old entry.
func (a *Authorizer) storeLocked(e *tenantEntry) {
	if old := a.tenants[e.id]; old != nil {
		a.removeTenantLocked(old)
	}
	e.elem = a.tenantLRU.PushFront(e)
	a.tenants[e.id] = e
	a.bytes += e.bytes
}

func (a *Authorizer) removeTenantLocked(e *tenantEntry) {
	a.tenantLRU.Remove(e.elem)
	delete(a.tenants, e.id)
	a.bytes -= e.bytes
}

// evictLocked drops the least recently used entries until the cache is
// within its bounds. A chain goes with any of its tenants, so an evicted
// tenant's policies are not kept alive by a chain.
func (a *Authorizer) evictLocked() {
	for a.tenantLRU.Len() > 0 && (len(a.tenants) > a.opts.MaxTenants || a.bytes > a.opts.MaxBytes) {
		e := a.tenantLRU.Back().Value.(*tenantEntry)
		a.removeTenantLocked(e)
		for k, ce := range a.chains {
			for _, t := range ce.tenants {
				if t == e {
					a.chainLRU.Remove(ce.elem)
					delete(a.chains, k)
					break
				}
			}
		}
	}
	for len(a.chains) > a.opts.MaxChains {
		ce := a.chainLRU.Back().Value.(*chainEntry)
		a.chainLRU.Remove(ce.elem)
		delete(a.chains, ce.key)
	}
}
