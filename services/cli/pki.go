package cli

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/keyfile"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/services/cli/serve"
	"github.com/bettercompute/bettercompute/services/dev"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// The files of a PKI directory (`pki init`), each 0600 in a 0700 directory.
// The key file names are dev's, so the two layouts agree where they can.
const (
	PKIRootCert    = "root-ca.crt"          // self-signed root (not with --intermediate-cert)
	PKIRootKey     = "root-ca.key"          // its key: keep it offline between rotations
	PKINodeCACert  = "node-ca.crt"          // joinService.caCertFile: the node CA, then its chain
	PKINodeCAKey   = "node-ca.key"          // joinService.caKeyFile
	PKIHPKEKey     = joinservice.DevKeyFile // joinService.hpkeKeyFile
	PKICommandKey  = dev.CommandKeyFile     // commands.signingKeyFile
	PKIAuditKey    = dev.AuditKeyFile       // audit.signingKeyFile
	PKISecretsKey  = dev.SecretsKeyFile     // secrets.keyFile: 32 raw bytes
	PKIExportCA    = "ca.pem"               // export: the trust bundle (bcd join --ca)
	PKIExportJoin  = "joinservice.pub"      // export: bcd join --joinservice-key (Key-Id header)
	PKIExportCmd   = "command-signing.pub"  // export: bcd node --command-key
	pkiDefaultTD   = "bettercompute.local"  // config's default joinService.trustDomain
	pkiBackupStamp = "20060102T150405Z"     // suffix of a rotated-out file: <name>.old-<stamp>
)

// The keys `pki rotate --what` replaces.
var pkiRotatable = []string{"ca", "joinservice", "command-signing", "audit"}

func newPKI(stdout io.Writer) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pki",
		Short: "Make, export and rotate the node CA, joinservice's HPKE key and the signing keys",
		Long: "pki makes the key material a deployment needs (docs/pki.md): the node CA (under a root of its own, or " +
			"an intermediate of the operator's root), joinservice's HPKE key, the command-signing key and the audit key, " +
			"as 0600 files; exports what nodes pin (the CA bundle, joinservice's public key with its key id, the " +
			"command-signing public key); and rotates each.",
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newPKIInit(stdout), newPKIExport(stdout), newPKIRotate(stdout), newPKIGatewayCert(stdout))
	return cmd
}

// pkiFile is one file pki init writes.
type pkiFile struct {
	name string
	data []byte
}

