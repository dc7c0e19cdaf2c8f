package app

import "github.com/bettercompute/bettercompute/pkg/secrets"

// secretsKeyring loads the keys of secrets.keyFile (and
// secrets.previousKeyFiles). None configured is nil, and the api role then
// refuses metal.enroll UNSUPPORTED naming secrets.keyFile; a configured key
// that does not load fails the start (INVALID_CONFIG on secrets.keyFile).
func (a *App) secretsKeyring() (*secrets.Keyring, error) {
	files := a.cfg.Secrets.KeyFiles()
	if len(files) == 0 {
		a.logger.Info("no secrets.keyFile configured: metal.enroll is refused until one is")
		return nil, nil
	}
	return secrets.LoadKeyring(files...)
}
