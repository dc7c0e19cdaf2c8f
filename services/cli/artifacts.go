package cli

import (
	"crypto/ed25519"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/artifacts"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// Files of `artifacts keygen`.
const (
	ReleaseKeyFile = "release.key" // the release signing key: PEM PKCS#8, 0600; keep it offline
	ReleasePubFile = "release.pub" // what bcd node --release-key pins
)

func newArtifacts(stdout io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "artifacts",
		Short: "Sign and publish bcd builds the api role serves (agent upgrades)",
		Long: "artifacts makes the release key (keygen) and publishes bcd builds with their signed release manifests " +
			"into the directory the api role serves at /artifacts/ (artifacts.dir), so an air-gapped site needs " +
			"nothing else to upgrade its agents (docs/agent-upgrades.md).",
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newArtifactsKeygen(stdout), newArtifactsPublish(stdout))
	return cmd
}

func newArtifactsKeygen(stdout io.Writer) *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "keygen --dir DIR",
		Short: "Make an Ed25519 release key (" + ReleaseKeyFile + ", 0600) and its public key (" + ReleasePubFile + ")",
		Long: "keygen writes the release signing key and the public key bcd pins with --release-key. The release key is " +
			"not the command-signing key: keep it off the control plane's hosts. It refuses to overwrite either file.",
		Args: cobra.NoArgs,
		RunE: func(_ *cobra.Command, _ []string) error {
			if dir == "" {
				return serve.Usage(errors.New("--dir is required"))
			}
			pub, priv, err := ed25519.GenerateKey(nil)
			if err != nil {
				return err
			}
			kder, err := x509.MarshalPKCS8PrivateKey(priv)
			if err != nil {
				return err
			}
			pder, err := x509.MarshalPKIXPublicKey(pub)
			if err != nil {
				return err
			}
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return err
			}
			for _, f := range []struct {
				name string
				data []byte
				mode os.FileMode
			}{
				{ReleaseKeyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600},
				{ReleasePubFile, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pder}), 0o644},
			} {
				fh, err := os.OpenFile(filepath.Join(dir, f.name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, f.mode)
				if err != nil {
					return err
				}
				_, err = fh.Write(f.data)
				if cerr := fh.Close(); err == nil {
					err = cerr
				}
				if err != nil {
					return err
				}
			}
			fmt.Fprintf(stdout, "wrote %s (keep it offline) and %s (bcd node --release-key); key id %s\n",
				filepath.Join(dir, ReleaseKeyFile), filepath.Join(dir, ReleasePubFile), agentrelease.KeyID(pub))
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory to write the keys into")
	return cmd
}

func newArtifactsPublish(stdout io.Writer) *cobra.Command {
	var version, keyFile, dir, baseURL, platform string
	var validFor time.Duration
	var counter uint64
	cmd := &cobra.Command{
		Use:   "publish FILE --version V --key FILE --dir DIR --base-url URL",
		Short: "Copy a bcd build into the artifacts directory and sign its release manifest",
		Long: "publish copies FILE (at most 512 MiB) into DIR as bcd-<version>-<os>-<arch> and writes its release manifest, " +
			"signed with the release key, beside it (<build>.manifest.json): version, the URL nodes download it from " +
			"(<base-url>/artifacts/<build>), SHA-256, size, platform, expiry and a counter one above the highest " +
			"already published in DIR (or --counter). Put the manifest's bytes in a node's agent section, or an " +
			"agent.upgrade command, to upgrade it.",
		Args: cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			switch {
			case version == "" || keyFile == "" || dir == "" || baseURL == "":
				return serve.Usage(errors.New("--version, --key, --dir and --base-url are required"))
			case validFor <= 0:
				return serve.Usage(fmt.Errorf("--valid-for: want a positive duration, got %s", validFor))
			}
			if _, err := agentrelease.ParseVersion(version); err != nil {
				return serve.Usage(fmt.Errorf("--version: %w", err))
			}
			if u, err := url.Parse(baseURL); err != nil || u.Host == "" || u.Path != "" && u.Path != "/" {
				return serve.Usage(fmt.Errorf("--base-url: want the api role's address, such as https://cp.example:8080, got %q", baseURL))
			}
			b, err := os.ReadFile(keyFile)
			if err != nil {
				return fmt.Errorf("--key: %w", err)
			}
			key, err := agentrelease.ParsePrivateKey(b)
			if err != nil {
				return fmt.Errorf("--key: %w", err)
			}
			p, err := artifacts.Publish(dir, args[0], artifacts.Release{Version: version, Platform: platform, BaseURL: baseURL,
				NotAfter: time.Now().Add(validFor), Counter: counter}, key)
			if err != nil {
				return err
			}
			m := p.Manifest
			fmt.Fprintf(stdout, "published %s (%d bytes, sha256 %s)\nmanifest %s: version %s, counter %d, expires %s, url %s\n",
				p.Build, m.Size, m.SHA256, p.ManifestPath, m.Version, m.Counter, m.NotAfter.Format(time.RFC3339), m.URL)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&version, "version", "", "the build's version, as it reports it (v0.3.1)")
	f.StringVar(&keyFile, "key", "", "the release key (PEM PKCS#8 Ed25519; artifacts keygen)")
	f.StringVar(&dir, "dir", "", "the artifacts directory the api role serves (artifacts.dir)")
	f.StringVar(&baseURL, "base-url", "", "the api role's address as nodes reach it (https://cp.example:8080)")
	f.StringVar(&platform, "platform", runtime.GOOS+"/"+runtime.GOARCH, "the build's GOOS/GOARCH")
	f.DurationVar(&validFor, "valid-for", 30*24*time.Hour, "how long the manifest is valid")
	f.Uint64Var(&counter, "counter", 0, "the manifest's counter (default: one above the highest published in --dir)")
	return cmd
}
