// Package artifacts is the control plane's own store of bcd builds, so an
// air-gapped site needs nothing else to upgrade its agents: `better-compute
// artifacts publish` copies a build into a flat directory and writes its
// signed release manifest beside it (Publish); the api role serves that
// directory read-only at /artifacts/ (Handler), and nodes download from it
// what the manifests name. Integrity comes from the manifest's signature
// and SHA-256 (proto/agentrelease), not from the transport, so the files
// are served without authentication.
package artifacts

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// Prefix is the path the api role serves the directory under.
const Prefix = "/artifacts/"

// ManifestSuffix ends a build's manifest file: <build>.manifest.json.
const ManifestSuffix = ".manifest.json"

// nameRE is every name the directory holds and serves: flat, no dot first.
var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$`)

// Handler serves dir's files at Prefix<name>: only flat names of nameRE
// (no directory, no dot file, no listing), only regular files, at most
// agentrelease.MaxArtifactBytes each; GET and HEAD only.
func Handler(dir string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		name := strings.TrimPrefix(r.URL.Path, Prefix)
		if !nameRE.MatchString(name) {
			http.NotFound(w, r)
			return
		}
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			http.NotFound(w, r)
			return
		}
		defer func() { _ = f.Close() }()
		fi, err := f.Stat()
		if err != nil || !fi.Mode().IsRegular() || fi.Size() > agentrelease.MaxArtifactBytes {
			http.NotFound(w, r)
			return
		}
		ct := "application/octet-stream"
		if strings.HasSuffix(name, ManifestSuffix) {
			ct = "application/json"
		}
		w.Header().Set("Content-Type", ct)
		w.Header().Set("X-Content-Type-Options", "nosniff")
		http.ServeContent(w, r, "", fi.ModTime(), f)
	})
}

// Release is what Publish needs besides the build.
type Release struct {
	// Version is the build's version (v0.3.1): what it reports in Hello.
	Version string
	// Platform is its GOOS/GOARCH.
	Platform string
	// BaseURL is the api role's address as nodes reach it
	// (https://cp.example:8080): the manifest's URL is
	// BaseURL + Prefix + name.
	BaseURL string
	// NotAfter is the manifest's expiry.
	NotAfter time.Time
	// Counter is the manifest's counter; 0 means one more than the highest
	// of the manifests already in the directory.
	Counter uint64
}

// Published is what Publish wrote.
type Published struct {
	Manifest     *agentrelease.Manifest
	Build        string // the build's path in the directory
	ManifestPath string
}

// Publish copies the build at src into dir (bounded by
// agentrelease.MaxArtifactBytes; written to a temporary file and renamed,
// 0644), signs its manifest with key and writes it beside it. It refuses to
// replace a build of the same name, and a counter not above every manifest
// already there.
func Publish(dir, src string, rel Release, key ed25519.PrivateKey) (Published, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Published{}, err
	}
	highest, err := HighestCounter(dir)
	if err != nil {
		return Published{}, err
	}
	switch {
	case rel.Counter == 0:
		rel.Counter = highest + 1
	case rel.Counter <= highest:
		return Published{}, fault.New(fault.Conflict, "counter", "want a counter above %d, the highest published here, got %d", highest, rel.Counter)
	}
	osName, arch, _ := strings.Cut(rel.Platform, "/")
	name := fmt.Sprintf("bcd-%s-%s-%s", rel.Version, osName, arch)
	if !nameRE.MatchString(name) {
		return Published{}, fault.New(fault.InvalidInput, "version", "version and platform make the file name %q: want letters, digits, dots, dashes and underscores", name)
	}
	dst := filepath.Join(dir, name)
	if _, err := os.Lstat(dst); err == nil {
		return Published{}, fault.New(fault.Conflict, "version", "%s is already published in %s", name, dir)
	}
	in, err := os.Open(src)
	if err != nil {
		return Published{}, fault.Wrap(err, fault.InvalidInput, "file", "%v", err)
	}
	defer func() { _ = in.Close() }()
	tmp, err := os.CreateTemp(dir, "."+name+".tmp*")
	if err != nil {
		return Published{}, err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), io.LimitReader(in, agentrelease.MaxArtifactBytes+1))
	if err == nil && n > agentrelease.MaxArtifactBytes {
		err = fault.New(fault.InvalidInput, "file", "larger than %d bytes", agentrelease.MaxArtifactBytes)
	}
	if err == nil {
		err = tmp.Chmod(0o644)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return Published{}, err
	}
	m := &agentrelease.Manifest{Version: rel.Version, URL: strings.TrimSuffix(rel.BaseURL, "/") + Prefix + name,
		SHA256: hex.EncodeToString(h.Sum(nil)), Size: n, Platform: rel.Platform, NotAfter: rel.NotAfter.UTC(), Counter: rel.Counter}
	if err := agentrelease.Sign(m, key); err != nil {
		var field string
		if errors.Is(err, agentrelease.ErrMalformed) {
			field = "manifest"
		}
		return Published{}, fault.Wrap(err, fault.InvalidInput, field, "%v", err)
	}
	enc, err := agentrelease.Encode(m)
	if err != nil {
		return Published{}, err
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return Published{}, err
	}
	mpath := dst + ManifestSuffix
	if err := os.WriteFile(mpath, append(enc, '\n'), 0o644); err != nil {
		return Published{}, err
	}
	return Published{Manifest: m, Build: dst, ManifestPath: mpath}, nil
}

// HighestCounter is the highest counter of the manifests in dir (0 when
// none).
func HighestCounter(dir string) (uint64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var highest uint64
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ManifestSuffix) || !e.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return 0, err
		}
		m, err := agentrelease.Parse(b)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", e.Name(), err)
		}
		highest = max(highest, m.Counter)
	}
	return highest, nil
}