func newPKIInit(stdout io.Writer) *cobra.Command {
	var dir, td, interCert, interKey string
	var force, existOK bool
	cmd := &cobra.Command{
		Use:   "init --dir DIR",
		Short: "Make the node CA, joinservice's HPKE key, the command-signing key and the audit key",
		Long: "init writes, as 0600 files in DIR (0700): a self-signed root CA (" + PKIRootCert + ", " + PKIRootKey +
			") and the node CA it signs (" + PKINodeCACert + ", " + PKINodeCAKey + "), or, with --intermediate-cert " +
			"and --intermediate-key, the operator's intermediate as the node CA; joinservice's HPKE key (" + PKIHPKEKey +
			"); the command-signing key (" + PKICommandKey + "), the audit key (" + PKIAuditKey + ") and the key that " +
			"seals BMC credentials (" + PKISecretsKey + "). It refuses to overwrite a file unless --force, and prints " +
			"the configuration that uses them.",
		Args: cobra.NoArgs,
		RunE: func(_ *cobra.Command, _ []string) error {
			if dir == "" {
				return serve.Usage(errors.New("--dir is required"))
			}
			if (interCert == "") != (interKey == "") {
				return serve.Usage(errors.New("set --intermediate-cert and --intermediate-key together"))
			}
			abs, err := filepath.Abs(dir)
			if err != nil {
				return err
			}
			names := []string{PKINodeCACert, PKINodeCAKey, PKIHPKEKey, PKICommandKey, PKIAuditKey, PKISecretsKey}
			if interCert == "" {
				names = append([]string{PKIRootCert, PKIRootKey}, names...)
			}
			var present []string
			for _, n := range names {
				if _, err := os.Stat(filepath.Join(abs, n)); err == nil {
					present = append(present, n)
				} else if !errors.Is(err, fs.ErrNotExist) {
					return err
				}
			}
			if existOK && !force && len(present) == len(names)-1 && !slices.Contains(present, PKISecretsKey) {
				// A directory made before secrets.key existed: add it alone.
				if err := writePKIFiles(abs, []pkiFile{{PKISecretsKey, secrets.NewKey()}}, false); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "wrote %s (0600)\n", filepath.Join(abs, PKISecretsKey))
				present = append(present, PKISecretsKey)
			}
			if existOK && len(present) == len(names) && !force {
				if _, err := loadPKI(abs, td); err != nil {
					return fmt.Errorf("%s holds every file but they do not load: %w", abs, err)
				}
				fmt.Fprintf(stdout, "%s already holds the node CA and the keys; kept them.\n\n", abs)
				writeConfigLines(stdout, abs, td)
				return nil
			}
			if len(present) > 0 && !force {
				return fmt.Errorf("%s already has %s: refusing to overwrite (--force replaces them; `pki rotate` replaces one key)", abs, strings.Join(present, ", "))
			}
			files, err := makePKI(td, interCert, interKey)
			if err != nil {
				return err
			}
			if err := writePKIFiles(abs, files, force); err != nil {
				return err
			}
			m, err := loadPKI(abs, td)
			if err != nil {
				return fmt.Errorf("the files written do not load: %w", err)
			}
			for _, f := range files {
				fmt.Fprintf(stdout, "wrote %s (0600)\n", filepath.Join(abs, f.name))
			}
			fmt.Fprintf(stdout, "\nnode CA %q valid until %s; nodes pin %s\n", m.ca.Certificate().Subject.CommonName,
				m.ca.Certificate().NotAfter.UTC().Format(time.DateOnly), bundleNames(m.ca))
			if interCert == "" {
				fmt.Fprintf(stdout, "%s signs node CAs only (pki rotate --what ca): move it offline and bring it back to rotate.\n", PKIRootKey)
			} else if slices.ContainsFunc(m.ca.TrustBundle(), func(der []byte) bool { return bytes.Equal(der, m.ca.Certificate().Raw) }) {
				fmt.Fprintln(stdout, "warning: --intermediate-cert holds no root above the intermediate, so nodes pin the intermediate itself and a new one will need every node re-joined; append your root to the file.")
			}
			fmt.Fprintln(stdout)
			writeConfigLines(stdout, abs, td)
			fmt.Fprintf(stdout, "\nThen `better-compute pki export --dir %s --out DIR` writes what nodes need.\n", abs)
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "dir", "", "directory to write the files to (made 0700); required")
	fl.StringVar(&td, "trust-domain", pkiDefaultTD, "SPIFFE trust domain of node certificates (joinService.trustDomain)")
	fl.StringVar(&interCert, "intermediate-cert", "", "PEM: an intermediate CA signed by your own root, followed by its chain up to that root; it becomes the node CA")
	fl.StringVar(&interKey, "intermediate-key", "", "PEM private key of --intermediate-cert")
	fl.BoolVar(&force, "force", false, "overwrite existing files (every node must then be re-joined: prefer `pki rotate`)")
	fl.BoolVar(&existOK, "exist-ok", false, "succeed without writing when DIR already holds every file and they load (a one-shot that runs on every start)")
	return cmd
}

// makePKI generates every file of a PKI directory in memory.
func makePKI(td, interCert, interKey string) ([]pkiFile, error) {
	var files []pkiFile
	if interCert == "" {
		rootCert, rootKey, err := nodeca.GenerateRoot(td)
		if err != nil {
			return nil, err
		}
		caCert, caKey, err := nodeca.GenerateIntermediate(td, rootCert, rootKey)
		if err != nil {
			return nil, err
		}
		files = append(files, pkiFile{PKIRootCert, rootCert}, pkiFile{PKIRootKey, rootKey}, pkiFile{PKINodeCACert, caCert}, pkiFile{PKINodeCAKey, caKey})
	} else {
		caCert, caKey, err := readIntermediate(td, interCert, interKey)
		if err != nil {
			return nil, err
		}
		files = append(files, pkiFile{PKINodeCACert, caCert}, pkiFile{PKINodeCAKey, caKey})
	}
	hpke, err := newHPKEFile()
	if err != nil {
		return nil, err
	}
	files = append(files, pkiFile{PKIHPKEKey, hpke}, pkiFile{PKISecretsKey, secrets.NewKey()})
	for _, name := range []string{PKICommandKey, PKIAuditKey} {
		_, b, err := keyfile.NewEd25519()
		if err != nil {
			return nil, err
		}
		files = append(files, pkiFile{name, b})
	}
	return files, nil
}

