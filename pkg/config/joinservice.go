package config

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// MaxJoinServiceAddrs bounds gateway.joinService.
const MaxJoinServiceAddrs = 16

// DefaultJoinServiceListen is joinservice's internal listener when the role
// is asked for by name and joinService.listen is unset.
const DefaultJoinServiceListen = ":8444"

// validateJoinServiceRelay checks the standalone joinservice's listener and
// the gateway's relay to it.
func (c *Config) validateJoinServiceRelay() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	js, gw := c.JoinService, c.Gateway
	if l := js.Listen; l != "" {
		if _, port, err := net.SplitHostPort(l); err != nil || port == "" {
			bad("joinService.listen", "expected host:port (such as :8444), got %q", l)
		}
	}
	if len(js.Hosts) > 64 {
		bad("joinService.hosts", "expected at most 64 names, got %d", len(js.Hosts))
	}
	if (js.TLS.CertFile == "") != (js.TLS.KeyFile == "") {
		bad(pairField("joinService.tls", js.TLS.CertFile), "set joinService.tls.certFile and keyFile together")
	}
	if len(gw.JoinService) > MaxJoinServiceAddrs {
		bad("gateway.joinService", "expected at most %d addresses, got %d", MaxJoinServiceAddrs, len(gw.JoinService))
	}
	for i, a := range gw.JoinService {
		host, port, err := net.SplitHostPort(a)
		switch {
		case err != nil || host == "" || port == "":
			bad(fmt.Sprintf("gateway.joinService[%d]", i), "expected host:port (such as joinservice:8444), got %q", a)
		case slices.Index(gw.JoinService, a) != i:
			bad(fmt.Sprintf("gateway.joinService[%d]", i), "%q is listed twice", a)
		}
	}
	if t := gw.JoinServiceTimeout; t <= 0 || t > Duration(5*time.Minute) {
		bad("gateway.joinServiceTimeout", "expected a duration from 1ms to 5m, got %s", t.Std())
	}
	if (gw.TLS.CertFile == "") != (gw.TLS.KeyFile == "") {
		bad(pairField("gateway.tls", gw.TLS.CertFile), "set gateway.tls.certFile and keyFile together")
	}
	if gw.TLS.CertFile != "" && gw.TLS.CAFile == "" {
		bad("gateway.tls.caFile", "required with gateway.tls.certFile: the trust bundle node certificates chain to")
	}
	return errs
}

// pairField names the missing half of a certificate and key pair.
func pairField(prefix, certFile string) string {
	if certFile == "" {
		return prefix + ".certFile"
	}
	return prefix + ".keyFile"
}

// RelaysJoins reports whether the gateway relays Join and Renew to a
// standalone joinservice (gateway.joinService is set) instead of hosting it.
func (c *Config) RelaysJoins() bool { return len(c.Gateway.JoinService) > 0 }

// RequireGatewayTLS returns INVALID_CONFIG naming the field when a gateway
// that relays to joinservice, and so holds no node CA, has no certificate of
// its own.
func (c *Config) RequireGatewayTLS() error {
	if !c.RelaysJoins() {
		return nil
	}
	var errs []error
	t := c.Gateway.TLS
	if t.CertFile == "" {
		errs = append(errs, fault.New(fault.InvalidConfig, "gateway.tls.certFile",
			"required with gateway.joinService: the gateway's certificate (the gateway holds no node CA to sign one)"))
	}
	if t.CAFile == "" {
		errs = append(errs, fault.New(fault.InvalidConfig, "gateway.tls.caFile",
			"required with gateway.joinService: the node CA's trust bundle"))
	}
	return errors.Join(errs...)
}
