package keyfile_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/keyfile"
)

func TestEnsureThenLoad(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "pki", "k.key")
	made, err := keyfile.EnsureEd25519(path, "x.keyFile", "test key")
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("key file %v, %v: want mode 0600", st, err)
	}
	again, err := keyfile.EnsureEd25519(path, "x.keyFile", "test key")
	if err != nil || !again.Equal(made) {
		t.Fatalf("a second Ensure made another key (%v)", err)
	}
	loaded, err := keyfile.LoadEd25519(path, "x.keyFile", "test key")
	if err != nil || !loaded.Equal(made) {
		t.Fatalf("Load: %v", err)
	}
}

func TestLoadRefusesWhatIsNotAnEd25519Key(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.pem")
	if err := os.WriteFile(bad, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(dir, "missing.key"), bad} {
		_, err := keyfile.LoadEd25519(p, "x.keyFile", "test key")
		if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidConfig || fe.Field != "x.keyFile" {
			t.Errorf("%s: %v, want INVALID_CONFIG x.keyFile", p, err)
		}
	}
}
