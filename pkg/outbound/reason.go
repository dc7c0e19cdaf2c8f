package outbound

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"strconv"
)

// The classes of a failed outbound request a tenant may read (in an
// instance's reason, a webhook delivery's lastError). They say what kind of
// failure it was and nothing about the control plane's network: no
// addresses, no resolver answers, no text from the peer. The details go to
// the server's log.
const (
	// ReasonRefused: the rules refused the URL or the address it resolved
	// to.
	ReasonRefused = "destination refused"
	// ReasonDNS: the host's name did not resolve.
	ReasonDNS = "DNS failure"
	// ReasonTimeout: the request ran out of time.
	ReasonTimeout = "timeout"
	// ReasonTLS: the TLS handshake failed (certificate, protocol).
	ReasonTLS = "TLS error"
	// ReasonConnection: the connection was refused, reset or dropped.
	ReasonConnection = "connection failed"
	// ReasonInvalidResponse: the answer could not be read as what the
	// caller expects (too large, not the expected JSON).
	ReasonInvalidResponse = "invalid response"
)

// StatusReason is the class of an answer with an unwanted HTTP status:
// "HTTP status 503".
func StatusReason(code int) string { return "HTTP status " + strconv.Itoa(code) }

// Reason classifies the error of a request made with a [Client] (or any
// net/http error) as one of the Reason constants; "" for nil.
func Reason(err error) string {
	var (
		dns     *net.DNSError
		rec     tls.RecordHeaderError
		alert   tls.AlertError
		cert    *tls.CertificateVerificationError
		unknown x509.UnknownAuthorityError
		host    x509.HostnameError
		invalid x509.CertificateInvalidError
		netErr  net.Error
	)
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrDestinationRefused):
		return ReasonRefused
	case errors.As(err, &dns):
		return ReasonDNS
	case errors.As(err, &rec), errors.As(err, &alert), errors.As(err, &cert), errors.As(err, &unknown),
		errors.As(err, &host), errors.As(err, &invalid):
		return ReasonTLS
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &netErr) && netErr.Timeout():
		return ReasonTimeout
	}
	return ReasonConnection
}