// readIntermediate reads the operator's intermediate and checks that it is a
// CA the node CA can be (the key matches, it may sign).
func readIntermediate(td, certFile, keyFile string) (certPEM, keyPEM []byte, err error) {
	if certPEM, err = os.ReadFile(certFile); err != nil {
		return nil, nil, fmt.Errorf("--intermediate-cert: %w", err)
	}
	if keyPEM, err = os.ReadFile(keyFile); err != nil {
		return nil, nil, fmt.Errorf("--intermediate-key: %w", err)
	}
	if _, err := nodeca.Open(nodeca.Config{TrustDomain: td, CertFile: certFile, KeyFile: keyFile}); err != nil {
		return nil, nil, fmt.Errorf("--intermediate-cert: %w", err)
	}
	return certPEM, keyPEM, nil
}

func newHPKEFile() ([]byte, error) {
	k, err := joinservice.NewKey()
	if err != nil {
		return nil, err
	}
	return k.MarshalPEM()
}

// writePKIFiles writes files into dir, each 0600: a new file is created
// exclusively; with overwrite, a file is replaced by a rename of a
// temporary one, so a reader sees the old or the new content, never half.
func writePKIFiles(dir string, files []pkiFile, overwrite bool) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	for _, f := range files {
		if err := writeSecret(filepath.Join(dir, f.name), f.data, overwrite); err != nil {
			return err
		}
	}
	return nil
}

func writeSecret(path string, data []byte, overwrite bool) error {
	if !overwrite {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		if _, err := f.Write(data); err != nil {
			_ = f.Close()
			return err
		}
		return f.Close()
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := tmp.Write(data); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o600); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// pkiMaterial is a PKI directory loaded as the roles load it.
type pkiMaterial struct {
	ca      *nodeca.CA
	hpke    *joinservice.Key
	command *commands.Signer
	audit   *audit.Signer
}

// loadPKI loads dir's files with the loaders the roles use, and checks that
// a gateway certificate of the node CA verifies against its bundle.
func loadPKI(dir, td string) (*pkiMaterial, error) {
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: td, CertFile: filepath.Join(dir, PKINodeCACert), KeyFile: filepath.Join(dir, PKINodeCAKey)})
	if err != nil {
		return nil, err
	}
	if err := checkServing(ca, ca.BundlePEM()); err != nil {
		return nil, err
	}
	m := &pkiMaterial{ca: ca}
	if m.hpke, err = joinservice.LoadKey(filepath.Join(dir, PKIHPKEKey)); err != nil {
		return nil, err
	}
	if m.command, err = commands.LoadSigner(filepath.Join(dir, PKICommandKey)); err != nil {
		return nil, err
	}
	if m.audit, err = audit.LoadSigner(filepath.Join(dir, PKIAuditKey)); err != nil {
		return nil, err
	}
	if _, err := secrets.LoadKeyring(filepath.Join(dir, PKISecretsKey)); err != nil {
		return nil, err
	}
	return m, nil
}

// checkServing issues a gateway serving certificate from ca and verifies it
// against bundlePEM as a daemon does: the proof that nodes pinned to that
// bundle trust the gateways of this CA.
func checkServing(ca *nodeca.CA, bundlePEM []byte) error {
	cert, err := ca.ServingCertificate("pki-check", []string{"gateway.pki-check"}, time.Hour)
	if err != nil {
		return err
	}
	return verifyServing(cert, bundlePEM)
}

func verifyServing(cert tls.Certificate, bundlePEM []byte) error {
	return verifyServingFor(cert, bundlePEM, "gateway.pki-check")
}

func verifyServingFor(cert tls.Certificate, bundlePEM []byte, host string) error {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(bundlePEM) {
		return errors.New("the trust bundle holds no certificate")
	}
	inter := x509.NewCertPool()
	for _, der := range cert.Certificate[1:] {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return err
		}
		inter.AddCert(c)
	}
	if _, err := cert.Leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, DNSName: host}); err != nil {
		return fmt.Errorf("a gateway certificate of the node CA does not verify against the bundle: %w", err)
	}
	return nil
}

func bundleNames(ca *nodeca.CA) string {
	var names []string
	for _, der := range ca.TrustBundle() {
		if c, err := x509.ParseCertificate(der); err == nil {
			names = append(names, fmt.Sprintf("%q", c.Subject.CommonName))
		}
	}
	return strings.Join(names, ", ")
}

