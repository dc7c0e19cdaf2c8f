package cli_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/proto/agentrelease"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// TestArtifactsKeygenAndPublish: keygen writes a 0600 release key and its
// public key; publish copies a build and writes a manifest that verifies
// against that public key with the build's SHA-256 and URL; the same
// version again is refused, and bad input is a usage error.
func TestArtifactsKeygenAndPublish(t *testing.T) {
	t.Parallel()
	tmp := t.TempDir()
	keys, dir, build := filepath.Join(tmp, "keys"), filepath.Join(tmp, "artifacts"), filepath.Join(tmp, "bcd")
	mustBC(t, "artifacts", "keygen", "--dir", keys)
	if m := mode(t, filepath.Join(keys, cli.ReleaseKeyFile)); m != 0o600 {
		t.Fatalf("release key mode %v", m)
	}
	if rc, _, _ := bc(t, "artifacts", "keygen", "--dir", keys); rc == 0 {
		t.Fatal("keygen overwrote the release key")
	}
	if err := os.WriteFile(build, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := mustBC(t, "artifacts", "publish", build, "--version", "v0.5.0", "--key", filepath.Join(keys, cli.ReleaseKeyFile),
		"--dir", dir, "--base-url", "https://cp.example:8080", "--platform", "linux/arm64", "--valid-for", "1h")
	if !strings.Contains(out, "counter 1") {
		t.Fatalf("publish: %s", out)
	}
	b, err := os.ReadFile(filepath.Join(dir, "bcd-v0.5.0-linux-arm64.manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := agentrelease.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	pb, _ := os.ReadFile(filepath.Join(keys, cli.ReleasePubFile))
	pub, err := agentrelease.ParsePublicKey(pb)
	if err != nil {
		t.Fatal(err)
	}
	if err := agentrelease.Verify(m, pub, time.Now()); err != nil {
		t.Fatalf("published manifest: %v", err)
	}
	if m.URL != "https://cp.example:8080/artifacts/bcd-v0.5.0-linux-arm64" || m.Platform != "linux/arm64" || m.Size != 17 {
		t.Fatalf("manifest %+v", m)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "bcd-v0.5.0-linux-arm64")); string(got) != "#!/bin/sh\nexit 0\n" {
		t.Fatalf("copied build %q", got)
	}
	if rc, _, errs := bc(t, "artifacts", "publish", build, "--version", "v0.5.0", "--key", filepath.Join(keys, cli.ReleaseKeyFile),
		"--dir", dir, "--base-url", "https://cp.example:8080", "--platform", "linux/arm64"); rc == 0 || !strings.Contains(errs, "CONFLICT") {
		t.Fatalf("the same version again: %d %s", rc, errs)
	}
	for _, args := range [][]string{
		{"artifacts", "publish", build, "--version", "latest", "--key", "k", "--dir", dir, "--base-url", "https://cp"},
		{"artifacts", "publish", build, "--version", "v1.0.0", "--key", "k", "--dir", dir, "--base-url", "https://cp/sub"},
		{"artifacts", "publish", build, "--version", "v1.0.0"},
	} {
		if rc, _, _ := bc(t, args...); rc != serve.ExitConfig {
			t.Errorf("%v: exit %d, want usage", args, rc)
		}
	}
}
