// Package joinservice is the `joinservice` role: it redeems join tokens for
// node identities and renews node certificates.
//
// [Service.Join] opens the join token (sealed with HPKE to joinservice's
// key, so the gateway relaying it cannot read it), checks the CSR's
// signature, runs the attestor chain over the hardware claims and the
// token's expectations, derives the hardware key, enforces the reclaim rule,
// inserts the node "adopting" (shard = shard.Of(id)), spends one use of the
// token and signs a 24-hour SVID spiffe://<trust-domain>/node/<node id> —
// all in one transaction.
//
// [Service.Renew] issues a fresh certificate to a node that presents a
// valid, unrevoked certificate of its own (mutual TLS proves possession of
// its key) and a CSR for the same key.
//
// The gateway holds no CA: it embeds [Server] (agentv1.NodeServiceServer
// for Join and Renew; Session is the gateway's own) and asks the CA for its
// serving certificate, the trust bundle and revocation.
package joinservice

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
)

// DB is what joinservice needs of the database: a pool.
type DB interface {
	db.Beginner
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Config configures a [Service].
type Config struct {
	// DB is the pool. Required.
	DB DB
	// CA signs node certificates. Required.
	CA *nodeca.CA
	// Key opens sealed join tokens. Required.
	Key *Key
	// Attestors judge joining nodes; nil means [attest.DefaultChain].
	Attestors attest.Chain
	// Logger is the process logger; nil discards.
	Logger *slog.Logger
}

// Service is joinservice's logic.
type Service struct {
	db     DB
	ca     *nodeca.CA
	key    *Key
	chain  attest.Chain
	logger *slog.Logger
}

// New returns a Service.
func New(cfg Config) (*Service, error) {
	if cfg.DB == nil || cfg.CA == nil || cfg.Key == nil {
		return nil, errors.New("joinservice: DB, CA and Key are required")
	}
	chain := cfg.Attestors
	if chain == nil {
		chain = attest.DefaultChain()
	}
	return &Service{db: cfg.DB, ca: cfg.CA, key: cfg.Key, chain: chain, logger: cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))}, nil
}

// CA returns the node CA (trust bundle, serving certificates, verification).
func (s *Service) CA() *nodeca.CA { return s.ca }

// Key returns the HPKE key (its id and public key go into the daemons'
// configuration).
func (s *Service) Key() *Key { return s.key }

// Method names for the audit log.
const joinMethod = "/bettercompute.agent.v1.NodeService/Join"

// redeemAction is the audit log's action for a join (not a catalog action:
// no principal is authorized for it, the token is the credential).
const redeemAction = "compute:join-tokens:redeem"

// Join redeems a sealed join token for a node id and a certificate. Errors
// are *fault.Error: INVALID_INPUT (a missing or malformed field; the token
// sealed to another key id), UNAUTHENTICATED on "sealedToken" (cannot be
// opened; unknown, revoked, expired or exhausted token — see
// jointoken.Err…), ACCESS_DENIED on "claims" (attestation or the token's
// expectations failed), CONFLICT on "claims" (the hardware is already a node
// and the token does not allow reclaiming it).
func (s *Service) Join(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	switch {
	case len(req.GetSealedToken()) == 0:
		return nil, fault.New(fault.InvalidInput, "sealedToken", "required: the join token sealed with HPKE to joinservice's key")
	case len(req.GetEncapsulatedKey()) == 0:
		return nil, fault.New(fault.InvalidInput, "encapsulatedKey", "required: the HPKE encapsulated key of sealedToken")
	case req.GetJoinserviceKeyId() != s.key.ID():
		return nil, fault.New(fault.InvalidInput, "joinserviceKeyId", "the token is sealed to key %q; this joinservice's key is %q", req.GetJoinserviceKeyId(), s.key.ID())
	case req.GetClaims() == nil:
		return nil, fault.New(fault.InvalidInput, "claims", "required: the node's hardware claims")
	}
	plain, err := s.key.Open(req.GetEncapsulatedKey(), req.GetSealedToken(), req.GetCsr())
	if err != nil {
		return nil, fault.Wrap(err, fault.Unauthenticated, "sealedToken", "the join token cannot be opened with joinservice's key %s for this CSR", s.key.ID())
	}
	csr, err := nodeca.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, err
	}
	claims := claimsOf(req.GetClaims())
	hwKey := attest.HardwareKey(claims)

	var (
		node      nodes.Node
		chain     []*x509.Certificate
		reclaimed bool
	)
	err = db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		reclaimed = false
		tok, err := jointoken.Redeem(ctx, tx, string(plain), func(t jointoken.Token) error {
			return s.chain.Attest(ctx, attest.Evidence{Claims: claims, Expect: t.Expect})
		})
		if err != nil {
			return err
		}
		old, found, err := nodes.ByHardwareKey(ctx, tx, hwKey)
		if err != nil {
			return err
		}
		switch {
		case found && (!tok.Reclaim || old.TenantID != tok.TenantID):
			return fault.Wrap(nodes.ErrHardwareTaken, fault.Conflict, "claims", "this hardware has already joined; join with a token of its tenant that allows reclaim to take its node back")
		case found:
			if node, err = nodes.Reclaim(ctx, tx, old.ID, tok.PoolID, claims.Hostname, tok.ID, tok.Labels); err != nil {
				return err
			}
			// The old installation's certificates die with it.
			if _, err := nodeca.RevokeNode(ctx, tx, node.ID); err != nil {
				return err
			}
			reclaimed = true
		default:
			node, err = nodes.Create(ctx, tx, nodes.Node{
				ID: iam.NewID("node"), TenantID: tok.TenantID, PoolID: tok.PoolID, Labels: tok.Labels,
				Hostname: claims.Hostname, HardwareKey: hwKey, JoinTokenID: tok.ID,
			})
			if err != nil {
				return err
			}
		}
		res := authz.Resource{Type: authz.TypeNode, ID: node.ID, TenantID: node.TenantID, PoolID: node.PoolID, Labels: node.Labels}
		if err := authz.Put(ctx, tx, res); err != nil {
			return err
		}
		if chain, err = s.ca.IssueNode(ctx, tx, node.ID, csr.PublicKey); err != nil {
			return err
		}
		event := "node.joined"
		if reclaimed {
			event = "node.reclaimed"
		}
		if err := audit.Write(ctx, tx, audit.Record{
			TenantID: node.TenantID, Actor: "joinservice", ActorTenantID: node.TenantID,
			Action: redeemAction, Resource: res.UID(), Decision: audit.Allow, Method: joinMethod,
			Detail: map[string]any{"joinTokenId": tok.ID, "poolId": node.PoolID, "reclaimed": reclaimed, "serial": nodeca.Serial(chain[0].SerialNumber)},
		}); err != nil {
			return err
		}
		_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: node.TenantID, Type: event, Resource: node.ID, Payload: map[string]any{
			"nodeId": node.ID, "poolId": node.PoolID, "joinTokenId": tok.ID, "state": node.State,
		}})
		return err
	})
	if err != nil {
		return nil, err
	}
	id, _ := s.ca.NodeSPIFFEID(node.ID)
	s.logger.InfoContext(ctx, "node joined", "node", node.ID, "tenant", node.TenantID, "pool", node.PoolID, "reclaimed", reclaimed)
	return &agentv1.JoinResponse{NodeId: node.ID, CertificateChain: der(chain), TrustBundle: s.ca.TrustBundle(), SpiffeId: id.String()}, nil
}

