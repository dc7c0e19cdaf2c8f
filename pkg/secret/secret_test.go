package secret_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/secret"
)

func TestMintParse(t *testing.T) {
	t.Parallel()
	m := secret.Mint("bck_")
	if !strings.HasPrefix(m.Value, "bck_"+m.ID+".") || len(m.ID) != 16 || len(m.Secret) != 52 {
		t.Fatalf("minted %+v", m)
	}
	id, s, ok := secret.Parse("bck_", m.Value)
	if !ok || id != m.ID || s != m.Secret || !bytes.Equal(secret.Hash(s), m.Hash) {
		t.Fatalf("parse %q %q %v", id, s, ok)
	}
	if other := secret.Mint("bck_"); other.ID == m.ID || other.Secret == m.Secret {
		t.Fatal("two mints collided")
	}
	for _, bad := range []string{
		"", "bck_", m.Value[4:], "bcjt_" + m.Value[4:], strings.Replace(m.Value, ".", "", 1),
		m.Value + "a", strings.ToUpper(m.Value), "bck_" + strings.Repeat("a", 16) + "." + strings.Repeat("1", 52),
	} {
		if _, _, ok := secret.Parse("bck_", bad); ok {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
}
