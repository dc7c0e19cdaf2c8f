// Package join redeems a join token for a node identity: it seals the token
// to joinservice's HPKE key, sends a CSR for the node key with the node's
// hardware claims to the gateway's NodeService.Join (TLS without a client
// certificate), and stores the node id, certificate chain and trust bundle.
//
// # Sealing
//
// The token is sealed with HPKE (RFC 9180, Go's crypto/hpke) in base mode
// with the suite DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM
// (KEM 0x0020, KDF 0x0001, AEAD 0x0001), the info string Info
// ("bettercompute join v1") and no additional authenticated data.
// JoinRequest.encapsulated_key is the encapsulated key, sealed_token the
// ciphertext, joinservice_key_id the key id (KeyID of the public key unless
// configured). joinservice opens it with
//
//	r, _ := hpke.NewRecipient(enc, priv, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte(join.Info))
//	token, err := r.Open(nil, sealed)
package join

import (
	"context"
	"crypto"
	"crypto/ecdh"
	"crypto/hpke"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/internal/gateways"
	"github.com/bettercompute/bettercompute/agent/internal/retry"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/spiffepath"
)

// Info is the HPKE info string that binds a sealed token to its purpose.
const Info = "bettercompute join v1"

// Claimer collects the hardware claims a node presents (an
// *inventory.Collector).
type Claimer interface {
	Claims(ctx context.Context) (*agentv1.HardwareClaims, error)
}

// Config is one join. Gateway, Token, JoinserviceKey, State and Claims are
// required.
type Config struct {
	// Gateway is the gateways' host:port, comma-separated
	// (internal/gateways): each attempt goes to the next.
	Gateway string
	// ServerName is the name the gateway's certificate must carry (a DNS or
	// IP SAN). Empty means the host of Gateway.
	ServerName string
	// RootCAs verify the gateway's certificate; nil means the system roots.
	RootCAs *x509.CertPool
	// Token is the join token, bcjt_<id>.<secret>.
	Token string
	// JoinserviceKey is joinservice's X25519 public key, 32 raw bytes.
	JoinserviceKey []byte
	// JoinserviceKeyID names that key; empty means KeyID(JoinserviceKey).
	JoinserviceKeyID string
	// State is where the node key is read (or created) and the identity
	// stored.
	State *state.Store
	// Claims collects the hardware claims.
	Claims Claimer
	// Timeout bounds the Join call; zero means 30 seconds.
	Timeout time.Duration
	// Role is what to become: "" or RoleNode (a node, with a join token),
	// RoleSite (a site agent, with a site token) or RoleRamdisk (a
	// machine's commissioning ramdisk, with its boot token: a join token
	// of role ramdisk naming the node). joinservice refuses a token of the
	// other kind, and Join refuses an answer of another role.
	Role string
	// OnRetry, when set, hears each attempt that will be retried: its
	// number, the wait before the next, and its error.
	OnRetry func(attempt int, wait time.Duration, err error)
	// RetryFor, when positive, is how long Join keeps trying while the
	// gateway answers UNAVAILABLE or RESOURCE_EXHAUSTED (it, or joinservice
	// behind it, is down or restarting, or admitting too many at once) or
	// cannot be reached: jittered back-off from 1 s to 15 s between
	// attempts, each bounded by Timeout. Any other answer ends it at once.
	// Zero tries once. A retried join whose first attempt did reach
	// joinservice may find a single-use token spent: that refusal says so.
	RetryFor time.Duration
	// Key, when set, is the key to join with instead of State's node key:
	// bcd ramdisk's Ed25519 key, kept in memory only (the CSR is for it,
	// and the certificate must bind it). Nil means State.Key().
	Key crypto.Signer
}

// Roles of a join (JoinRequest.role).
const (
	RoleNode    = "node"
	RoleSite    = "site"
	RoleRamdisk = "ramdisk"
)

