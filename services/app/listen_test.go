package app_test

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

// writeCert makes a CA-signed certificate for 127.0.0.1 (server) or a
// client, writes it and its key as PEM under dir, and returns the paths.
func writeCert(t *testing.T, dir, name string, ca *x509.Certificate, caKey *ecdsa.PrivateKey, server bool) (certFile, keyFile string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)}
	if server {
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	} else {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key")
	_ = os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	_ = os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return certFile, keyFile
}

func newTestCA(t *testing.T, dir string) (*x509.Certificate, *ecdsa.PrivateKey, string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(der)
	file := filepath.Join(dir, "ca.pem")
	_ = os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	return ca, key, file
}

// TestTheAPIServesOverMutualTLS: with server.tls set, gRPC and REST are
// served over TLS (HTTP/2 by ALPN) and plain HTTP is refused; with a client
// CA, a client without a certificate fails the handshake.
func TestTheAPIServesOverMutualTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca, caKey, caFile := newTestCA(t, dir)
	certFile, keyFile := writeCert(t, dir, "server", ca, caKey, true)
	clientCert, clientKey := writeCert(t, dir, "client", ca, caKey, false)
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{string(config.RoleAPI)}
	cfg.Server.TLS = config.ServerTLS{CertFile: certFile, KeyFile: keyFile, ClientCAFile: caFile}
	a := start(t, cfg)

	roots := x509.NewCertPool()
	roots.AddCert(ca)
	cc, err := tls.LoadX509KeyPair(clientCert, clientKey)
	if err != nil {
		t.Fatal(err)
	}
	withCert := &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cc}, MinVersion: tls.VersionTLS12}
	conn, err := grpc.NewClient(a.Addr(), grpc.WithTransportCredentials(credentials.NewTLS(withCert)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if v, err := computev1.NewSystemServiceClient(conn).Version(t.Context(), &computev1.VersionRequest{}); err != nil || v.GetVersion() == "" {
		t.Fatalf("gRPC over mutual TLS: %v %v", v, err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: withCert, ForceAttemptHTTP2: true}}
	resp, err := hc.Post("https://"+a.Addr()+"/api/compute/system/version", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatalf("REST over mutual TLS: %v", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.ProtoMajor != 2 {
		t.Fatalf("REST over mutual TLS: %d over HTTP/%d", resp.StatusCode, resp.ProtoMajor)
	}
	noCert := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	if resp, err := noCert.Post("https://"+a.Addr()+"/api/compute/system/version", "application/json", strings.NewReader(`{}`)); err == nil {
		_ = resp.Body.Close()
		t.Fatalf("a client without a certificate got %d, want a failed handshake", resp.StatusCode)
	}
	if resp, err := http.Post("http://"+a.Addr()+"/api/compute/system/version", "application/json", strings.NewReader(`{}`)); err == nil {
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("plain HTTP answered on the TLS port")
		}
	}
}

// TestTheAdminListenerTakesMetricsPprofAndReflection: with server.adminAddr
// set, /metrics, pprof and gRPC reflection are served there and not on the
// API port.
func TestTheAdminListenerTakesMetricsPprofAndReflection(t *testing.T) {
	t.Parallel()
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{string(config.RoleAPI)}
	cfg.Server.AdminAddr = "127.0.0.1:0"
	a := start(t, cfg)
	for _, c := range []struct {
		url  string
		want int
	}{
		{"http://" + a.AdminAddr() + "/metrics", http.StatusOK},
		{"http://" + a.AdminAddr() + "/debug/pprof/", http.StatusOK},
		{"http://" + a.Addr() + "/metrics", http.StatusNotFound},
		{"http://" + a.Addr() + "/debug/pprof/", http.StatusNotFound},
	} {
		if code, _ := get(t, c.url); code != c.want {
			t.Errorf("GET %s: %d, want %d", c.url, code, c.want)
		}
	}
	services := func(addr string) ([]string, error) {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		defer func() { _ = conn.Close() }()
		stream, err := reflectionv1.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
		if err != nil {
			return nil, err
		}
		// A stream the server ended answers Send with io.EOF; its status
		// comes with Recv.
		if err := stream.Send(&reflectionv1.ServerReflectionRequest{MessageRequest: &reflectionv1.ServerReflectionRequest_ListServices{}}); err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		resp, err := stream.Recv()
		if err != nil {
			return nil, err
		}
		var names []string
		for _, s := range resp.GetListServicesResponse().GetService() {
			names = append(names, s.GetName())
		}
		return names, nil
	}
	names, err := services(a.AdminAddr())
	if err != nil || !strings.Contains(strings.Join(names, " "), "bettercompute.compute.v1.NodesService") {
		t.Fatalf("reflection on the admin listener: %v %v", names, err)
	}
	if _, err := services(a.Addr()); status.Code(err) != codes.Unimplemented {
		t.Fatalf("reflection on the API port: %v, want Unimplemented", err)
	}
}

// TestASlowClientIsCutOffAtTheReadTimeout: a client that sends its request
// slower than server.readTimeout loses the connection instead of holding
// it.
func TestASlowClientIsCutOffAtTheReadTimeout(t *testing.T) {
	t.Parallel()
	cfg := testConfig(pgtest.NewDB(t))
	cfg.Roles = []string{string(config.RoleAPI)}
	cfg.Server.ReadTimeout = config.Duration(500 * time.Millisecond)
	a := start(t, cfg)
	c, err := net.Dial("tcp", a.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	if _, err := c.Write([]byte("POST /api/compute/system/version HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	_, err = bufio.NewReader(c).ReadString('\n')
	// The server gives up on the body and closes (or answers an error and
	// closes) well before our own 10 s deadline.
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		t.Fatalf("the connection was still open after %s", time.Since(start))
	}
}
