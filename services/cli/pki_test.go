package cli_test

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/cli/serve"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// bc runs the CLI and returns its exit code, stdout and stderr.
func bc(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	rc := cli.Main(args, &out, &errb)
	return rc, out.String(), errb.String()
}

func mustBC(t *testing.T, args ...string) string {
	t.Helper()
	rc, out, errs := bc(t, args...)
	if rc != 0 {
		t.Fatalf("better-compute %v: exit %d\n%s%s", args, rc, out, errs)
	}
	return out
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

func read(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// configFromInit writes the YAML pki init printed to a file and loads it as
// every process does.
func configFromInit(t *testing.T, out string) *config.Config {
	t.Helper()
	i := strings.Index(out, "\njoinService:\n")
	j := strings.Index(out, "# or, in the environment")
	if i < 0 || j < i {
		t.Fatalf("pki init printed no configuration:\n%s", out)
	}
	p := filepath.Join(t.TempDir(), "bc.yaml")
	if err := os.WriteFile(p, []byte(out[i:j]), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(config.LoadOptions{Path: p, LookupEnv: func(string) (string, bool) { return "", false }})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := cfg.RequireJoinServiceKeys(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestPKIInit: pki init makes every key as a 0600 file, prints the
// configuration that loads them with the roles' own loaders, refuses to
// overwrite, and keeps what is there with --exist-ok.
func TestPKIInit(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "pki")
	out := mustBC(t, "pki", "init", "--dir", dir, "--trust-domain", "fleet.example")
	if mode(t, dir) != 0o700 {
		t.Errorf("dir mode %v, want 0700", mode(t, dir))
	}
	names := []string{cli.PKIRootCert, cli.PKIRootKey, cli.PKINodeCACert, cli.PKINodeCAKey, cli.PKIHPKEKey, cli.PKICommandKey, cli.PKIAuditKey, cli.PKISecretsKey}
	for _, n := range names {
		if m := mode(t, filepath.Join(dir, n)); m != 0o600 {
			t.Errorf("%s: mode %v, want 0600", n, m)
		}
		if !strings.Contains(out, "wrote "+filepath.Join(dir, n)) {
			t.Errorf("pki init does not say it wrote %s:\n%s", n, out)
		}
	}

	cfg := configFromInit(t, out)
	js := cfg.JoinService
	if js.TrustDomain != "fleet.example" {
		t.Errorf("trust domain %q", js.TrustDomain)
	}
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: js.TrustDomain, CertFile: js.CACertFile, KeyFile: js.CAKeyFile})
	if err != nil {
		t.Fatal(err)
	}
	// The node CA is not the root: nodes pin the root, so the node CA can
	// be rotated under it.
	root := read(t, filepath.Join(dir, cli.PKIRootCert))
	if got := ca.BundlePEM(); !bytes.Equal(got, root) {
		t.Errorf("the bundle is not the root:\n%s", got)
	}
	if bytes.Equal(ca.Certificate().Raw, pemDER(t, root)) {
		t.Error("the node CA is the root itself")
	}
	if _, err := joinservice.LoadKey(js.HPKEKeyFile); err != nil {
		t.Error(err)
	}
	if _, err := commands.LoadSigner(cfg.Commands.SigningKeyFile); err != nil {
		t.Error(err)
	}
	if _, err := audit.LoadSigner(cfg.Audit.SigningKeyFile); err != nil {
		t.Error(err)
	}
	if kr, err := secrets.LoadKeyring(cfg.Secrets.KeyFile); err != nil || len(read(t, cfg.Secrets.KeyFile)) != secrets.KeySize {
		t.Errorf("secrets key %s: %v %v, want 32 bytes that load", cfg.Secrets.KeyFile, kr, err)
	}
	// Every BC_ line it prints is a real setting.
	for line := range strings.SplitSeq(out, "\n") {
		if name, _, ok := strings.Cut(strings.TrimPrefix(line, "#   "), "="); ok && strings.HasPrefix(name, "BC_") && !isEnvVar(name) {
			t.Errorf("pki init prints %s, which is no setting", name)
		}
	}

	before := read(t, filepath.Join(dir, cli.PKICommandKey))
	rc, _, errs := bc(t, "pki", "init", "--dir", dir)
	if rc == 0 || !strings.Contains(errs, "refusing to overwrite") {
		t.Errorf("a second init: exit %d, %q; want a refusal", rc, errs)
	}
	if !bytes.Equal(read(t, filepath.Join(dir, cli.PKICommandKey)), before) {
		t.Error("a refused init changed the command-signing key")
	}
	if out := mustBC(t, "pki", "init", "--dir", dir, "--trust-domain", "fleet.example", "--exist-ok"); !strings.Contains(out, "kept them") {
		t.Errorf("--exist-ok: %s", out)
	}
	if !bytes.Equal(read(t, filepath.Join(dir, cli.PKICommandKey)), before) {
		t.Error("--exist-ok changed the command-signing key")
	}
	// A directory made before secrets.key existed gets it under --exist-ok,
	// and keeps everything else.
	secretsKey := read(t, filepath.Join(dir, cli.PKISecretsKey))
	if err := os.Remove(filepath.Join(dir, cli.PKISecretsKey)); err != nil {
		t.Fatal(err)
	}
	if out := mustBC(t, "pki", "init", "--dir", dir, "--trust-domain", "fleet.example", "--exist-ok"); !strings.Contains(out, "wrote "+filepath.Join(dir, cli.PKISecretsKey)) || !strings.Contains(out, "kept them") {
		t.Errorf("--exist-ok without secrets.key: %s", out)
	}
	if got := read(t, filepath.Join(dir, cli.PKISecretsKey)); len(got) != secrets.KeySize || bytes.Equal(got, secretsKey) || mode(t, filepath.Join(dir, cli.PKISecretsKey)) != 0o600 {
		t.Errorf("the added secrets key: %d bytes, mode %v", len(got), mode(t, filepath.Join(dir, cli.PKISecretsKey)))
	}
	if !bytes.Equal(read(t, filepath.Join(dir, cli.PKICommandKey)), before) {
		t.Error("adding secrets.key changed the command-signing key")
	}
	// Half a directory is not kept: it is refused.
	if err := os.Remove(filepath.Join(dir, cli.PKIAuditKey)); err != nil {
		t.Fatal(err)
	}
	if rc, _, _ := bc(t, "pki", "init", "--dir", dir, "--exist-ok"); rc == 0 {
		t.Error("--exist-ok accepted a directory missing the audit key")
	}
	mustBC(t, "pki", "init", "--dir", dir, "--force")
	if bytes.Equal(read(t, filepath.Join(dir, cli.PKICommandKey)), before) {
		t.Error("--force kept the command-signing key")
	}
	if m := mode(t, filepath.Join(dir, cli.PKICommandKey)); m != 0o600 {
		t.Errorf("after --force: mode %v", m)
	}
}

func isEnvVar(name string) bool {
	for _, v := range config.EnvVars() {
		if strings.HasPrefix(v[1], name+",") || v[1] == name {
			return true
		}
	}
	return false
}

func pemDER(t *testing.T, b []byte) []byte {
	t.Helper()
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatal("no PEM block")
	}
	return blk.Bytes
}

// TestPKIExport: export writes, 0644, the files in the formats bcd reads:
// the bundle, joinservice's key with the key id joinservice uses, and the
// command-signing public key.
func TestPKIExport(t *testing.T) {
	t.Parallel()
	dir, out := filepath.Join(t.TempDir(), "pki"), filepath.Join(t.TempDir(), "public")
	mustBC(t, "pki", "init", "--dir", dir)
	mustBC(t, "pki", "export", "--dir", dir, "--out", out)
	for _, n := range []string{cli.PKIExportCA, cli.PKIExportJoin, cli.PKIExportCmd} {
		if m := mode(t, filepath.Join(out, n)); m != 0o644 {
			t.Errorf("%s: mode %v, want 0644", n, m)
		}
	}
	key, err := joinservice.LoadKey(filepath.Join(dir, cli.PKIHPKEKey))
	if err != nil {
		t.Fatal(err)
	}
	pub, id, err := join.ParsePublicKey(read(t, filepath.Join(out, cli.PKIExportJoin)))
	if err != nil {
		t.Fatal(err)
	}
	if id != key.ID() || !bytes.Equal(pub, key.PublicKey()) {
		t.Errorf("exported joinservice key %x (id %q), want %x (id %q)", pub, id, key.PublicKey(), key.ID())
	}
	signer, err := commands.LoadSigner(filepath.Join(dir, cli.PKICommandKey))
	if err != nil {
		t.Fatal(err)
	}
	cmdPub, err := command.ParsePublicKey(read(t, filepath.Join(out, cli.PKIExportCmd)))
	if err != nil {
		t.Fatal(err)
	}
	if !cmdPub.Equal(signer.Public()) {
		t.Error("the exported command-signing key is not the signer's")
	}
	if !bytes.Equal(read(t, filepath.Join(out, cli.PKIExportCA)), read(t, filepath.Join(dir, cli.PKIRootCert))) {
		t.Error("the exported bundle is not the root")
	}
	// A gateway certificate of the node CA verifies against the export.
	ca := openCA(t, dir, "bettercompute.local")
	verifyGateway(t, ca, read(t, filepath.Join(out, cli.PKIExportCA)))
}

func openCA(t *testing.T, dir, td string) *nodeca.CA {
	t.Helper()
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: td, CertFile: filepath.Join(dir, cli.PKINodeCACert), KeyFile: filepath.Join(dir, cli.PKINodeCAKey)})
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// verifyGateway checks that a gateway certificate of ca verifies against
// bundle, as a daemon pinned to it checks the gateway.
func verifyGateway(t *testing.T, ca *nodeca.CA, bundle []byte) {
	t.Helper()
	if err := gatewayVerifies(ca, bundle); err != nil {
		t.Fatal(err)
	}
}

