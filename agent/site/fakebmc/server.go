package fakebmc

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"
)

// Server is a BMC served over HTTPS with its own self-signed certificate,
// like a real BMC: `make run` and the simulator start one per machine.
type Server struct {
	// URL is the endpoint, https://host:port.
	URL string
	// CAPEM is the server's self-signed certificate in PEM: pin it in the
	// client (it is its own CA).
	CAPEM []byte
	// BMC is the served fake.
	BMC *BMC

	srv  *http.Server
	ln   net.Listener
	host string
	cert atomic.Pointer[tls.Certificate]
}

// StartTLS serves b on addr ("127.0.0.1:0" for any free port) over TLS with a
// fresh self-signed certificate for the listener's IP and "localhost".
func StartTLS(b *BMC, addr string) (*Server, error) { return StartTLSCert(b, addr, "") }

// StartTLSCert is StartTLS keeping its certificate in certFile (PEM, the
// certificate then its key, mode 0600): read from there when it exists,
// written there when it is made, so a BMC restarted keeps its certificate
// as a real one does. An empty certFile keeps nothing.
func StartTLSCert(b *BMC, addr, certFile string) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("fakebmc: listen %s: %w", addr, err)
	}
	host, _, _ := net.SplitHostPort(ln.Addr().String())
	cert, pemBytes, err := loadOrMake(host, certFile)
	if err != nil {
		ln.Close()
		return nil, err
	}
	s := &Server{
		URL:   "https://" + ln.Addr().String(),
		CAPEM: pemBytes,
		BMC:   b,
		ln:    ln,
		host:  host,
	}
	s.cert.Store(&cert)
	s.srv = &http.Server{
		Handler:           b,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    16 << 10,
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12,
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return s.cert.Load(), nil }},
	}
	go func() {
		if err := s.srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
			b.log.Error("fakebmc: serve", "err", err)
		}
	}()
	return s, nil
}

// CertificateSHA256 is the lowercase hex SHA-256 of the certificate the
// server presents now.
func (s *Server) CertificateSHA256() string {
	sum := sha256.Sum256(s.cert.Load().Certificate[0])
	return hex.EncodeToString(sum[:])
}

// Rotate makes the server present a new self-signed certificate from its
// next handshake on (what a replaced BMC, or one impersonated, looks like),
// and returns its SHA-256. Open connections keep the old one: close them
// (or let the client reconnect) to see it. CAPEM is not updated.
func (s *Server) Rotate() (string, error) {
	cert, _, err := selfSigned(s.host)
	if err != nil {
		return "", err
	}
	s.cert.Store(&cert)
	return s.CertificateSHA256(), nil
}

func loadOrMake(host, certFile string) (tls.Certificate, []byte, error) {
	if certFile != "" {
		if b, err := os.ReadFile(certFile); err == nil {
			cert, err := tls.X509KeyPair(b, b)
			if err != nil {
				return tls.Certificate{}, nil, fmt.Errorf("fakebmc: %s: %w", certFile, err)
			}
			return cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Certificate[0]}), nil
		}
	}
	cert, pemBytes, err := selfSigned(host)
	if err != nil || certFile == "" {
		return cert, pemBytes, err
	}
	key, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key})
	if err := os.WriteFile(certFile, append(append([]byte{}, pemBytes...), keyPEM...), 0o600); err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("fakebmc: keep the certificate: %w", err)
	}
	return cert, pemBytes, nil
}

// Close stops the server.
func (s *Server) Close() error { return s.srv.Close() }

// selfSigned makes a CA-flagged self-signed ECDSA certificate for host.
func selfSigned(host string) (tls.Certificate, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "fakebmc " + host},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		DNSNames:              []string{"localhost"},
	}
	if ip := net.ParseIP(host); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else if host != "" {
		tmpl.DNSNames = append(tmpl.DNSNames, host)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key},
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}
