package fakebmc

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
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

	srv *http.Server
	ln  net.Listener
}

// StartTLS serves b on addr ("127.0.0.1:0" for any free port) over TLS with a
// fresh self-signed certificate for the listener's IP and "localhost".
func StartTLS(b *BMC, addr string) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("fakebmc: listen %s: %w", addr, err)
	}
	host, _, _ := net.SplitHostPort(ln.Addr().String())
	cert, pemBytes, err := selfSigned(host)
	if err != nil {
		ln.Close()
		return nil, err
	}
	s := &Server{
		URL:   "https://" + ln.Addr().String(),
		CAPEM: pemBytes,
		BMC:   b,
		ln:    ln,
		srv: &http.Server{
			Handler:           b,
			ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout:       30 * time.Second,
			IdleTimeout:       60 * time.Second,
			MaxHeaderBytes:    16 << 10,
			TLSConfig:         &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
		},
	}
	go func() {
		if err := s.srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
			b.log.Error("fakebmc: serve", "err", err)
		}
	}()
	return s, nil
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
