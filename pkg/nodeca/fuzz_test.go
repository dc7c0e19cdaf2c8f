package nodeca_test

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
)

// FuzzParseCSR feeds Join's and Renew's DER CSR to ParseCSR: no panic; a
// refusal is INVALID_INPUT on "csr"; an accepted request is exactly the
// input (no trailing bytes), its signature verifies and its key is one of
// the allowed types and sizes.
func FuzzParseCSR(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0x30, 0x00})
	f.Add([]byte{0x30, 0x82, 0xff, 0xff})
	for _, k := range fuzzKeys(f) {
		der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "node"}}, k)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(der)
		f.Add(append(bytes.Clone(der), 0)) // trailing data
		bad := bytes.Clone(der)
		bad[len(bad)-1] ^= 1 // signature no longer verifies
		f.Add(bad)
	}
	f.Fuzz(func(t *testing.T, der []byte) {
		csr, err := nodeca.ParseCSR(der)
		if err != nil {
			if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != "csr" {
				t.Fatalf("ParseCSR: %v, want INVALID_INPUT on csr", err)
			}
			return
		}
		if !bytes.Equal(csr.Raw, der) {
			t.Fatalf("accepted a CSR whose DER (%d bytes) is not the input (%d bytes)", len(csr.Raw), len(der))
		}
		if err := csr.CheckSignature(); err != nil {
			t.Fatalf("accepted a CSR whose signature does not verify: %v", err)
		}
		switch k := csr.PublicKey.(type) {
		case *ecdsa.PublicKey:
			if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
				t.Fatalf("accepted ECDSA curve %s", k.Curve.Params().Name)
			}
		case ed25519.PublicKey:
		case *rsa.PublicKey:
			if k.N.BitLen() < 2048 {
				t.Fatalf("accepted a %d-bit RSA key", k.N.BitLen())
			}
		default:
			t.Fatalf("accepted key type %T", k)
		}
	})
}

// fuzzKeys are keys of each type ParseCSR judges: allowed and refused.
func fuzzKeys(f *testing.F) []crypto.Signer {
	var out []crypto.Signer
	for _, c := range []elliptic.Curve{elliptic.P256(), elliptic.P384(), elliptic.P224(), elliptic.P521()} {
		k, err := ecdsa.GenerateKey(c, rand.Reader)
		if err != nil {
			f.Fatal(err)
		}
		out = append(out, k)
	}
	_, ek, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	rk, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		f.Fatal(err)
	}
	return append(out, ek, rk)
}
