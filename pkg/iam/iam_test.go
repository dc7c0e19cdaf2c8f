package iam_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/iam"
)

func TestTenantPaths(t *testing.T) {
	t.Parallel()
	if got := iam.Ancestors("acme.ml.team"); !slices.Equal(got, []string{"acme.ml.team", "acme.ml", "acme", "root"}) {
		t.Fatalf("Ancestors = %v", got)
	}
	for _, tc := range []struct {
		outer, tenant string
		want          bool
	}{
		{"root", "acme", true},
		{"acme", "acme", true},
		{"acme", "acme.ml", true},
		{"acme", "acmeco", false},
		{"acme.ml", "acme", false},
		{"acme", "root", false},
	} {
		if got := iam.Covers(tc.outer, tc.tenant); got != tc.want {
			t.Errorf("Covers(%q, %q) = %v", tc.outer, tc.tenant, got)
		}
	}
	for id, want := range map[string]bool{
		"root": true, "acme": true, "acme.ml-2": true, "Acme": false, "acme.": false,
		".acme": false, "acme..ml": false, "acme.root": false, "-a": false, "a-": false,
	} {
		if got := iam.ValidTenantID(id); got != want {
			t.Errorf("ValidTenantID(%q) = %v", id, got)
		}
	}
	if !iam.ChildOf("acme", "root") || !iam.ChildOf("acme.ml", "acme") || iam.ChildOf("acme.ml.x", "acme") || iam.ChildOf("root", "") {
		t.Error("ChildOf")
	}
}

func TestKeys(t *testing.T) {
	t.Parallel()
	k := iam.NewKey()
	id, secret, err := iam.ParseKey(k.Token)
	if err != nil || id != k.ID || !strings.HasPrefix(k.Token, "bck_"+id+".") || string(iam.HashSecret(secret)) != string(k.Hash) {
		t.Fatalf("round trip: %v %q %q", err, id, k.Token)
	}
	if k2 := iam.NewKey(); k2.Token == k.Token || k2.ID == k.ID {
		t.Fatal("keys repeat")
	}
	for _, bad := range []string{"", "bck_", "bck_x.y", k.Token + "a", strings.ToUpper(k.Token), strings.Replace(k.Token, ".", "_", 1), "Bearer " + k.Token} {
		if _, _, err := iam.ParseKey(bad); err == nil {
			t.Errorf("ParseKey(%q) accepted", bad)
		}
	}
}

func TestBelow(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		tenant, owner string
		want          []string
	}{
		{"acme.ml.team", "root", []string{"acme.ml.team", "acme.ml", "acme"}},
		{"acme.ml.team", "acme", []string{"acme.ml.team", "acme.ml"}},
		{"acme.ml", "acme.ml", nil}, // not a strict ancestor
		{"acme", "other", nil},
		{"acme", "acme.ml", nil}, // a descendant, not an ancestor
	} {
		if got := iam.Below(c.tenant, c.owner); !slices.Equal(got, c.want) {
			t.Errorf("Below(%q, %q) = %v, want %v", c.tenant, c.owner, got, c.want)
		}
	}
}