func gatewayVerifies(ca *nodeca.CA, bundle []byte) error {
	cert, err := ca.ServingCertificate("gw-1", []string{"gw.test"}, time.Hour)
	if err != nil {
		return err
	}
	return verifyChain(cert, bundle)
}

func verifyChain(cert tls.Certificate, bundle []byte) error {
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	roots.AppendCertsFromPEM(bundle)
	for _, der := range cert.Certificate[1:] {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return err
		}
		inter.AddCert(c)
	}
	_, err := cert.Leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, DNSName: "gw.test"})
	return err
}

// TestPKIRotate rotates each key and checks what nodes see: a new node CA
// that nodes pinned to the old export still trust; a command signed with a
// new command key that a node pinned to the old one refuses; a join token
// sealed to the old joinservice key that the new key cannot open.
func TestPKIRotate(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "pki")
	old, cur := filepath.Join(t.TempDir(), "old"), filepath.Join(t.TempDir(), "new")
	mustBC(t, "pki", "init", "--dir", dir, "--trust-domain", "fleet.example")
	mustBC(t, "pki", "export", "--dir", dir, "--out", old)
	oldCA := openCA(t, dir, "fleet.example")
	oldHPKE, err := joinservice.LoadKey(filepath.Join(dir, cli.PKIHPKEKey))
	if err != nil {
		t.Fatal(err)
	}

	for _, what := range []string{"ca", "joinservice", "command-signing", "audit"} {
		out := mustBC(t, "pki", "rotate", "--dir", dir, "--what", what)
		if !strings.Contains(out, "replaced ") {
			t.Errorf("rotate %s: %s", what, out)
		}
	}
	// The trust domain came from the node CA certificate, not the default.
	mustBC(t, "pki", "export", "--dir", dir, "--out", cur)
	olds, err := filepath.Glob(filepath.Join(dir, "*.old-*"))
	if err != nil || len(olds) != 5 {
		t.Fatalf("kept %v (%v), want the 5 replaced files", olds, err)
	}
	for _, f := range olds {
		if m := mode(t, f); m != 0o600 {
			t.Errorf("%s: mode %v", f, m)
		}
	}

	// CA: a new node CA under the same root: the bundle nodes pinned at
	// join is unchanged and trusts the new CA's gateways.
	newCA := openCA(t, dir, "fleet.example")
	if newCA.Certificate().Equal(oldCA.Certificate()) {
		t.Fatal("rotate ca kept the node CA")
	}
	if !bytes.Equal(read(t, filepath.Join(old, cli.PKIExportCA)), read(t, filepath.Join(cur, cli.PKIExportCA))) {
		t.Error("rotating the node CA changed the bundle nodes pin")
	}
	verifyGateway(t, newCA, read(t, filepath.Join(old, cli.PKIExportCA)))

	// Command signing: a node pinned to the old key refuses a command
	// signed with the new one (the daemon's own check) until it pins the
	// new export.
	oldPub, err := command.ParsePublicKey(read(t, filepath.Join(old, cli.PKIExportCmd)))
	if err != nil {
		t.Fatal(err)
	}
	newPub, err := command.ParsePublicKey(read(t, filepath.Join(cur, cli.PKIExportCmd)))
	if err != nil {
		t.Fatal(err)
	}
	signer, err := commands.LoadSigner(filepath.Join(dir, cli.PKICommandKey))
	if err != nil {
		t.Fatal(err)
	}
	c := &agentv1.Command{Id: "cmd_1", NodeId: "node_1", Kind: "node.reboot", Seq: 1, KeyId: signer.KeyID, Body: []byte(`{}`)}
	commandsig.Sign(c, "fleet.example", signer.Key)
	if err := commandsig.Verify(c, "fleet.example", oldPub); err == nil {
		t.Error("a node pinned to the old command key accepted a command signed with the new one")
	}
	if err := commandsig.Verify(c, "fleet.example", newPub); err != nil {
		t.Errorf("a node pinned to the new export refused: %v", err)
	}

	// joinservice: a new key id; a token sealed to the old key (an install
	// script made before) is not opened by the new key.
	pub, id, err := join.ParsePublicKey(read(t, filepath.Join(cur, cli.PKIExportJoin)))
	if err != nil {
		t.Fatal(err)
	}
	if id == oldHPKE.ID() || bytes.Equal(pub, oldHPKE.PublicKey()) {
		t.Fatal("rotate joinservice kept the key")
	}
	newHPKE, err := joinservice.LoadKey(filepath.Join(dir, cli.PKIHPKEKey))
	if err != nil {
		t.Fatal(err)
	}
	csr := []byte("csr")
	enc, ct, err := join.Seal(oldHPKE.PublicKey(), "bcjt_x.y", csr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := newHPKE.Open(enc, ct, csr); err == nil {
		t.Error("the new joinservice key opened a token sealed to the old one")
	}
	if got, err := oldHPKE.Open(enc, ct, csr); err != nil || string(got) != "bcjt_x.y" {
		t.Errorf("the old key: %q, %v", got, err)
	}

	if rc, _, _ := bc(t, "pki", "rotate", "--dir", dir, "--what", "everything"); rc != serve.ExitConfig {
		t.Errorf("rotate --what everything: exit %d, want %d", rc, serve.ExitConfig)
	}
}