// writeConfigLines prints the configuration that uses dir's files, as YAML
// and as environment overrides.
func writeConfigLines(w io.Writer, dir, td string) {
	settings := pkiSettings(dir, td)
	fmt.Fprintln(w, "# The configuration that uses them (joinService: the joinservice role; commands and audit: api and controllers; secrets: api and metal):")
	section := ""
	for _, s := range settings {
		sec, key, _ := strings.Cut(s[0], ".")
		if sec != section {
			fmt.Fprintf(w, "%s:\n", sec)
			section = sec
		}
		fmt.Fprintf(w, "  %s: %s\n", key, s[1])
	}
	fmt.Fprintln(w, "# or, in the environment:")
	for _, s := range settings {
		fmt.Fprintf(w, "#   %s=%s\n", config.EnvName(s[0]), s[1])
	}
}

// pkiSettings are the configuration settings (YAML path, value) that use a
// PKI directory.
func pkiSettings(dir, td string) [][2]string {
	return [][2]string{
		{"joinService.trustDomain", td},
		{"joinService.caCertFile", filepath.Join(dir, PKINodeCACert)},
		{"joinService.caKeyFile", filepath.Join(dir, PKINodeCAKey)},
		{"joinService.hpkeKeyFile", filepath.Join(dir, PKIHPKEKey)},
		{"commands.signingKeyFile", filepath.Join(dir, PKICommandKey)},
		{"audit.signingKeyFile", filepath.Join(dir, PKIAuditKey)},
		{"secrets.keyFile", filepath.Join(dir, PKISecretsKey)},
	}
}

func newPKIExport(stdout io.Writer) *cobra.Command {
	var dir, out, td string
	cmd := &cobra.Command{
		Use:   "export --dir DIR --out OUT",
		Short: "Write what nodes pin: the CA bundle, joinservice's public key and the command-signing public key",
		Long: "export writes, 0644 in OUT: " + PKIExportCA + " (the node CA's trust bundle: bcd join --ca, bcsim --ca), " +
			PKIExportJoin + " (joinservice's HPKE public key with its Key-Id header: bcd join --joinservice-key) and " +
			PKIExportCmd + " (bcd node --command-key). None of them is secret; `better-compute join-script --export-dir " +
			"OUT` embeds them in a node's install script.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" || out == "" {
				return serve.Usage(errors.New("--dir and --out are required"))
			}
			td = pkiTrustDomain(cmd, dir, td)
			m, err := loadPKI(dir, td)
			if err != nil {
				return err
			}
			joinPEM, err := m.hpke.PublicKeyPEM()
			if err != nil {
				return err
			}
			cmdPEM, err := keyfile.PublicPEM(m.command.Public())
			if err != nil {
				return err
			}
			if err := os.MkdirAll(out, 0o755); err != nil {
				return err
			}
			for _, f := range []pkiFile{{PKIExportCA, m.ca.BundlePEM()}, {PKIExportJoin, joinPEM}, {PKIExportCmd, cmdPEM}} {
				path := filepath.Join(out, f.name)
				if err := os.WriteFile(path, f.data, 0o644); err != nil {
					return err
				}
				if err := os.Chmod(path, 0o644); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "wrote %s\n", path)
			}
			fmt.Fprintf(stdout, "\nCA bundle: %s\njoinservice key id: %s\ncommand-signing key id: %s\n", bundleNames(m.ca), m.hpke.ID(), m.command.KeyID)
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "dir", "", "the directory pki init wrote; required")
	fl.StringVar(&out, "out", "", "directory to write the public files to; required")
	fl.StringVar(&td, "trust-domain", pkiDefaultTD, "SPIFFE trust domain of the node CA (joinService.trustDomain); default the one in "+PKINodeCACert)
	return cmd
}

