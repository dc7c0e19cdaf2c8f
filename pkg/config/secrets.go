package config

import "github.com/bettercompute/bettercompute/pkg/fault"

// Secrets configures the key that seals secrets at rest (pkg/secrets): the
// BMC credentials of bare-metal machines.
type Secrets struct {
	// KeyFile is the 32-byte key (raw, 64 hex digits or base64) new secrets
	// are sealed with; the api and metal roles read it. Unset, metal.enroll
	// is UNSUPPORTED naming this setting; dev generates
	// <dev.dataDir>/pki/secrets.key and `better-compute pki init` writes
	// secrets.key.
	KeyFile string `yaml:"keyFile"`
	// PreviousKeyFiles are older keys, kept only to open the secrets they
	// sealed after a rotation (at most 15).
	PreviousKeyFiles []string `yaml:"previousKeyFiles"`
}

// KeyFiles returns every key file, the sealing key first; nil when none is
// configured.
func (c Secrets) KeyFiles() []string {
	if c.KeyFile == "" {
		return nil
	}
	return append([]string{c.KeyFile}, c.PreviousKeyFiles...)
}

func (c *Secrets) validate() []error {
	var errs []error
	if len(c.PreviousKeyFiles) > 0 && c.KeyFile == "" {
		errs = append(errs, fault.New(fault.InvalidConfig, "secrets.previousKeyFiles", "needs secrets.keyFile: the older keys only open, one key must seal"))
	}
	if len(c.PreviousKeyFiles) > 15 {
		errs = append(errs, fault.New(fault.InvalidConfig, "secrets.previousKeyFiles", "at most 15 files, got %d", len(c.PreviousKeyFiles)))
	}
	for _, p := range c.PreviousKeyFiles {
		if p == "" || p == c.KeyFile {
			errs = append(errs, fault.New(fault.InvalidConfig, "secrets.previousKeyFiles", "%q: expected the path of an older key, not empty or secrets.keyFile", p))
			break
		}
	}
	return errs
}
