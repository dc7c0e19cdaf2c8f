package dev

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/bettercompute/bettercompute/pkg/artifacts"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// make run's second build (docs/agent-upgrades.md): dev keeps a release key
// under dev.dataDir/pki, serves dev.dataDir/artifacts (artifacts.dir) from
// the api role, and publishes there, on every start, a SIMULATED bcd build
// of SimUpgradeVersion with its manifest signed by that key. The simulated
// nodes pin the key, so a rollout with mask agent carrying the manifest
// (the banner prints the command) makes each download the build, check its
// size and SHA-256 and stage it with bcd's installer, then simulate the
// handover (agent/sim): it reconnects reporting SimUpgradeVersion. The
// "build" is a short text file: the simulated nodes never run it (they are
// goroutines of this process, and exec nothing).

// SimUpgradeVersion is the version of the simulated second build.
const SimUpgradeVersion = "v0.2.0"

// ReleaseKeyFile is dev's release key's file name under <dev.dataDir>/pki
// (PEM PKCS#8, 0600): it signs the simulated second build's manifest.
const ReleaseKeyFile = "release.key"

// simUpgradeValidFor is how long a start's manifest stays valid.
const simUpgradeValidFor = 30 * 24 * time.Hour

// ensureReleaseKey reads the Ed25519 release key at path, making it (0600)
// when there is none.
func ensureReleaseKey(path string) (ed25519.PrivateKey, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		return agentrelease.ParsePrivateKey(b)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return nil, err
	}
	return key, nil
}

// publishSimBuild publishes the simulated second build into dir, its URL
// under baseURL, signed with key, and returns its manifest's path. A build
// of an earlier start is replaced (its URL may name another port), with a
// counter above every manifest in dir.
func publishSimBuild(dir, baseURL string, key ed25519.PrivateKey) (string, error) {
	platform := runtime.GOOS + "/" + runtime.GOARCH
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	highest, err := artifacts.HighestCounter(dir)
	if err != nil {
		return "", err
	}
	name := fmt.Sprintf("bcd-%s-%s-%s", SimUpgradeVersion, runtime.GOOS, runtime.GOARCH)
	for _, p := range []string{filepath.Join(dir, name), filepath.Join(dir, name+artifacts.ManifestSuffix)} {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
	}
	src, err := os.CreateTemp("", "bcd-sim-build-*")
	if err != nil {
		return "", err
	}
	defer func() { _ = os.Remove(src.Name()) }()
	_, err = fmt.Fprintf(src, "simulated bcd %s (%s): better-compute dev's simulated nodes download and check this file, and never run it\n",
		SimUpgradeVersion, platform)
	if cerr := src.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	pub, err := artifacts.Publish(dir, src.Name(), artifacts.Release{Version: SimUpgradeVersion, Platform: platform, BaseURL: baseURL,
		NotAfter: time.Now().Add(simUpgradeValidFor), Counter: highest + 1}, key)
	if err != nil {
		return "", err
	}
	return pub.ManifestPath, nil
}

// loopbackBaseURL is the api role's URL on a loopback address (it may
// listen on every address): what the simulated nodes download from (a
// manifest's http URL must be a loopback one).
func loopbackBaseURL(env *Env) string {
	host, port, err := net.SplitHostPort(env.App.Addr())
	if err != nil {
		return env.BaseURL()
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

// simUpgradeBanner is the banner's lines on the second build.
func (e *Env) simUpgradeBanner() string {
	if e.Fleet == nil || e.SimUpgradeManifest == "" {
		return ""
	}
	return fmt.Sprintf("  Upgrade  a second simulated bcd build %s (manifest %s, signed with %s); roll pool \"sim\" to it:\n"+
		"           better-compute api rollouts.create tenantId=root poolId=%s change.updateMask=agent change.agent.releaseManifest=@%s 'strategy.batches:=[{\"percent\":50}]' strategy.bake=5s\n"+
		"           (each node downloads and checks it, then simulates the handover and reconnects as %s: better-compute api nodes.list tenantId=root)\n",
		SimUpgradeVersion, e.SimUpgradeManifest, e.ReleaseKeyPath, e.SimPoolID, e.SimUpgradeManifest, SimUpgradeVersion)
}
