package config

import (
	"cmp"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// IAM configures the iam role's jobs, each under a singleton lease.
type IAM struct {
	// KeyRetention is how long a revoked or expired API key is kept
	// before iam.keys deletes it (its console sessions with it). Default
	// 720h (30 days), 1h to 8760h.
	KeyRetention Duration `yaml:"keyRetention"`
	// KeyExpiryWarning is how long before its expiry a key's
	// apiKey.expiring event is written (once per key). Default 168h (7
	// days), 1m to 2160h.
	KeyExpiryWarning Duration `yaml:"keyExpiryWarning"`
	// KeysEvery is how often iam.keys runs. Default 1m, 1s to 1h.
	KeysEvery Duration `yaml:"keysEvery"`
	// VerifyEvery is how often iam.projection re-verifies the
	// authorization projection against its sources. Default 10m, 1s to
	// 24h.
	VerifyEvery Duration `yaml:"verifyEvery"`
}

func (c *IAM) defaults() {
	c.KeyRetention = cmp.Or(c.KeyRetention, Duration(30*24*time.Hour))
	c.KeyExpiryWarning = cmp.Or(c.KeyExpiryWarning, Duration(7*24*time.Hour))
	c.KeysEvery = cmp.Or(c.KeysEvery, Duration(time.Minute))
	c.VerifyEvery = cmp.Or(c.VerifyEvery, Duration(10*time.Minute))
}

func (c *IAM) validate() []error {
	var errs []error
	if d := c.KeyRetention.Std(); d < time.Hour || d > 8760*time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "iam.keyRetention", "expected 1h to 8760h, got %s", d))
	}
	if d := c.KeyExpiryWarning.Std(); d < time.Minute || d > 2160*time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "iam.keyExpiryWarning", "expected 1m to 2160h, got %s", d))
	}
	if d := c.KeysEvery.Std(); d < time.Second || d > time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "iam.keysEvery", "expected 1s to 1h, got %s", d))
	}
	if d := c.VerifyEvery.Std(); d < time.Second || d > 24*time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "iam.verifyEvery", "expected 1s to 24h, got %s", d))
	}
	return errs
}