// TestPKIIntermediate: with the operator's intermediate (and its root in the
// same file), the node CA is that intermediate and nodes pin the operator's
// root; a new intermediate from the same root rotates it.
func TestPKIIntermediate(t *testing.T) {
	t.Parallel()
	tmp := t.TempDir()
	rootCert, rootKey := testCA(t, "operator root", nil, nil, 1)
	writeInter := func(name string) (string, string) {
		c, k := testCA(t, name, rootCert, rootKey, 0)
		certFile, keyFile := filepath.Join(tmp, name+".crt"), filepath.Join(tmp, name+".key")
		chain := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw}), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: rootCert.Raw})...)
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(certFile, chain, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return certFile, keyFile
	}
	cert1, key1 := writeInter("intermediate-1")
	dir, out := filepath.Join(tmp, "pki"), filepath.Join(tmp, "public")
	mustBC(t, "pki", "init", "--dir", dir, "--intermediate-cert", cert1, "--intermediate-key", key1)
	if _, err := os.Stat(filepath.Join(dir, cli.PKIRootKey)); err == nil {
		t.Error("pki init made a root of its own beside the operator's")
	}
	mustBC(t, "pki", "export", "--dir", dir, "--out", out)
	bundle := read(t, filepath.Join(out, cli.PKIExportCA))
	if !bytes.Equal(pemDER(t, bundle), rootCert.Raw) {
		t.Error("nodes do not pin the operator's root")
	}
	ca := openCA(t, dir, "bettercompute.local")
	if ca.Certificate().Subject.CommonName != "intermediate-1" {
		t.Errorf("node CA %q", ca.Certificate().Subject.CommonName)
	}
	verifyGateway(t, ca, bundle)

	cert2, key2 := writeInter("intermediate-2")
	mustBC(t, "pki", "rotate", "--dir", dir, "--what", "ca", "--intermediate-cert", cert2, "--intermediate-key", key2)
	ca = openCA(t, dir, "bettercompute.local")
	if ca.Certificate().Subject.CommonName != "intermediate-2" {
		t.Errorf("after rotation: node CA %q", ca.Certificate().Subject.CommonName)
	}
	verifyGateway(t, ca, bundle)

	// A key that is not the intermediate's is refused.
	if rc, _, _ := bc(t, "pki", "init", "--dir", filepath.Join(tmp, "bad"), "--intermediate-cert", cert1, "--intermediate-key", key2); rc == 0 {
		t.Error("pki init took a key that does not match the intermediate")
	}
	// Without the root in the file, the node's pin is the intermediate,
	// and pki init says so.
	only := filepath.Join(tmp, "only.crt")
	if err := os.WriteFile(only, read(t, cert1)[:bytes.Index(read(t, cert1), []byte("-----END CERTIFICATE-----"))+len("-----END CERTIFICATE-----\n")], 0o600); err != nil {
		t.Fatal(err)
	}
	if o := mustBC(t, "pki", "init", "--dir", filepath.Join(tmp, "only"), "--intermediate-cert", only, "--intermediate-key", key1); !strings.Contains(o, "warning: --intermediate-cert holds no root") {
		t.Errorf("no warning for an intermediate without its root:\n%s", o)
	}
}

