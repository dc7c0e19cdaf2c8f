package credseal_test

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/proto/credseal"
)

func TestSealOpen(t *testing.T) {
	t.Parallel()
	k, err := credseal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	jwk, err := credseal.PublicJWK(k)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(jwk, `"d"`) {
		t.Fatalf("the public JWK carries the private key: %s", jwk)
	}
	secret := []byte(`{"username":"root","password":"hunter2-very-secret"}`)

	t.Run("round trip", func(t *testing.T) {
		jwe, err := credseal.Seal(jwk, secret, []byte("stk_1"), []byte("mach_1"))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Count(jwe, ".") != 4 || strings.Contains(jwe, "hunter2") {
			t.Fatalf("not an opaque compact JWE: %s", jwe)
		}
		hdr, _ := base64.RawURLEncoding.DecodeString(strings.Split(jwe, ".")[0])
		for _, want := range []string{`"alg":"ECDH-ES+A256KW"`, `"enc":"A256GCM"`} {
			if !bytes.Contains(hdr, []byte(want)) {
				t.Fatalf("header %s lacks %s", hdr, want)
			}
		}
		got, err := credseal.Open(k, jwe, []byte("stk_1"), []byte("mach_1"))
		if err != nil || !bytes.Equal(got, secret) {
			t.Fatalf("Open = %q, %v", got, err)
		}
	})

	t.Run("two seals differ", func(t *testing.T) {
		a, _ := credseal.Seal(jwk, secret)
		b, _ := credseal.Seal(jwk, secret)
		if a == b || a == "" {
			t.Fatal("sealing twice gave the same JWE")
		}
	})

	t.Run("wrong key", func(t *testing.T) {
		jwe, err := credseal.Seal(jwk, secret)
		if err != nil {
			t.Fatal(err)
		}
		other, _ := credseal.NewKey()
		if _, err := credseal.Open(other, jwe); !errors.Is(err, credseal.ErrWrongKey) {
			t.Fatalf("Open with another key: %v, want ErrWrongKey", err)
		}
	})

	t.Run("other additional data", func(t *testing.T) {
		jwe, _ := credseal.Seal(jwk, secret, []byte("stk_1"))
		for _, aad := range [][][]byte{nil, {[]byte("stk_2")}, {[]byte("stk_"), []byte("1")}} {
			if _, err := credseal.Open(k, jwe, aad...); !errors.Is(err, credseal.ErrInvalid) {
				t.Fatalf("Open with aad %q: %v, want ErrInvalid", aad, err)
			}
		}
	})

	t.Run("tampered", func(t *testing.T) {
		jwe, _ := credseal.Seal(jwk, secret, []byte("stk_1"))
		parts := strings.Split(jwe, ".")
		for i := range parts {
			p := append([]string(nil), parts...)
			b, _ := base64.RawURLEncoding.DecodeString(p[i])
			if len(b) == 0 {
				continue
			}
			b[len(b)/2] ^= 1
			p[i] = base64.RawURLEncoding.EncodeToString(b)
			_, err := credseal.Open(k, strings.Join(p, "."), []byte("stk_1"))
			if err == nil {
				t.Fatalf("part %d tampered: opened", i)
			}
			if !errors.Is(err, credseal.ErrInvalid) && !errors.Is(err, credseal.ErrWrongKey) {
				t.Fatalf("part %d tampered: %v", i, err)
			}
		}
		if _, err := credseal.Open(k, "not.a.jwe"); !errors.Is(err, credseal.ErrInvalid) {
			t.Fatalf("garbage: %v", err)
		}
	})

	t.Run("bad input", func(t *testing.T) {
		if _, err := credseal.Seal(`{"kty":"oct","k":"AAAA"}`, secret); !errors.Is(err, credseal.ErrInvalid) {
			t.Fatalf("a symmetric JWK: %v", err)
		}
		if _, err := credseal.Seal(strings.Replace(jwk, `"kid":"`, `"kid":"x`, 1), secret); !errors.Is(err, credseal.ErrInvalid) {
			t.Fatalf("a JWK whose kid is not its thumbprint: %v", err)
		}
		if _, err := credseal.Seal(jwk, make([]byte, credseal.MaxPlaintext+1)); !errors.Is(err, credseal.ErrInvalid) {
			t.Fatalf("an oversize plaintext: %v", err)
		}
		if _, err := credseal.Open(k, strings.Repeat("a", credseal.MaxJWE+1)); !errors.Is(err, credseal.ErrInvalid) {
			t.Fatalf("an oversize JWE: %v", err)
		}
		kid, err := credseal.KeyID(jwk)
		if err != nil || !strings.Contains(jwk, kid) {
			t.Fatalf("KeyID = %q, %v", kid, err)
		}
	})
}

func TestSealedKeyID(t *testing.T) {
	t.Parallel()
	k, _ := credseal.NewKey()
	jwk, _ := credseal.PublicJWK(k)
	jwe, err := credseal.Seal(jwk, []byte("x"), credseal.TaskAAD("stk_1", "mach_1")...)
	if err != nil {
		t.Fatal(err)
	}
	kid, _ := credseal.KeyID(jwk)
	if got, err := credseal.SealedKeyID(jwe); err != nil || got != kid {
		t.Fatalf("SealedKeyID = %q, %v; want %q", got, err, kid)
	}
	if _, err := credseal.Open(k, jwe, credseal.TaskAAD("stk_1", "mach_2")...); !errors.Is(err, credseal.ErrInvalid) {
		t.Fatalf("opened as another machine's: %v", err)
	}
	if _, err := credseal.SealedKeyID("a.b.c.d.e"); !errors.Is(err, credseal.ErrInvalid) {
		t.Fatalf("garbage: %v", err)
	}
}
