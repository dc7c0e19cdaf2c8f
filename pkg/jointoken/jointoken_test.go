package jointoken_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestMintAndParse(t *testing.T) {
	t.Parallel()
	s := jointoken.Mint()
	id, secret, err := jointoken.Parse(s.Token)
	if err != nil || id != s.ID || string(jointoken.Hash(secret)) != string(s.Hash) {
		t.Fatalf("parse %q: %q %v", s.Token, id, err)
	}
	for _, bad := range []string{"", "bcjt_", "bck_" + s.Token[5:], s.Token + "x", s.Token[:len(s.Token)-1] + "1", "bcjt_" + s.ID + "-" + s.Token[22:]} {
		if _, _, err := jointoken.Parse(bad); !errors.Is(err, jointoken.ErrMalformed) {
			t.Errorf("Parse(%q) = %v, want ErrMalformed", bad, err)
		}
	}
}

func TestRedeem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	if _, err := pools.Create(ctx, db, pools.Pool{ID: "pool_p", TenantID: "root", Name: "p", Class: pools.ClassGPU}); err != nil {
		t.Fatal(err)
	}
	mint := func(uses int) jointoken.Secret {
		s := jointoken.Mint()
		if _, err := jointoken.Create(ctx, db, jointoken.Token{ID: s.ID, TenantID: "root", PoolID: "pool_p", Uses: uses}, s.Hash); err != nil {
			t.Fatal(err)
		}
		return s
	}

	t.Run("a refusing check spends nothing", func(t *testing.T) {
		s := mint(1)
		no := fault.New(fault.AccessDenied, "claims", "no")
		if _, err := jointoken.Redeem(ctx, db, s.Token, func(jointoken.Token) error { return no }); !errors.Is(err, no) {
			t.Fatal(err)
		}
		got, err := jointoken.Redeem(ctx, db, s.Token, nil)
		if err != nil || got.UsesLeft != 0 {
			t.Fatalf("%+v %v", got, err)
		}
		_, err = jointoken.Redeem(ctx, db, s.Token, nil)
		if !errors.Is(err, jointoken.ErrExhausted) || fault.CodeOf(err) != fault.Unauthenticated {
			t.Fatalf("spent token: %v", err)
		}
	})

	t.Run("concurrent redemptions never overspend", func(t *testing.T) {
		s := mint(3)
		var ok, exhausted atomic.Int32
		var wg sync.WaitGroup
		for range 16 {
			wg.Go(func() {
				_, err := jointoken.Redeem(ctx, db, s.Token, nil)
				switch {
				case err == nil:
					ok.Add(1)
				case errors.Is(err, jointoken.ErrExhausted):
					exhausted.Add(1)
				default:
					t.Error(err)
				}
			})
		}
		wg.Wait()
		if ok.Load() != 3 || exhausted.Load() != 13 {
			t.Fatalf("%d redeemed, %d exhausted", ok.Load(), exhausted.Load())
		}
	})
}