// Renew issues a fresh certificate to the node whose certificate chain
// (leaf first, as its mutual TLS connection presented it) is peer. The
// chain must verify against the trust bundle now, name a node of this trust
// domain that exists, and not be revoked (UNAUTHENTICATED otherwise); the
// CSR must be signed by, and be for, the same key as the presented
// certificate (INVALID_INPUT on "csr" otherwise), so whoever relays the call
// cannot get a certificate for a key of its own.
func (s *Service) Renew(ctx context.Context, peer []*x509.Certificate, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	if len(peer) == 0 {
		return nil, fault.New(fault.Unauthenticated, "certificate", "Renew needs the node's current certificate (mutual TLS)")
	}
	nodeID, err := s.ca.VerifyNode(ctx, s.db, peer)
	if err != nil {
		return nil, err
	}
	csr, err := nodeca.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, err
	}
	if !nodeca.SameKey(csr.PublicKey, peer[0].PublicKey) {
		return nil, fault.New(fault.InvalidInput, "csr", "the request must be for the key of the certificate presented (node %s)", nodeID)
	}
	var chain []*x509.Certificate
	err = db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		n, err := nodes.Lookup(ctx, tx, nodeID)
		if fault.CodeOf(err) == fault.NotFound || (err == nil && n.State == nodes.StateRetired) {
			return fault.New(fault.Unauthenticated, "certificate", "node %s is not a live node", nodeID)
		}
		if err != nil {
			return err
		}
		chain, err = s.ca.IssueNode(ctx, tx, nodeID, csr.PublicKey)
		return err
	})
	if err != nil {
		return nil, err
	}
	s.logger.DebugContext(ctx, "node certificate renewed", "node", nodeID, "serial", nodeca.Serial(chain[0].SerialNumber))
	return &agentv1.RenewResponse{CertificateChain: der(chain), TrustBundle: s.ca.TrustBundle()}, nil
}

func der(chain []*x509.Certificate) [][]byte {
	out := make([][]byte, len(chain))
	for i, c := range chain {
		out[i] = c.Raw
	}
	return out
}

// claimsOf translates the wire claims to the attestors' domain type.
func claimsOf(c *agentv1.HardwareClaims) attest.Claims {
	out := attest.Claims{Hostname: c.GetHostname(), MachineID: c.GetMachineId(), SystemSerial: c.GetSystemSerial()}
	for _, g := range c.GetGpus() {
		out.GPUs = append(out.GPUs, attest.GPU{UUID: g.GetUuid(), Model: g.GetModel(), Serial: g.GetSerial(), MemoryBytes: g.GetMemoryBytes(), PCIBusID: g.GetPciBusId()})
	}
	return out
}
