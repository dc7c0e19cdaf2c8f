package ratelimit_test

import (
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/ratelimit"
)

func TestKeyedBucketsAreSeparateAndRefill(t *testing.T) {
	now := time.Unix(0, 0)
	k := ratelimit.New(1, 2, func() time.Time { return now })
	for i := range 2 {
		if !k.Allow("a") {
			t.Fatalf("a burst of 2 must allow 2; refused #%d", i+1)
		}
	}
	if k.Allow("a") || !k.Exhausted("a") {
		t.Fatal("the third within the second must be refused, and the bucket exhausted")
	}
	if !k.Allow("b") || k.Exhausted("b") {
		t.Fatal("another key has its own bucket")
	}
	now = now.Add(time.Second)
	if k.Exhausted("a") || !k.Allow("a") {
		t.Fatal("a second later a token is back")
	}
}
