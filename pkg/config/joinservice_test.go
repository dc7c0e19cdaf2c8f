package config_test

import (
	"slices"
	"strconv"
	"testing"
	"time"

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

func TestJoinServiceRelay(t *testing.T) {
	t.Parallel()

	t.Run("a relaying gateway and the internal listener, from the file and the environment", func(t *testing.T) {
		t.Parallel()
		p := writeFile(t, "joinService:\n  listen: :9444\n  hosts: [joinservice.internal]\n"+
			"gateway:\n  joinService: [js-a:8444]\n  tls:\n    certFile: /etc/bc/gw.crt\n    keyFile: /etc/bc/gw.key\n    caFile: /etc/bc/ca.pem\n")
		c, err := config.Load(config.LoadOptions{Path: p, LookupEnv: env(map[string]string{"BC_GATEWAY_JOIN_SERVICE": "js-a:8444,js-b:8444"})})
		if err != nil {
			t.Fatal(err)
		}
		c.Defaults()
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if err := c.RequireGatewayTLS(); err != nil {
			t.Fatal(err)
		}
		if !c.RelaysJoins() || !slices.Equal(c.Gateway.JoinService, []string{"js-a:8444", "js-b:8444"}) || c.Gateway.JoinServiceTimeout.Std() != 10*time.Second {
			t.Fatalf("gateway %+v", c.Gateway)
		}
		if c.JoinService.Listen != ":9444" || !slices.Equal(c.JoinService.Hosts, []string{"joinservice.internal"}) {
			t.Fatalf("joinService %+v", c.JoinService)
		}
	})

	t.Run("bad values name their field", func(t *testing.T) {
		t.Parallel()
		c := &config.Config{}
		c.JoinService.Listen = "nowhere"
		c.JoinService.TLS.CertFile = "/js.crt"
		c.Gateway.JoinService = []string{"js:8444", "no-port", "js:8444"}
		c.Gateway.JoinServiceTimeout = config.Duration(time.Hour)
		c.Gateway.TLS.KeyFile = "/gw.key"
		c.Defaults()
		got := fields(t, c.Validate())
		for _, f := range []string{"joinService.listen", "joinService.tls.keyFile", "gateway.joinService[1]", "gateway.joinService[2]",
			"gateway.joinServiceTimeout", "gateway.tls.certFile"} {
			if !slices.Contains(got, f) {
				t.Errorf("no fault on %s: %v", f, got)
			}
		}
		c = &config.Config{}
		c.Gateway.TLS.CertFile, c.Gateway.TLS.KeyFile = "/gw.crt", "/gw.key"
		c.Defaults()
		if got := fields(t, c.Validate()); !slices.Equal(got, []string{"gateway.tls.caFile"}) {
			t.Fatalf("a certificate without the trust bundle: %v", got)
		}
		c = &config.Config{}
		for i := range config.MaxJoinServiceAddrs + 1 {
			c.Gateway.JoinService = append(c.Gateway.JoinService, "js:"+strconv.Itoa(8000+i))
		}
		c.Defaults()
		if got := fields(t, c.Validate()); !slices.Equal(got, []string{"gateway.joinService"}) {
			t.Fatalf("too many addresses: %v", got)
		}
	})

	t.Run("a relaying gateway needs a certificate and a bundle", func(t *testing.T) {
		t.Parallel()
		c := &config.Config{}
		c.Defaults()
		if c.RelaysJoins() || c.RequireGatewayTLS() != nil {
			t.Fatal("no joinService: the gateway hosts joinservice and needs no certificate of its own")
		}
		c.Gateway.JoinService = []string{"js:8444"}
		if got := fields(t, c.RequireGatewayTLS()); !slices.Equal(got, []string{"gateway.tls.certFile", "gateway.tls.caFile"}) {
			t.Fatalf("fields %v", got)
		}
	})
}
