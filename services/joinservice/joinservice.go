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
// joinservice runs in one of two places. Under `all` and dev it is inside
// the gateway's process: the gateway calls it through [NewJoiner] and the CA
// signs the gateway's serving certificate. As its own deployable (`serve
// --roles joinservice`) it serves Join and Renew to gateways only, on an
// internal listener with mutual TLS ([NewInternalServer]; see internal.go),
// and a gateway with gateway.joinService set relays to it with a [Client],
// holding no CA key, no HPKE key and no signing key.
package joinservice

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"log/slog"
	"slices"
	"time"

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
	"github.com/bettercompute/bettercompute/pkg/ratelimit"
	"github.com/bettercompute/bettercompute/pkg/sites"
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
	// RenewInterval is how often one node may be issued a certificate by
	// Renew; 0 means DefaultRenewInterval, negative means no limit.
	RenewInterval time.Duration
	// Now is the clock of the Renew limit; nil means time.Now.
	Now func() time.Time
}

// DefaultRenewInterval: a node renews a 24 h certificate a few times a day,
// so one Renew a minute leaves room for its retries and none for flooding
// node_certificates with rows.
const DefaultRenewInterval = time.Minute

// Service is joinservice's logic.
type Service struct {
	db     DB
	ca     *nodeca.CA
	key    *Key
	chain  attest.Chain
	logger *slog.Logger

	renewEvery time.Duration
	renews     *ratelimit.Keyed // per node id; nil: no limit
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
	every := cfg.RenewInterval
	if every == 0 {
		every = DefaultRenewInterval
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	s := &Service{db: cfg.DB, ca: cfg.CA, key: cfg.Key, chain: chain, logger: cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		renewEvery: every}
	if every > 0 {
		s.renews = ratelimit.New(1/every.Seconds(), 1, now)
	}
	return s, nil
}

// allowRenew counts a Renew of node id: RATE_LIMITED when the node was
// issued a certificate less than renewEvery ago (a bucket of one per node).
func (s *Service) allowRenew(id string) error {
	if s.renews == nil || s.renews.Allow(id) {
		return nil
	}
	return fault.New(fault.RateLimited, "", "node %s renews its certificate at most once per %s; retry later", id, s.renewEvery)
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
// and the token does not allow reclaiming it; a retired node's hardware
// needs a token created after its retirement that names it).
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
	role := cmp.Or(req.GetRole(), RoleNode)
	if role != RoleNode && role != RoleSite && role != RoleRamdisk {
		return nil, fault.New(fault.InvalidInput, "role", "expected %q, %q or %q, got %q", RoleNode, RoleSite, RoleRamdisk, limit(req.GetRole(), 32))
	}
	plain, err := s.key.Open(req.GetEncapsulatedKey(), req.GetSealedToken(), req.GetCsr())
	if err != nil {
		return nil, fault.Wrap(err, fault.Unauthenticated, "sealedToken", "the join token cannot be opened with joinservice's key %s for this CSR", s.key.ID())
	}
	csr, err := nodeca.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, err
	}
	// The token's kind decides what it can make, and the caller's role must
	// agree before anything is spent: a join token never makes a site
	// agent, a site token never a node.
	switch isSite := sites.IsToken(string(plain)); {
	case isSite && role == RoleRamdisk:
		return nil, fault.New(fault.InvalidInput, "role", "a site token (bcst_…) enrolls a site agent, not a ramdisk")
	case isSite && role == RoleNode:
		return nil, fault.New(fault.InvalidInput, "role", "a site token (bcst_…) enrolls a site agent, not a node: run `bcd site join`")
	case !isSite && role == RoleSite:
		return nil, fault.New(fault.InvalidInput, "role", "a site agent enrolls with a site token (bcst_…); this is not one")
	case isSite:
		return s.enrollSite(ctx, string(plain), csr, req.GetClaims().GetHostname())
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
			// The token's role and the caller's must agree before a use
			// is spent: a ramdisk token never makes a node, a node token
			// never a ramdisk.
			switch {
			case t.Role == jointoken.RoleRamdisk && role != RoleRamdisk:
				return fault.New(fault.InvalidInput, "role", "this join token is a ramdisk's boot token: only `bcd ramdisk` joins with it")
			case t.Role != jointoken.RoleRamdisk && role == RoleRamdisk:
				return fault.New(fault.InvalidInput, "role", "a ramdisk joins with a ramdisk token (role ramdisk, naming its node); this is a node's join token")
			}
			if role == RoleRamdisk {
				// The ramdisk's key signs its results: its certificate
				// must bind an Ed25519 key (proto/resultsig verifies).
				if _, ok := csr.PublicKey.(ed25519.PublicKey); !ok {
					return fault.New(fault.InvalidInput, "csr", "a ramdisk joins with a CSR for its Ed25519 result key, not a %s key", keyType(csr.PublicKey))
				}
			}
			return s.chain.Attest(ctx, attest.Evidence{Claims: claims, Expect: t.Expect})
		})
		if err != nil {
			return err
		}
		if tok.NodeID != "" {
			node, reclaimed, err = s.joinNamed(ctx, tx, tok, claims.Hostname, hwKey)
			if err != nil {
				return err
			}
		}
		old, found := nodes.Node{}, false
		if tok.NodeID == "" {
			if old, found, err = nodes.ByHardwareKey(ctx, tx, tok.TenantID, hwKey); err != nil {
				return err
			}
		}
		switch {
		case tok.NodeID != "":
			// Done by joinNamed.
		case found && old.State == nodes.StateRetired && (!tok.Reclaim || !slices.Contains(tok.ReclaimNodeIDs, old.ID) ||
			old.RetiredAt == nil || !tok.CreatedAt.After(*old.RetiredAt)):
			// A retired node's hardware comes back only on purpose: with a
			// token made after the retirement that names it.
			return fault.Wrap(nodes.ErrHardwareTaken, fault.Conflict, "claims", "this hardware is node %s, retired at %s; to join it again, "+
				"create a join token after its retirement that names %s in reclaimNodeIds", old.ID, retiredAt(old), old.ID)
		case found && (!tok.Reclaim || !slices.Contains(tok.ReclaimNodeIDs, old.ID)):
			return fault.Wrap(nodes.ErrHardwareTaken, fault.Conflict, "claims", "this hardware has already joined as node %s; join with a token that names that node in reclaimNodeIds to take it back", old.ID)
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
		if !reclaimed {
			if err := reportHardwareConflict(ctx, tx, node, hwKey); err != nil {
				return err
			}
		}
		res := authz.Resource{Type: authz.TypeNode, ID: node.ID, TenantID: node.TenantID, PoolID: node.PoolID, Labels: node.Labels}
		if err := authz.Put(ctx, tx, res); err != nil {
			return err
		}
		if role == RoleRamdisk {
			chain, err = s.ca.IssueRamdisk(ctx, tx, node.ID, csr.PublicKey)
		} else {
			chain, err = s.ca.IssueNode(ctx, tx, node.ID, csr.PublicKey)
		}
		if err != nil {
			return err
		}
		event := "node.joined"
		if reclaimed {
			event = "node.reclaimed"
		}
		if err := audit.Write(ctx, tx, audit.Record{
			TenantID: node.TenantID, Actor: "joinservice", ActorTenantID: node.TenantID,
			Action: redeemAction, Resource: res.UID(), Decision: audit.Allow, Method: joinMethod,
			Detail: map[string]any{"joinTokenId": tok.ID, "poolId": node.PoolID, "reclaimed": reclaimed, "role": role,
				"serial": nodeca.Serial(chain[0].SerialNumber)},
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
	s.logger.InfoContext(ctx, "node joined", "node", node.ID, "tenant", node.TenantID, "pool", node.PoolID, "reclaimed", reclaimed, "role", role)
	return &agentv1.JoinResponse{NodeId: node.ID, CertificateChain: der(chain), TrustBundle: s.ca.TrustBundle(), SpiffeId: id.String(), Role: role}, nil
}

// reportHardwareConflict writes a node.hardware_conflict event in the root
// tenant when node's hardware key is also another tenant's node's: the same
// machine claimed in two tenants. The join goes ahead — hardware keys are
// unique per tenant, so one tenant cannot block another's join by claiming
// its hardware first — and the operator sees it.
func reportHardwareConflict(ctx context.Context, tx pgx.Tx, node nodes.Node, hwKey string) error {
	others, err := nodes.OthersWithHardwareKey(ctx, tx, node.TenantID, hwKey)
	if err != nil || len(others) == 0 {
		return err
	}
	ids := make([]string, len(others))
	tenants := make([]string, len(others))
	for i, o := range others {
		ids[i], tenants[i] = o.ID, o.TenantID
	}
	_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: iam.RootTenant, Type: "node.hardware_conflict", Resource: node.ID, Payload: map[string]any{
		"nodeId": node.ID, "tenantId": node.TenantID, "otherNodeIds": ids, "otherTenantIds": tenants,
	}})
	return err
}

