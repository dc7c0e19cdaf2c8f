package webhooks_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// The Standard Webhooks test vector, as published with the reference
// libraries (standard-webhooks, svix): a receiver's library verifies what we
// send only if this reproduces exactly.
const (
	vecSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	vecID     = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	vecUnix   = 1614265330
	vecBody   = `{"test": 2432232314}`
	vecSig    = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

func TestSignReproducesTheTestVector(t *testing.T) {
	t.Parallel()
	for _, token := range []string{vecSecret, strings.TrimPrefix(vecSecret, webhooks.SecretPrefix)} {
		key, err := webhooks.ParseSecret(token)
		if err != nil {
			t.Fatalf("ParseSecret(%q): %v", token, err)
		}
		ts := time.Unix(vecUnix, 0)
		if got := webhooks.Sign(key, vecID, ts, []byte(vecBody)); got != vecSig {
			t.Errorf("Sign = %q, want %q", got, vecSig)
		}
		h := webhooks.Headers(vecID, ts, []byte(vecBody), key)
		if got := h.Get("webhook-signature"); got != vecSig {
			t.Errorf("webhook-signature = %q, want %q", got, vecSig)
		}
		if h.Get("webhook-id") != vecID || h.Get("webhook-timestamp") != "1614265330" || h.Get("Content-Type") != "application/json" {
			t.Errorf("headers = %v", h)
		}
		if err := webhooks.Verify(key, h, []byte(vecBody), ts.Add(time.Minute), 5*time.Minute); err != nil {
			t.Errorf("Verify: %v", err)
		}
	}
}

func TestNewSecret(t *testing.T) {
	t.Parallel()
	token, key := webhooks.NewSecret()
	if !strings.HasPrefix(token, webhooks.SecretPrefix) || len(key) != 32 {
		t.Fatalf("NewSecret = %q, %d bytes", token, len(key))
	}
	parsed, err := webhooks.ParseSecret(token)
	if err != nil || !bytes.Equal(parsed, key) {
		t.Fatalf("ParseSecret(NewSecret()) = %x, %v; want %x", parsed, err, key)
	}
	if other, _ := webhooks.NewSecret(); other == token {
		t.Fatal("two secrets are equal")
	}
}

func TestParseSecretRejects(t *testing.T) {
	t.Parallel()
	for name, token := range map[string]string{
		"empty":         "",
		"prefix only":   "whsec_",
		"not base64":    "whsec_not*base64!",
		"url base64":    "whsec_" + strings.Repeat("-_", 16),
		"23 bytes":      "whsec_" + strings.Repeat("A", 31) + "=",
		"65 bytes":      "whsec_" + strings.Repeat("A", 88),
		"double prefix": "whsec_whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			key, err := webhooks.ParseSecret(token)
			fe, ok := fault.As(err)
			if !ok || fe.Code != fault.InvalidInput || fe.Field != "secret" {
				t.Fatalf("ParseSecret(%q) = %x, %v; want an INVALID_INPUT fault on secret", token, key, err)
			}
		})
	}
}

func TestVerify(t *testing.T) {
	t.Parallel()
	_, oldKey := webhooks.NewSecret()
	_, newKey := webhooks.NewSecret()
	_, otherKey := webhooks.NewSecret()
	now := time.Unix(1_700_000_000, 0)
	body := []byte(`{"type":"node.ready"}`)

	t.Run("both keys verify during rotation", func(t *testing.T) {
		t.Parallel()
		h := webhooks.Headers("msg_1", now, body, oldKey, newKey)
		if sigs := strings.Fields(h.Get("webhook-signature")); len(sigs) != 2 ||
			sigs[0] != webhooks.Sign(oldKey, "msg_1", now, body) || sigs[1] != webhooks.Sign(newKey, "msg_1", now, body) {
			t.Fatalf("webhook-signature = %q", h.Get("webhook-signature"))
		}
		for _, k := range [][]byte{oldKey, newKey} {
			if err := webhooks.Verify(k, h, body, now, time.Minute); err != nil {
				t.Errorf("Verify: %v", err)
			}
		}
	})
	t.Run("skips unknown versions and bad base64", func(t *testing.T) {
		t.Parallel()
		h := webhooks.Headers("msg_1", now, body, newKey)
		h.Set("webhook-signature", "v1a,xyz v1,!!! v1,bm9wZQ== "+h.Get("webhook-signature"))
		if err := webhooks.Verify(newKey, h, body, now, time.Minute); err != nil {
			t.Fatalf("Verify: %v", err)
		}
	})

	for _, tc := range []struct {
		name   string
		key    []byte
		edit   func(h map[string][]string)
		body   []byte
		offset time.Duration
		want   error
	}{
		{name: "tampered body", key: newKey, body: []byte(`{"type":"node.gone"}`), want: webhooks.ErrNoMatch},
		{name: "wrong key", key: otherKey, want: webhooks.ErrNoMatch},
		{name: "old timestamp", key: newKey, offset: 6 * time.Minute, want: webhooks.ErrBadTimestamp},
		{name: "future timestamp", key: newKey, offset: -6 * time.Minute, want: webhooks.ErrBadTimestamp},
		{name: "malformed timestamp", key: newKey, edit: func(h map[string][]string) { h["Webhook-Timestamp"] = []string{"soon"} }, want: webhooks.ErrBadTimestamp},
		{name: "missing signature", key: newKey, edit: func(h map[string][]string) { delete(h, "Webhook-Signature") }, want: webhooks.ErrNoSignature},
		{name: "missing id", key: newKey, edit: func(h map[string][]string) { delete(h, "Webhook-Id") }, want: webhooks.ErrNoSignature},
	} {
		t.Run("rejects "+tc.name, func(t *testing.T) {
			t.Parallel()
			h := webhooks.Headers("msg_1", now, body, oldKey, newKey)
			if tc.edit != nil {
				tc.edit(h)
			}
			got := body
			if tc.body != nil {
				got = tc.body
			}
			err := webhooks.Verify(tc.key, h, got, now.Add(tc.offset), 5*time.Minute)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Verify = %v, want %v", err, tc.want)
			}
		})
	}
}

func ExampleVerify() {
	key, _ := webhooks.ParseSecret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	sent := time.Unix(1614265330, 0)
	body := []byte(`{"test": 2432232314}`)
	h := webhooks.Headers("msg_p5jXN8AQM9LWM0D4loKWxJek", sent, body, key)
	fmt.Println(h.Get("webhook-signature"))
	fmt.Println(webhooks.Verify(key, h, body, sent.Add(time.Minute), 5*time.Minute))
	fmt.Println(webhooks.Verify(key, h, body, sent.Add(time.Hour), 5*time.Minute))
	// Output:
	// v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=
	// <nil>
	// webhooks: bad timestamp: 1h0m0s off the receiver's clock
}