func newPKIRotate(stdout io.Writer) *cobra.Command {
	var dir, what, td, interCert, interKey string
	cmd := &cobra.Command{
		Use:   "rotate --dir DIR --what ca|joinservice|command-signing|audit",
		Short: "Replace one key, keeping the old file beside it",
		Long: "rotate replaces one key of DIR and keeps the old file as <name>.old-<time> (0600). ca: a new node CA " +
			"key and certificate signed by " + PKIRootKey + " (or, with --intermediate-cert and --intermediate-key, the " +
			"operator's new intermediate), so nodes pinned to the root keep trusting it; joinservice: a new HPKE key " +
			"(a new key id: install scripts need the new export); command-signing: a new key (nodes pinned to the old " +
			"one refuse destructive commands signed by the new one until they pin it); audit: a new checkpoint key. " +
			"docs/pki.md says the order of each rotation.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" || !slices.Contains(pkiRotatable, what) {
				return serve.Usage(fmt.Errorf("--dir and --what (one of %s) are required", strings.Join(pkiRotatable, ", ")))
			}
			td = pkiTrustDomain(cmd, dir, td)
			if (interCert == "") != (interKey == "") || (interCert != "" && what != "ca") {
				return serve.Usage(errors.New("--intermediate-cert and --intermediate-key go together, with --what ca"))
			}
			var files []pkiFile
			switch what {
			case "ca":
				var cert, key []byte
				var err error
				if interCert != "" {
					cert, key, err = readIntermediate(td, interCert, interKey)
				} else {
					var rootCert, rootKey []byte
					if rootCert, err = os.ReadFile(filepath.Join(dir, PKIRootCert)); err == nil {
						rootKey, err = os.ReadFile(filepath.Join(dir, PKIRootKey))
					}
					if err != nil {
						return fmt.Errorf("a new node CA is signed by the root in %s (or pass --intermediate-cert): %w", dir, err)
					}
					cert, key, err = nodeca.GenerateIntermediate(td, rootCert, rootKey)
				}
				if err != nil {
					return err
				}
				files = []pkiFile{{PKINodeCACert, cert}, {PKINodeCAKey, key}}
			case "joinservice":
				b, err := newHPKEFile()
				if err != nil {
					return err
				}
				files = []pkiFile{{PKIHPKEKey, b}}
			default:
				_, b, err := keyfile.NewEd25519()
				if err != nil {
					return err
				}
				name := PKICommandKey
				if what == "audit" {
					name = PKIAuditKey
				}
				files = []pkiFile{{name, b}}
			}
			before, err := loadPKI(dir, td)
			if err != nil {
				return fmt.Errorf("%s does not load as it is: %w", dir, err)
			}
			stamp := time.Now().UTC().Format(pkiBackupStamp)
			for _, f := range files {
				path := filepath.Join(dir, f.name)
				old, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				if err := writeSecret(path+".old-"+stamp, old, false); err != nil {
					return fmt.Errorf("keep the old %s: %w", f.name, err)
				}
			}
			if err := writePKIFiles(dir, files, true); err != nil {
				return err
			}
			after, err := loadPKI(dir, td)
			if err != nil {
				return fmt.Errorf("the rotated files do not load (the old ones are kept as *.old-%s): %w", stamp, err)
			}
			for _, f := range files {
				fmt.Fprintf(stdout, "replaced %s (the old one is %s.old-%s)\n", filepath.Join(dir, f.name), f.name, stamp)
			}
			switch what {
			case "ca":
				if err := checkServing(after.ca, before.ca.BundlePEM()); err != nil {
					fmt.Fprintf(stdout, "warning: nodes pinned to the old bundle will not trust the new node CA (%v): they must be re-joined with the new export\n", err)
				} else {
					fmt.Fprintf(stdout, "nodes pinned to %s trust the new node CA; restart joinservice (and gateways, for their serving certificates). Node certificates renew under it within %s.\n", bundleNames(before.ca), nodeca.SVIDValidity)
				}
			case "joinservice":
				fmt.Fprintf(stdout, "joinservice key id %s → %s: restart joinservice, then re-export; install scripts made before carry the old key and their joins are refused until remade. Joined nodes are not affected.\n", before.hpke.ID(), after.hpke.ID())
			case "command-signing":
				fmt.Fprintf(stdout, "command-signing key id %s → %s: re-export and give every node the new %s (bcd node --command-key), then restart api and controllers. Until a node pins the new key it refuses destructive commands signed with it.\n", before.command.KeyID, after.command.KeyID, PKIExportCmd)
			case "audit":
				fmt.Fprintf(stdout, "audit key id %s → %s: restart api and controllers. Checkpoints signed before carry the old key id; keep the old file to verify them.\n", before.audit.KeyID(), after.audit.KeyID())
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "dir", "", "the directory pki init wrote; required")
	fl.StringVar(&what, "what", "", "the key to replace: "+strings.Join(pkiRotatable, ", "))
	fl.StringVar(&td, "trust-domain", pkiDefaultTD, "SPIFFE trust domain of the node CA (joinService.trustDomain); default the one in "+PKINodeCACert)
	fl.StringVar(&interCert, "intermediate-cert", "", "with --what ca: the operator's new intermediate (PEM, with its chain)")
	fl.StringVar(&interKey, "intermediate-key", "", "with --what ca: its private key")
	return cmd
}

// pkiTrustDomain is --trust-domain when given, else the trust domain in the
// SPIFFE URI of dir's node CA certificate (pki init puts it there), else
// the flag's default.
func pkiTrustDomain(cmd *cobra.Command, dir, td string) string {
	if cmd.Flags().Changed("trust-domain") {
		return td
	}
	b, err := os.ReadFile(filepath.Join(dir, PKINodeCACert))
	if err != nil {
		return td
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		return td
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return td
	}
	for _, u := range c.URIs {
		if u.Scheme == "spiffe" && u.Host != "" {
			return u.Host
		}
	}
	return td
}

// The files `pki gateway-cert` writes.
const (
	PKIGatewayCert = "gateway.crt" // gateway.tls.certFile: leaf, then the node CA's chain
	PKIGatewayKey  = "gateway.key" // gateway.tls.keyFile
)

func newPKIGatewayCert(stdout io.Writer) *cobra.Command {
	var dir, out, td, id string
	var hosts []string
	var validity time.Duration
	cmd := &cobra.Command{
		Use:   "gateway-cert --dir DIR --id ID --host NAME... --out OUT",
		Short: "Issue a gateway's own certificate from the node CA (gateway.tls, for a gateway that relays to joinservice)",
		Long: "gateway-cert signs, with DIR's node CA, a certificate for gateway ID (URI SAN spiffe://<trust domain>/gateway/<id>, " +
			"the --host names, server and client authentication) and writes " + PKIGatewayCert + ", " + PKIGatewayKey +
			" (0600) and " + PKIExportCA + " (the bundle) to OUT: gateway.tls.certFile, keyFile and caFile. Issue it again " +
			"before it expires (--validity) and after `pki rotate --what ca`.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" || out == "" || id == "" || len(hosts) == 0 {
				return serve.Usage(errors.New("--dir, --id, --host and --out are required"))
			}
			if validity <= 0 || validity > 366*24*time.Hour {
				return serve.Usage(errors.New("--validity: expected a duration up to 8784h"))
			}
			td = pkiTrustDomain(cmd, dir, td)
			ca, err := nodeca.Open(nodeca.Config{TrustDomain: td, CertFile: filepath.Join(dir, PKINodeCACert), KeyFile: filepath.Join(dir, PKINodeCAKey)})
			if err != nil {
				return err
			}
			cert, err := ca.ServingCertificate(id, hosts, validity)
			if err != nil {
				return err
			}
			if err := verifyServingFor(cert, ca.BundlePEM(), hosts[0]); err != nil {
				return err
			}
			var chain []byte
			for _, der := range cert.Certificate {
				chain = append(chain, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
			}
			keyDER, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
			if err != nil {
				return err
			}
			files := []pkiFile{{PKIGatewayCert, chain}, {PKIGatewayKey, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})}, {PKIExportCA, ca.BundlePEM()}}
			if err := writePKIFiles(out, files, true); err != nil {
				return err
			}
			for _, f := range files {
				fmt.Fprintf(stdout, "wrote %s (0600)\n", filepath.Join(out, f.name))
			}
			fmt.Fprintf(stdout, "gateway %s certificate valid until %s\n", id, cert.Leaf.NotAfter.UTC().Format(time.RFC3339))
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&dir, "dir", "", "the directory pki init wrote; required")
	fl.StringVar(&out, "out", "", "directory to write the certificate, key and bundle to; required")
	fl.StringVar(&id, "id", "", "the gateway's id (gateway.id); required")
	fl.StringSliceVar(&hosts, "host", nil, "a DNS name or IP daemons and joinservice reach the gateway at; repeatable; required")
	fl.DurationVar(&validity, "validity", 30*24*time.Hour, "how long the certificate is valid")
	fl.StringVar(&td, "trust-domain", pkiDefaultTD, "SPIFFE trust domain of the node CA; default the one in "+PKINodeCACert)
	return cmd
}
