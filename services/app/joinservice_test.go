package app_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// pki is an operator's key material, as files: the node CA and
// joinservice's HPKE key (what joinservice loads), and a gateway
// certificate signed by the CA with the trust bundle (what a relaying
// gateway loads).
type pki struct {
	ca                        *nodeca.CA
	key                       *joinservice.Key
	caFile, hpkeFile          string
	gwCert, gwKey, bundleFile string
}

func makePKI(t *testing.T, gatewayID string) pki {
	t.Helper()
	dir := t.TempDir()
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: "bettercompute.local", Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	key, err := joinservice.LoadOrCreateKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	p := pki{ca: ca, key: key, caFile: filepath.Join(dir, nodeca.DevFile), hpkeFile: filepath.Join(dir, joinservice.DevKeyFile)}
	gw, err := ca.ServingCertificate(gatewayID, []string{"127.0.0.1", "localhost"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	gwDir := t.TempDir()
	var certPEM, bundlePEM []byte
	for _, der := range gw.Certificate {
		certPEM = append(certPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	for _, der := range ca.TrustBundle() {
		bundlePEM = append(bundlePEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(gw.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	p.gwCert, p.gwKey, p.bundleFile = filepath.Join(gwDir, "gateway.crt"), filepath.Join(gwDir, "gateway.key"), filepath.Join(gwDir, "ca.pem")
	for f, b := range map[string][]byte{p.gwCert: certPEM, p.gwKey: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), p.bundleFile: bundlePEM} {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// freeAddr is a loopback address nothing listens on, so that a restarted
// joinservice comes back where the gateway dials it.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// joinToken mints a join token of uses in a fresh pool.
func joinToken(t *testing.T, db *pgxpool.Pool, uses int) string {
	t.Helper()
	ctx := context.Background()
	p, err := pools.Create(ctx, db, pools.Pool{ID: "pool_relay", TenantID: "root", Name: "relay", Class: pools.ClassGPU})
	if err != nil {
		t.Fatal(err)
	}
	s := jointoken.Mint()
	if _, err := jointoken.Create(ctx, db, jointoken.Token{ID: s.ID, TenantID: "root", PoolID: p.ID, Uses: uses}, s.Hash); err != nil {
		t.Fatal(err)
	}
	return s.Token
}

// joinServiceConfig is the standalone joinservice's configuration: the
// joinservice role only, with the CA and HPKE key files, on listen.
func joinServiceConfig(url string, p pki, listen string) *config.Config {
	c := testConfig(url)
	c.Roles = []string{"joinservice"}
	c.Server.NoMigrate = true
	c.JoinService.CACertFile, c.JoinService.CAKeyFile, c.JoinService.HPKEKeyFile = p.caFile, p.caFile, p.hpkeFile
	c.JoinService.Listen = listen
	return c
}

// TestGatewayRelaysToStandaloneJoinService runs joinservice and a gateway as
// two processes of their own (separate App instances, configurations and
// listeners, sharing only the database): a real simulated node joins
// through the gateway, which relays to joinservice over mutual TLS, and
// renews; the gateway holds no node CA, no HPKE key and no signing key;
// with joinservice down a Join is UNAVAILABLE naming the address, and
// joins again once joinservice is back.
func TestGatewayRelaysToStandaloneJoinService(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	db, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	p := makePKI(t, "gw-relay")
	jsAddr := freeAddr(t)
	jsApp := start(t, joinServiceConfig(url, p, jsAddr))
	if jsApp.JoinServiceAddr() != jsAddr || jsApp.GatewayAddr() != "" || !slices.Equal(jsApp.Roles(), []config.Role{config.RoleJoinService}) {
		t.Fatalf("joinservice process: listens %q, gateway %q, roles %v", jsApp.JoinServiceAddr(), jsApp.GatewayAddr(), jsApp.Roles())
	}

	// The gateway's configuration names key files that do not exist and an
	// empty key directory: a gateway that read or generated any of them
	// would fail to start or leave files behind.
	keyDir := t.TempDir()
	gc := testConfig(url)
	gc.Roles = []string{"gateway"}
	gc.Server.NoMigrate = true
	gc.Gateway.Listen, gc.Gateway.ID = "127.0.0.1:0", "gw-relay"
	gc.Gateway.JoinService = []string{jsAddr}
	gc.Gateway.JoinServiceTimeout = config.Duration(5 * time.Second)
	gc.Gateway.TLS = config.GatewayTLS{CertFile: p.gwCert, KeyFile: p.gwKey, CAFile: p.bundleFile}
	gc.JoinService.CACertFile, gc.JoinService.CAKeyFile = filepath.Join(keyDir, "absent-ca.pem"), filepath.Join(keyDir, "absent-ca.key")
	gc.JoinService.HPKEKeyFile, gc.JoinService.KeyDir = filepath.Join(keyDir, "absent-hpke.pem"), keyDir
	gc.Commands.SigningKeyFile = filepath.Join(keyDir, "absent-signing.key")
	gwApp := start(t, gc)
	if gwApp.JoinService() != nil || gwApp.JoinServiceAddr() != "" {
		t.Fatal("a relaying gateway holds a joinservice")
	}
	if dispatch, admit := gwApp.CommandKinds(); dispatch != admit {
		t.Fatal("a relaying gateway holds a command-signing view")
	}
	if left, _ := os.ReadDir(keyDir); len(left) != 0 {
		t.Fatalf("the gateway wrote key material: %v", left)
	}
	gwAddr := gwApp.GatewayAddr()
	token := joinToken(t, db, 3)
	roots := p.ca.Pool()

	// A real simulated node joins through the gateway and opens its session.
	ctx := t.Context()
	simRoot := t.TempDir()
	fleet, err := sim.Start(ctx, sim.Config{Gateway: gwAddr, ServerName: "127.0.0.1", RootCAs: roots, Token: token,
		JoinserviceKey: p.key.PublicKey(), Root: simRoot, NoLogFiles: true}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fleet.Stop)
	nodeID := fleet.Nodes()[0]
	poll.Until(t, 30*time.Second, "the node's session on the gateway", func() bool { return gwApp.GatewaySessions() == 1 })
	var gatewayID string
	if err := db.QueryRow(ctx, `SELECT gateway_id FROM nodes WHERE id = $1`, nodeID).Scan(&gatewayID); err != nil || gatewayID != "gw-relay" {
		t.Fatalf("node %s: gateway %q, %v", nodeID, gatewayID, err)
	}

	// Renew through the gateway with the node's own identity: joinservice
	// gets the node's chain from the gateway and issues a fresh certificate
	// for the node's key.
	st, err := state.Open(sim.NodeDir(simRoot, 0))
	if err != nil {
		t.Fatal(err)
	}
	renewed := renewVia(t, gwAddr, st)
	leaf, err := x509.ParseCertificate(renewed.GetCertificateChain()[0])
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.ca.VerifyNode(ctx, db, []*x509.Certificate{leaf}); err != nil || got != nodeID {
		t.Fatalf("renewed certificate: %q, %v", got, err)
	}
	old, _ := st.Identity()
	if oldLeaf, _ := old.Leaf(); oldLeaf.SerialNumber.Cmp(leaf.SerialNumber) == 0 {
		t.Fatal("Renew returned the old certificate")
	}

	// joinservice down: Join is UNAVAILABLE, naming the address.
	jsApp.Stop(context.Background())
	joinOnce := func(dir string) error {
		st, err := state.OpenUnsynced(dir)
		if err != nil {
			t.Fatal(err)
		}
		inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "relay-2", MachineID: "relay-2-machine", SystemSerial: "relay-2-serial"})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = inv.Close() }()
		_, err = join.Join(ctx, join.Config{Gateway: gwAddr, ServerName: "127.0.0.1", RootCAs: roots, Token: token,
			JoinserviceKey: p.key.PublicKey(), State: st, Claims: inv, Timeout: 20 * time.Second})
		return err
	}
	dir := t.TempDir()
	err = joinOnce(dir)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), jsAddr) {
		t.Fatalf("Join with joinservice down: %v, want UNAVAILABLE naming %s", err, jsAddr)
	}
	// Renew is UNAVAILABLE too, and no use of the token was spent.
	if _, err := renewCall(t, gwAddr, st); status.Code(err) != codes.Unavailable {
		t.Fatalf("Renew with joinservice down: %v, want UNAVAILABLE", err)
	}
	var left int
	if err := db.QueryRow(ctx, `SELECT uses_left FROM join_tokens`).Scan(&left); err != nil || left != 2 {
		t.Fatalf("token uses left %d (%v), want 2", left, err)
	}

	// joinservice back at its address: the node's retry joins.
	start(t, joinServiceConfig(url, p, jsAddr))
	poll.UntilNil(t, 30*time.Second, "a Join once joinservice is back", func() error {
		err := joinOnce(dir)
		if status.Code(err) == codes.Unavailable {
			time.Sleep(100 * time.Millisecond) // the node's retry back-off, not an assertion
			return err
		}
		if err != nil {
			t.Fatalf("Join after joinservice came back: %v", err)
		}
		return nil
	})
	var nodes int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM nodes`).Scan(&nodes); err != nil || nodes != 2 {
		t.Fatalf("%d nodes (%v), want 2", nodes, err)
	}
}

// renewCall calls NodeService.Renew on the gateway as the node of st.
func renewCall(t *testing.T, gwAddr string, st *state.Store) (*agentv1.RenewResponse, error) {
	t.Helper()
	id, err := st.Identity()
	if err != nil {
		t.Fatal(err)
	}
	key, err := st.Key()
	if err != nil {
		t.Fatal(err)
	}
	roots, err := id.Pool()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := st.CSR()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(gwAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: roots, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS13,
		Certificates: []tls.Certificate{{Certificate: id.Chain, PrivateKey: key}},
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	// A node cannot smuggle a chain of its choosing to joinservice: the
	// gateway forwards none of the node's metadata.
	ctx := metadata.AppendToOutgoingContext(t.Context(), joinservice.ChainMetadata, "forged")
	return agentv1.NewNodeServiceClient(conn).Renew(ctx, &agentv1.RenewRequest{Csr: csr})
}

func renewVia(t *testing.T, gwAddr string, st *state.Store) *agentv1.RenewResponse {
	t.Helper()
	resp, err := renewCall(t, gwAddr, st)
	if err != nil {
		t.Fatalf("Renew through the gateway: %v", err)
	}
	return resp
}

// A relaying gateway needs a certificate of its own: it has no CA to sign
// one.
func TestRelayingGatewayNeedsItsCertificate(t *testing.T) {
	t.Parallel()
	cfg := testConfig("postgres://nobody@127.0.0.1:1/none")
	cfg.Roles = []string{"gateway"}
	cfg.Gateway.JoinService = []string{"joinservice:8444"}
	_, err := app.New(cfg, app.Options{})
	var got []string
	for _, fe := range fault.All(err) {
		got = append(got, fe.Field)
	}
	if !slices.Equal(got, []string{"gateway.tls.certFile", "gateway.tls.caFile"}) {
		t.Fatalf("fields %v (%v)", got, err)
	}
}
