package lease

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/startstop"
)

// LeaderConfig configures a [Leader].
type LeaderConfig struct {
	// Name is the lease; Holder names this process in it. Required.
	Name, Holder string
	// Heartbeat is how often the lease is renewed, or taken while it is
	// held by no one; default 2s. TTL is how long it lives unrenewed;
	// default 5 heartbeats.
	Heartbeat, TTL time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
	// OnChange, when set, is told each change of leadership: leading true
	// when the leader took the lease (h has its new fence), false when it
	// stopped holding it (lost at a renewal, fenced in [Leader.InTx], or
	// released or abandoned at Stop). Changes are told one at a time, in
	// order; OnChange must not call the leader's Start or Stop.
	OnChange func(h Held, leading bool)
}

// ErrNotLeading is returned by [Leader.InTx] while the leader does not hold
// its lease.
var ErrNotLeading = errors.New("not the lease holder")

// Leader holds one lease for as long as it can, for work that one process at
// a time may do outside the reconciler runtime (which holds its singleton
// and shard leases itself): started, it takes the lease when no one holds it
// and renews it every heartbeat; [Leader.InTx] runs work fenced by it;
// stopped, it releases the lease so that a standby takes over at once.
type Leader struct {
	cfg  LeaderConfig
	pool *pgxpool.Pool
	log  *slog.Logger
	beat *startstop.Loop

	held atomic.Pointer[Held]
	// mu orders the changes of held with what OnChange is told.
	mu sync.Mutex

	life   startstop.Once
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// NewLeader returns a stopped leader of cfg.Name over pool.
func NewLeader(pool *pgxpool.Pool, cfg LeaderConfig) (*Leader, error) {
	if cfg.Name == "" || cfg.Holder == "" {
		return nil, errors.New("lease: a leader needs a lease name and a holder")
	}
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, 2*time.Second)
	cfg.TTL = cmp.Or(cfg.TTL, 5*cfg.Heartbeat)
	l := &Leader{cfg: cfg, pool: pool, log: cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))}
	l.beat = startstop.NewLoop(cfg.Heartbeat, l.heartbeat)
	return l, nil
}

// Leading reports whether the leader holds its lease, as of its last
// heartbeat or fenced transaction.
func (l *Leader) Leading() bool { return l.held.Load() != nil }

// Held returns the lease as the leader holds it, if it does.
func (l *Leader) Held() (Held, bool) {
	if h := l.held.Load(); h != nil {
		return *h, true
	}
	return Held{}, false
}

// Start tries once to take the lease before it returns, then renews it, or
// takes it when it is free, every heartbeat until Stop. A second Start, or one after Stop,
// is an error.
func (l *Leader) Start(ctx context.Context) error {
	return l.life.Start(func() error {
		ctx, l.cancel = context.WithCancel(context.WithoutCancel(ctx))
		l.heartbeat(ctx)
		l.wg.Go(func() { l.beat.RunAfter(ctx, l.cfg.Heartbeat) })
		return nil
	})
}

// Stop ends the heartbeats and releases the lease, so that a standby takes
// it at once. It tolerates Stop before Start, a second Stop, and Stop
// concurrent with Start.
func (l *Leader) Stop() {
	l.life.Stop(func(bool) {
		l.halt()
		h := l.held.Load()
		if h == nil {
			return
		}
		l.drop(h)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := Release(ctx, l.pool, l.cfg.Holder, []Held{*h}); err != nil {
			l.log.Warn("release the lease", "lease", l.cfg.Name, "err", err)
		}
	})
}

// Abandon stops like a crashed process: the heartbeats end and the lease is
// left to expire. Tests of failover use it; a process stops with Stop.
func (l *Leader) Abandon() {
	l.life.Stop(func(bool) {
		l.halt()
		if h := l.held.Load(); h != nil {
			l.drop(h)
		}
	})
}

// halt ends the heartbeats, if Start started them. Call it under life.
func (l *Leader) halt() {
	if l.cancel != nil {
		l.cancel()
	}
	l.wg.Wait()
}

// heartbeat renews the lease, or takes it while it is not held. Each may
// take up to the lease's TTL, past which a renewal is too late anyway: a
// take given up on sooner might have taken the lease in the database all
// the same, and the leader would not know it held it until it expired.
func (l *Leader) heartbeat(ctx context.Context) (more bool) {
	hctx, cancel := context.WithTimeout(ctx, l.cfg.TTL)
	defer cancel()
	if h := l.held.Load(); h != nil {
		got, err := Renew(hctx, l.pool, l.cfg.Holder, l.cfg.TTL, []Held{*h})
		switch {
		case err != nil && ctx.Err() == nil:
			l.log.Warn("renew the lease", "lease", l.cfg.Name, "err", err)
		case err == nil && len(got) == 0:
			l.log.Warn("lost the lease", "lease", l.cfg.Name)
			l.drop(h)
		}
		return false
	}
	got, err := Acquire(hctx, l.pool, l.cfg.Holder, l.cfg.TTL, []string{l.cfg.Name})
	if err != nil {
		if ctx.Err() == nil {
			l.log.Warn("take the lease", "lease", l.cfg.Name, "err", err)
		}
		return false
	}
	if len(got) == 1 {
		l.take(got[0])
	}
	return false
}

func (l *Leader) take(h Held) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.held.Store(&h)
	if l.cfg.OnChange != nil {
		l.cfg.OnChange(h, true)
	}
}

// drop forgets h unless it was forgotten, or replaced, already.
func (l *Leader) drop(h *Held) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held.CompareAndSwap(h, nil) && l.cfg.OnChange != nil {
		l.cfg.OnChange(*h, false)
	}
}

// InTx runs fn in a transaction fenced by the lease: it first locks the
// lease's row ([Hold]) if the leader still holds it, so no one else takes it
// until the transaction ends. Without the lease it returns [ErrNotLeading];
// a lease found lost returns [ErrLost], writes nothing, and the leader no
// longer leads.
func (l *Leader) InTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	h := l.held.Load()
	if h == nil {
		return ErrNotLeading
	}
	err := db.InTx(ctx, l.pool, db.TxOptions{}, func(tx pgx.Tx) error {
		if err := Hold(ctx, tx, l.cfg.Holder, *h); err != nil {
			return err
		}
		return fn(tx)
	})
	if errors.Is(err, ErrLost) {
		l.drop(h)
	}
	return err
}