// Renew issues a fresh certificate to the node whose certificate chain
// (leaf first, as its mutual TLS connection presented it) is peer. The
// chain must verify against the trust bundle now, name a node of this trust
// domain that exists, and not be revoked (UNAUTHENTICATED otherwise); the
// CSR must be signed by, and be for, the same key as the presented
// certificate (INVALID_INPUT on "csr" otherwise), so whoever relays the call
// cannot get a certificate for a key of its own. A node is issued at most
// one certificate per RenewInterval (RATE_LIMITED beyond it).
func (s *Service) Renew(ctx context.Context, peer []*x509.Certificate, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	if len(peer) == 0 {
		return nil, fault.New(fault.Unauthenticated, "certificate", "Renew needs the node's current certificate (mutual TLS)")
	}
	if isSiteAgent(peer[0]) {
		return s.renewSite(ctx, peer, req)
	}
	nodeID, err := s.ca.VerifyNode(ctx, s.db, peer)
	if err != nil {
		return nil, err
	}
	if err := s.refuseRamdiskRenew(ctx, peer[0], nodeID); err != nil {
		return nil, err
	}
	csr, err := nodeca.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, err
	}
	if !nodeca.SameKey(csr.PublicKey, peer[0].PublicKey) {
		return nil, fault.New(fault.InvalidInput, "csr", "the request must be for the key of the certificate presented (node %s)", nodeID)
	}
	// Every issuance writes a certificate row: one per node per interval.
	if err := s.allowRenew(nodeID); err != nil {
		return nil, err
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

// retiredAt is when n was retired, for a message.
func retiredAt(n nodes.Node) string {
	if n.RetiredAt == nil {
		return "an unknown time"
	}
	return n.RetiredAt.UTC().Format(time.RFC3339)
}