// Join redeems cfg.Token: it seals it, sends a CSR for the node key and the
// hardware claims to NodeService.Join, checks the answer (the certificate
// is for the node key, chains to the returned trust bundle and names the
// returned node id) and stores it.
func Join(ctx context.Context, cfg Config) (state.Identity, error) {
	if cfg.Gateway == "" || cfg.Token == "" || cfg.State == nil || cfg.Claims == nil {
		return state.Identity{}, errors.New("join: gateway, token, state and claims are required")
	}
	keyID := cfg.JoinserviceKeyID
	if keyID == "" {
		keyID = KeyID(cfg.JoinserviceKey)
	}
	var (
		key crypto.Signer
		csr []byte
		err error
	)
	if cfg.Key != nil {
		key = cfg.Key
		if csr, err = x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key); err != nil {
			return state.Identity{}, fmt.Errorf("join: csr: %w", err)
		}
	} else {
		if key, err = cfg.State.Key(); err != nil {
			return state.Identity{}, err
		}
		if csr, err = cfg.State.CSR(); err != nil {
			return state.Identity{}, err
		}
	}
	enc, sealed, err := Seal(cfg.JoinserviceKey, cfg.Token, csr)
	if err != nil {
		return state.Identity{}, err
	}
	claims, err := cfg.Claims.Claims(ctx)
	if err != nil {
		return state.Identity{}, fmt.Errorf("join: hardware claims: %w", err)
	}
	gws, err := gateways.Parse(cfg.Gateway, cfg.ServerName)
	if err != nil {
		return state.Identity{}, fmt.Errorf("join: %w", err)
	}
	// join calls Join on the next gateway of the list: a retry goes to
	// another one when there are several.
	join := func(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
		tg := gws.Next()
		creds := credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12, RootCAs: cfg.RootCAs, ServerName: tg.ServerName})
		conn, err := grpc.NewClient(tg.Addr, grpc.WithTransportCredentials(creds), grpc.WithDefaultServiceConfig(gateways.ServiceConfig))
		if err != nil {
			return nil, fmt.Errorf("dial %s: %w", tg.Addr, err)
		}
		defer func() { _ = conn.Close() }()
		return agentv1.NewNodeServiceClient(conn).Join(ctx, req)
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	req := &agentv1.JoinRequest{
		SealedToken:      sealed,
		EncapsulatedKey:  enc,
		JoinserviceKeyId: keyID,
		Csr:              csr,
		Claims:           claims,
		Role:             cfg.Role,
	}
	giveUp := time.Now().Add(cfg.RetryFor)
	backoff := retry.Backoff{Min: time.Second, Max: 15 * time.Second}
	var resp *agentv1.JoinResponse
	for attempt := 1; ; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		resp, err = join(cctx, req)
		cancel()
		if err == nil {
			break
		}
		wait := backoff.Next()
		if !Retryable(err) || ctx.Err() != nil || time.Now().Add(wait).After(giveUp) {
			if attempt > 1 {
				return state.Identity{}, fmt.Errorf("join: %d attempts: %w", attempt, err)
			}
			return state.Identity{}, fmt.Errorf("join: %w", err)
		}
		if cfg.OnRetry != nil {
			cfg.OnRetry(attempt, wait, err)
		}
		if !retry.Sleep(ctx, wait) {
			return state.Identity{}, fmt.Errorf("join: %w (gave up: %w)", err, ctx.Err())
		}
	}
	id := state.Identity{NodeID: resp.GetNodeId(), Chain: resp.GetCertificateChain(), Bundle: resp.GetTrustBundle()}
	if id.NodeID == "" || len(id.Chain) == 0 || len(id.Bundle) == 0 {
		return state.Identity{}, errors.New("join: the answer lacks a node id, certificate or trust bundle")
	}
	role := cfg.Role
	if role == "" {
		role = RoleNode
	}
	if got := resp.GetRole(); got != role && (got != "" || role != RoleNode) {
		return state.Identity{}, fmt.Errorf("join: asked to join as %s, the answer is for a %s", role, got)
	}
	want := spiffepath.Node(id.NodeID)
	if role == RoleSite {
		if resp.GetSiteId() == "" {
			return state.Identity{}, errors.New("join: the answer lacks the site id")
		}
		want = spiffepath.SiteAgent(resp.GetSiteId(), id.NodeID)
	}
	if err := id.VerifyPath(key, want); err != nil {
		return state.Identity{}, fmt.Errorf("join: %w", err)
	}
	if err := cfg.State.SaveIdentity(id); err != nil {
		return state.Identity{}, err
	}
	return id, nil
}

// Retryable says a failed Join may succeed if tried again later: the
// gateway (or joinservice behind it) was unavailable or admitting too many,
// or the deadline passed before an answer.
func Retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded:
		return true
	}
	return false
}

// Seal seals token to pub, joinservice's raw X25519 public key, with the
// suite in the package documentation, bound to csr (the DER CSR sent beside
// it; see [AAD]). It returns the encapsulated key and the ciphertext.
func Seal(pub []byte, token string, csr []byte) (enc, ct []byte, err error) {
	pk, err := hpke.DHKEM(ecdh.X25519()).NewPublicKey(pub)
	if err != nil {
		return nil, nil, fmt.Errorf("join: joinservice key: %w", err)
	}
	enc, s, err := hpke.NewSender(pk, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte(Info))
	if err != nil {
		return nil, nil, fmt.Errorf("join: seal: %w", err)
	}
	ct, err = s.Seal(AAD(csr), []byte(token))
	if err != nil {
		return nil, nil, fmt.Errorf("join: seal: %w", err)
	}
	return enc, ct, nil
}

// AAD is the additional authenticated data of the sealed token: SHA-256 of
// the DER CSR. It binds the token to the node's key, so a gateway relaying
// the Join cannot swap in a CSR for a key of its own.
func AAD(csr []byte) []byte {
	h := sha256.Sum256(csr)
	return h[:]
}

// KeyID is the default id of a joinservice key: the first 16 hex digits of
// the SHA-256 of its raw 32 bytes.
func KeyID(pub []byte) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// ParsePublicKey reads joinservice's public key from a file's contents: a
// PEM "PUBLIC KEY" block (PKIX, X25519), or the 32 raw bytes in base64 or
// hex on one line. A PEM header "Key-Id" names the key; otherwise keyID is
// empty.
func ParsePublicKey(data []byte) (pub []byte, keyID string, err error) {
	if blk, _ := pem.Decode(data); blk != nil {
		if blk.Type != "PUBLIC KEY" {
			return nil, "", fmt.Errorf("join: joinservice key: PEM %q, want PUBLIC KEY", blk.Type)
		}
		k, err := x509.ParsePKIXPublicKey(blk.Bytes)
		if err != nil {
			return nil, "", fmt.Errorf("join: joinservice key: %w", err)
		}
		ek, ok := k.(*ecdh.PublicKey)
		if !ok || ek.Curve() != ecdh.X25519() {
			return nil, "", fmt.Errorf("join: joinservice key: %T is not an X25519 key", k)
		}
		return ek.Bytes(), blk.Headers["Key-Id"], nil
	}
	s := strings.TrimSpace(string(data))
	for _, dec := range []func(string) ([]byte, error){hex.DecodeString, base64.StdEncoding.DecodeString, base64.RawURLEncoding.DecodeString} {
		if b, err := dec(s); err == nil && len(b) == 32 {
			return b, "", nil
		}
	}
	return nil, "", errors.New("join: joinservice key: want a PEM PUBLIC KEY or 32 bytes in hex or base64")
}
