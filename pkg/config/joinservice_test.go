package config_test

import (
	"slices"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/config"
)

func TestJoinServiceSection(t *testing.T) {
	t.Parallel()

	t.Run("from the file and the environment", func(t *testing.T) {
		t.Parallel()
		p := writeFile(t, "joinService:\n  trustDomain: fleet.example\n  caCertFile: /etc/bc/ca.crt\n  caKeyFile: /etc/bc/ca.key\n")
		c, err := config.Load(config.LoadOptions{Path: p, LookupEnv: env(map[string]string{"BC_JOIN_SERVICE_HPKE_KEY_FILE": "/etc/bc/hpke.pem"})})
		if err != nil {
			t.Fatal(err)
		}
		c.Defaults()
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if err := c.RequireJoinServiceKeys(); err != nil {
			t.Fatal(err)
		}
		js := c.JoinService
		if js.TrustDomain != "fleet.example" || js.CACertFile != "/etc/bc/ca.crt" || js.HPKEKeyFile != "/etc/bc/hpke.pem" {
			t.Fatalf("%+v", js)
		}
	})

	t.Run("bad values name their field", func(t *testing.T) {
		t.Parallel()
		c := &config.Config{JoinService: config.JoinService{TrustDomain: "Not A Domain", CACertFile: "/ca.crt"}}
		c.Defaults()
		got := fields(t, c.Validate())
		if !slices.Contains(got, "joinService.trustDomain") || !slices.Contains(got, "joinService.caKeyFile") {
			t.Fatalf("fields %v", got)
		}
	})

	t.Run("keys need files or a key directory", func(t *testing.T) {
		t.Parallel()
		c := &config.Config{}
		c.Defaults()
		if c.JoinService.TrustDomain != "bettercompute.local" {
			t.Fatalf("default trust domain %q", c.JoinService.TrustDomain)
		}
		if got := fields(t, c.RequireJoinServiceKeys()); !slices.Equal(got, []string{"joinService.caCertFile", "joinService.hpkeKeyFile"}) {
			t.Fatalf("fields %v", got)
		}
		c.JoinService.KeyDir = "/tmp/pki"
		if err := c.RequireJoinServiceKeys(); err != nil {
			t.Fatal(err)
		}
	})
}