func testCA(t *testing.T, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, pathLen int) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, MaxPathLen: pathLen, MaxPathLenZero: pathLen == 0,
	}
	signer, signerKey := tmpl, key
	if parent != nil {
		signer, signerKey = parent, parentKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c, key
}

// TestPKIGatewayCert: a gateway's own certificate, signed by the node CA,
// with its SPIFFE ID and names, that verifies against the bundle nodes pin
// (as a server and as joinservice's client), and a 0600 key.
func TestPKIGatewayCert(t *testing.T) {
	t.Parallel()
	dir, out, public := filepath.Join(t.TempDir(), "pki"), filepath.Join(t.TempDir(), "tls"), filepath.Join(t.TempDir(), "public")
	mustBC(t, "pki", "init", "--dir", dir, "--trust-domain", "fleet.example")
	mustBC(t, "pki", "export", "--dir", dir, "--out", public)
	mustBC(t, "pki", "gateway-cert", "--dir", dir, "--id", "gw-1", "--host", "gw.test", "--host", "10.0.0.1", "--out", out)
	if m := mode(t, filepath.Join(out, cli.PKIGatewayKey)); m != 0o600 {
		t.Errorf("key mode %v", m)
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(out, cli.PKIGatewayCert), filepath.Join(out, cli.PKIGatewayKey))
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	cert.Leaf = leaf
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != "spiffe://fleet.example/gateway/gw-1" || len(leaf.IPAddresses) != 1 {
		t.Errorf("URIs %v, IPs %v", leaf.URIs, leaf.IPAddresses)
	}
	bundle := read(t, filepath.Join(public, cli.PKIExportCA))
	if !bytes.Equal(read(t, filepath.Join(out, cli.PKIExportCA)), bundle) {
		t.Error("gateway-cert's bundle is not the export's")
	}
	if err := verifyChain(cert, bundle); err != nil {
		t.Fatal(err)
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	roots.AppendCertsFromPEM(bundle)
	for _, der := range cert.Certificate[1:] {
		c, _ := x509.ParseCertificate(der)
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("not a client certificate for joinservice: %v", err)
	}
	if rc, _, _ := bc(t, "pki", "gateway-cert", "--dir", dir, "--id", "gw-1", "--out", out); rc != serve.ExitConfig {
		t.Errorf("without --host: exit %d", rc)
	}
}
