package artifacts_test

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/artifacts"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestPublishAndServe publishes two builds (the counter goes up by itself,
// a stale one is refused), serves the directory, and reads a build and its
// manifest back as a node would: the manifest verifies and names the
// build's SHA-256. Names outside the flat directory are not served.
func TestPublishAndServe(t *testing.T) {
	t.Parallel()
	pub, priv, _ := ed25519.GenerateKey(nil)
	dir, src := t.TempDir(), filepath.Join(t.TempDir(), "bcd")
	if err := os.WriteFile(src, []byte("a bcd build"), 0o755); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET "+artifacts.Prefix, artifacts.Handler(dir))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	rel := artifacts.Release{Version: "v0.3.1", Platform: "linux/amd64", BaseURL: srv.URL, NotAfter: time.Now().Add(time.Hour)}
	p, err := artifacts.Publish(dir, src, rel, priv)
	if err != nil {
		t.Fatal(err)
	}
	if p.Manifest.Counter != 1 || filepath.Base(p.Build) != "bcd-v0.3.1-linux-amd64" {
		t.Fatalf("published %+v", p)
	}
	if _, err := artifacts.Publish(dir, src, rel, priv); fault.CodeOf(err) != fault.Conflict {
		t.Fatalf("the same version again: %v", err)
	}
	rel.Version = "v0.3.2"
	if p2, err := artifacts.Publish(dir, src, rel, priv); err != nil || p2.Manifest.Counter != 2 {
		t.Fatalf("a second build: %+v %v", p2, err)
	}
	rel.Version, rel.Counter = "v0.3.3", 2
	if _, err := artifacts.Publish(dir, src, rel, priv); fault.CodeOf(err) != fault.Conflict || !strings.Contains(err.Error(), "counter") {
		t.Fatalf("a counter not above the highest: %v", err)
	}

	get := func(path string) (int, []byte) {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	code, mb := get(artifacts.Prefix + "bcd-v0.3.1-linux-amd64" + artifacts.ManifestSuffix)
	if code != http.StatusOK {
		t.Fatalf("manifest: %d", code)
	}
	m, err := agentrelease.Parse(mb)
	if err != nil {
		t.Fatal(err)
	}
	if err := agentrelease.Verify(m, pub, time.Now()); err != nil {
		t.Fatalf("the served manifest: %v", err)
	}
	if !strings.HasPrefix(m.URL, srv.URL+artifacts.Prefix) {
		t.Fatalf("manifest URL %s", m.URL)
	}
	code, build := get(strings.TrimPrefix(m.URL, srv.URL))
	sum := sha256.Sum256(build)
	if code != http.StatusOK || hex.EncodeToString(sum[:]) != m.SHA256 || int64(len(build)) != m.Size {
		t.Fatalf("build: %d %q", code, build)
	}
	// Outside the directory, a dot file, a subdirectory, a listing.
	if err := os.WriteFile(filepath.Join(dir, ".hidden"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(filepath.Dir(dir), "secret")
	_ = os.WriteFile(secret, []byte("secret"), 0o600)
	for _, path := range []string{artifacts.Prefix, artifacts.Prefix + ".hidden", artifacts.Prefix + "sub", artifacts.Prefix + "..%2fsecret",
		artifacts.Prefix + "%2e%2e/secret", artifacts.Prefix + "sub/../../secret"} {
		if code, b := get(path); code == http.StatusOK {
			t.Errorf("%s served: %q", path, b)
		}
	}
	resp, err := http.Post(srv.URL+artifacts.Prefix+"x", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		t.Error("POST accepted")
	}
}
