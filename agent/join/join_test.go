package join_test

import (
	"context"
	"crypto/ecdh"
	"crypto/hpke"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/state"
)

type fixture struct {
	cp    *testcontrol.Server
	store *state.Store
	cfg   join.Config
}

func setup(t *testing.T) fixture {
	t.Helper()
	cp := testcontrol.New(t)
	store, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "sim", MachineID: "m-1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	return fixture{cp: cp, store: store, cfg: join.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token,
		JoinserviceKey: cp.PublicKey, State: store, Claims: inv,
	}}
}

func TestJoin(t *testing.T) {
	t.Parallel()

	t.Run("stores the node id, certificate and bundle", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		id, err := join.Join(context.Background(), f.cfg)
		if err != nil {
			t.Fatal(err)
		}
		stored, err := f.store.Identity()
		if err != nil {
			t.Fatal(err)
		}
		if stored.NodeID != id.NodeID || !strings.HasPrefix(id.NodeID, "node_") || len(stored.Chain) != 1 || len(stored.Bundle) != 1 {
			t.Fatalf("stored %+v, joined %+v", stored, id)
		}
		leaf, err := stored.Leaf()
		if err != nil {
			t.Fatal(err)
		}
		key, _ := f.store.Key()
		if !key.PublicKey.Equal(leaf.PublicKey) {
			t.Error("certificate is not for the node key")
		}
		if got := leaf.URIs[0].String(); got != "spiffe://"+testcontrol.TrustDomain+"/node/"+id.NodeID {
			t.Errorf("SPIFFE id %s", got)
		}
	})

	t.Run("wrong token is refused and nothing is stored", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cfg.Token = "bcjt_test.wrong"
		if _, err := join.Join(context.Background(), f.cfg); err == nil || !strings.Contains(err.Error(), "invalid join token") {
			t.Fatalf("err %v", err)
		}
		if _, err := f.store.Identity(); err == nil {
			t.Error("an identity was stored")
		}
	})

	t.Run("token sealed to another key is refused", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		other, _ := hpke.DHKEM(ecdh.X25519()).GenerateKey()
		f.cfg.JoinserviceKey = other.PublicKey().Bytes()
		f.cfg.JoinserviceKeyID = f.cp.KeyID // claims the right key id
		if _, err := join.Join(context.Background(), f.cfg); err == nil {
			t.Fatal("joined with a token sealed to another key")
		}
	})

	t.Run("gateway with an unexpected name is refused", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cfg.ServerName = "evil.test"
		if _, err := join.Join(context.Background(), f.cfg); err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("err %v", err)
		}
	})

	t.Run("gateway not signed by the given CA is refused", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cfg.RootCAs = testcontrol.New(t).RootCAs()
		if _, err := join.Join(context.Background(), f.cfg); err == nil {
			t.Fatal("trusted a gateway from another CA")
		}
	})
}

func TestSeal_OpensWithTheRecipientKey(t *testing.T) {
	t.Parallel()
	priv, err := hpke.DHKEM(ecdh.X25519()).GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	pub := priv.PublicKey().Bytes()
	csr := []byte("the CSR")
	enc, ct, err := join.Seal(pub, "bcjt_abc.def", csr)
	if err != nil {
		t.Fatal(err)
	}
	r, err := hpke.NewRecipient(enc, priv, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte("bettercompute join v1"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := r.Open(join.AAD(csr), ct)
	if err != nil || string(got) != "bcjt_abc.def" {
		t.Fatalf("open: %q, %v", got, err)
	}
	// The CSR is bound: a relay that swaps it cannot open the token.
	r3, _ := hpke.NewRecipient(enc, priv, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte("bettercompute join v1"))
	if _, err := r3.Open(join.AAD([]byte("another CSR")), ct); err == nil {
		t.Error("opened for another CSR")
	}
	// The info string is bound: another purpose cannot open it.
	r2, _ := hpke.NewRecipient(enc, priv, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte("something else"))
	if _, err := r2.Open(join.AAD(csr), ct); err == nil {
		t.Error("opened under another info string")
	}
	if _, _, err := join.Seal([]byte("short"), "t", nil); err == nil {
		t.Error("sealed to a malformed key")
	}
}

func TestParsePublicKey(t *testing.T) {
	t.Parallel()
	priv, _ := ecdh.X25519().GenerateKey(rand.Reader)
	raw := priv.PublicKey().Bytes()
	der, err := x509.MarshalPKIXPublicKey(priv.PublicKey())
	if err != nil {
		t.Fatal(err)
	}
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Headers: map[string]string{"Key-Id": "js-1"}, Bytes: der})
	for name, in := range map[string][]byte{"pem": pemBytes, "hex": []byte(hex.EncodeToString(raw) + "\n")} {
		pub, _, err := join.ParsePublicKey(in)
		if err != nil || string(pub) != string(raw) {
			t.Errorf("%s: %x, %v", name, pub, err)
		}
	}
	if _, id, _ := join.ParsePublicKey(pemBytes); id != "js-1" {
		t.Errorf("key id %q", id)
	}
	if _, _, err := join.ParsePublicKey([]byte("nonsense")); err == nil {
		t.Error("parsed nonsense")
	}
}

func TestJoinRetries(t *testing.T) {
	t.Parallel()

	t.Run("UNAVAILABLE is tried again within RetryFor", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cp.FailJoins(2, codes.Unavailable)
		f.cfg.RetryFor = time.Minute
		var retries []int
		f.cfg.OnRetry = func(attempt int, wait time.Duration, err error) {
			if status.Code(err) != codes.Unavailable || wait <= 0 || wait > 15*time.Second {
				t.Errorf("retry %d after %v: %v", attempt, wait, err)
			}
			retries = append(retries, attempt)
		}
		id, err := join.Join(context.Background(), f.cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := f.cp.JoinAttempts.Load(); got != 3 || len(retries) != 2 || !strings.HasPrefix(id.NodeID, "node_") {
			t.Fatalf("%d attempts, retries %v, node %q", got, retries, id.NodeID)
		}
	})

	t.Run("without RetryFor one attempt", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cp.FailJoins(1, codes.Unavailable)
		if _, err := join.Join(context.Background(), f.cfg); !join.Retryable(errors.Unwrap(err)) || !strings.Contains(err.Error(), "Unavailable") {
			t.Fatalf("err %v, want UNAVAILABLE", err)
		}
		if got := f.cp.JoinAttempts.Load(); got != 1 {
			t.Fatalf("%d attempts, want 1", got)
		}
	})

	t.Run("a refusal is not retried", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cfg.RetryFor = time.Minute
		f.cfg.Token = "bcjt_test.wrong"
		if _, err := join.Join(context.Background(), f.cfg); err == nil || !strings.Contains(err.Error(), "invalid join token") {
			t.Fatalf("err %v", err)
		}
		if got := f.cp.JoinAttempts.Load(); got != 1 {
			t.Fatalf("%d attempts of a refused token, want 1", got)
		}
	})

	t.Run("gives up when RetryFor passes, saying how often it tried", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		f.cp.FailJoins(100, codes.ResourceExhausted)
		f.cfg.RetryFor = 5 * time.Second
		_, err := join.Join(context.Background(), f.cfg)
		if err == nil || !strings.Contains(err.Error(), "attempts") || !strings.Contains(err.Error(), "ResourceExhausted") {
			t.Fatalf("err %v", err)
		}
		if got := f.cp.JoinAttempts.Load(); got < 2 {
			t.Fatalf("%d attempts within 5 s, want at least 2", got)
		}
	})
}
