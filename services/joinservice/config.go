package joinservice

import (
	"log/slog"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
)

// Open builds a Service from the configuration's joinService section: the
// CA and the HPKE key from their files, or generated once into keyDir.
// Failures are INVALID_CONFIG naming the field.
func Open(js config.JoinService, db DB, logger *slog.Logger) (*Service, error) {
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: js.TrustDomain, CertFile: js.CACertFile, KeyFile: js.CAKeyFile, Dir: js.KeyDir})
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, "joinService.caCertFile", "cannot load the node CA: %v", err)
	}
	var key *Key
	if js.HPKEKeyFile != "" {
		key, err = LoadKey(js.HPKEKeyFile)
	} else if js.KeyDir != "" {
		key, err = LoadOrCreateKey(js.KeyDir)
	} else {
		return nil, fault.New(fault.InvalidConfig, "joinService.hpkeKeyFile", "required: joinservice's HPKE key file (or joinService.keyDir, for development)")
	}
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, "joinService.hpkeKeyFile", "cannot load joinservice's HPKE key: %v", err)
	}
	return New(Config{DB: db, CA: ca, Key: key, Logger: logger})
}
