package gateway_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/proto"

	agentinv "github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/resultsig"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/services/gateway"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// The ramdisk tests run the real agent (agent/join, agent/session,
// agent/ramdisk with the mock NVML) as `bcd ramdisk` does, against the
// real joinservice and gateway over mutual TLS, on a real PostgreSQL.

type ramdiskFixture struct {
	db     *pgxpool.Pool
	ca     *nodeca.CA
	key    *joinservice.Key
	gw     *gateway.Gateway
	addr   string
	signer *commands.Signer
	kinds  *commands.Registry
}

func setupRamdisk(t *testing.T, tune ...func(*gateway.Config)) *ramdiskFixture {
	t.Helper()
	_, sk, _ := ed25519.GenerateKey(rand.Reader)
	f := &ramdiskFixture{db: pgtest.New(t), signer: commands.NewSigner(sk)}
	f.kinds = commands.Builtin().Signing(f.signer, trustDomain)
	var err error
	if f.ca, err = nodeca.Open(nodeca.Config{TrustDomain: trustDomain, Dir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	if f.key, err = joinservice.NewKey(); err != nil {
		t.Fatal(err)
	}
	svc, err := joinservice.New(joinservice.Config{DB: f.db, CA: f.ca, Key: f.key, RenewInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	cfg := gateway.Config{
		ID: "gw-1", DB: f.db, Joiner: joinservice.NewJoiner(svc), TrustDomain: trustDomain,
		Revoked: func(ctx context.Context, serials []string) ([]string, error) {
			return nodeca.RevokedAmong(ctx, f.db, serials)
		},
		LivenessInterval: time.Hour, // commands are dispatched by hand
	}
	for _, fn := range tune {
		fn(&cfg)
	}
	f.gw, err = gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.gw.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	cert, err := f.ca.ServingCertificate("gw-1", []string{"127.0.0.1"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{cert}, ClientCAs: f.ca.Pool(), ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS13,
	})))
	agentv1.RegisterNodeServiceServer(gs, f.gw)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = ln.Addr().String()
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(func() { f.gw.Stop(); gs.Stop() })
	if _, err := pools.Create(t.Context(), f.db, pools.Pool{ID: "pool_metal", TenantID: "root", Name: "metal", Class: pools.ClassGPU}); err != nil {
		t.Fatal(err)
	}
	return f
}

// token mints a join token naming nodeID with role.
func (f *ramdiskFixture) token(t *testing.T, nodeID, role string) string {
	t.Helper()
	s := jointoken.Mint()
	if _, err := jointoken.Create(t.Context(), f.db, jointoken.Token{ID: s.ID, TenantID: "root", PoolID: "pool_metal", Uses: 1,
		NodeID: nodeID, Role: role, ExpiresAt: new(time.Now().Add(time.Hour))}, s.Hash); err != nil {
		t.Fatal(err)
	}
	return s.Token
}

// running is an agent's session.
type running struct {
	cancel context.CancelFunc
	done   chan error
}

func (r *running) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	if err := <-r.done; err != nil {
		t.Errorf("agent: %v", err)
	}
}

// agent joins with token (as a ramdisk when rd is set, with key) and runs
// the node session as bcd ramdisk or bcd node does.
func (f *ramdiskFixture) agent(t *testing.T, token string, key ed25519.PrivateKey, rd *ramdisk.Ramdisk) (state.Identity, *running) {
	t.Helper()
	st, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	inv, err := agentinv.Open(agentinv.Config{Backend: agentinv.BackendMock, Hostname: "machine-1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	jc := join.Config{Gateway: f.addr, ServerName: "127.0.0.1", RootCAs: f.ca.Pool(), Token: token,
		JoinserviceKey: f.key.PublicKey(), JoinserviceKeyID: f.key.ID(), State: st, Claims: inv}
	sc := session.Config{Gateway: f.addr, ServerName: "127.0.0.1", State: st, Inventory: inv, BootID: "boot-" + t.Name(),
		AgentVersion: "test", CommandKey: f.signer.Public(), MinBackoff: 50 * time.Millisecond, MaxBackoff: time.Second}
	if rd != nil {
		jc.Role, jc.Key = join.RoleRamdisk, key
		sc.Key, sc.Ramdisk, sc.ResultKey, sc.NoRenew = key, rd, key, true
	}
	id, err := join.Join(t.Context(), jc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- session.Run(ctx, sc) }()
	poll.Until(t, 30*time.Second, "the session to open", func() bool { return f.gw.Holds(id.NodeID) })
	return id, r
}

// enqueue queues kind for node in a test transaction (as the metal
// workflow does, through a signing registry) and dispatches it.
func (f *ramdiskFixture) enqueue(t *testing.T, node, kind string, payload proto.Message) commands.Command {
	t.Helper()
	var c commands.Command
	err := pgx.BeginFunc(t.Context(), f.db, func(tx pgx.Tx) error {
		var err error
		c, _, err = f.kinds.Enqueue(t.Context(), tx, commands.Request{NodeID: node, Kind: kind, Payload: payload, NotAfter: time.Now().Add(5 * time.Minute)})
		return err
	})
	if err != nil {
		t.Fatalf("enqueue %s: %v", kind, err)
	}
	if err := f.gw.Dispatch(t.Context(), node); err != nil {
		t.Fatalf("dispatch %s: %v", kind, err)
	}
	return c
}

// settled waits for c to reach a final state and returns it.
func (f *ramdiskFixture) settled(t *testing.T, c commands.Command) commands.Command {
	t.Helper()
	var out commands.Command
	poll.Until(t, 60*time.Second, c.Kind+" to settle", func() bool {
		var err error
		out, err = commands.Lookup(t.Context(), f.db, c.NodeID, c.ID)
		return err == nil && out.State.Final()
	})
	return out
}

func nodeState(t *testing.T, db *pgxpool.Pool, id string) string {
	t.Helper()
	n, err := nodes.Lookup(t.Context(), db, id)
	if err != nil {
		t.Fatal(err)
	}
	return n.State
}

func TestRamdiskSession(t *testing.T) {
	t.Parallel()
	f := setupRamdisk(t)
	const nodeX = "node_machine1"
	disk := filepath.Join(t.TempDir(), "disk0")
	old := make([]byte, 1<<16)
	copy(old, "old tenant's data")
	if err := os.WriteFile(disk, old, 0o600); err != nil {
		t.Fatal(err)
	}
	rd, err := ramdisk.New(ramdisk.Config{Disks: []string{disk}})
	if err != nil {
		t.Fatal(err)
	}
	key, err := ramdisk.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	id, ag := f.agent(t, f.token(t, nodeX, jointoken.RoleRamdisk), key, rd)

	t.Run("a ramdisk session is never asked to open a tunnel", func(t *testing.T) {
		poll.Until(t, 30*time.Second, "the ramdisk's session", func() bool { return f.gw.Ready(nodeX) })
		if _, err := f.gw.OpenTunnel(t.Context(), nodeX, "tun_ramdisk", "127.0.0.1:2222"); fault.CodeOf(err) != fault.Conflict {
			t.Fatalf("open a tunnel on a ramdisk: %v, want CONFLICT", err)
		}
	})

	t.Run("the ramdisk is node X, commissioning, with a ramdisk certificate of at most 2 h", func(t *testing.T) {
		if id.NodeID != nodeX || nodeState(t, f.db, nodeX) != nodes.StateCommissioning {
			t.Fatalf("joined as %s, state %s", id.NodeID, nodeState(t, f.db, nodeX))
		}
		leaf, err := id.Leaf()
		if err != nil {
			t.Fatal(err)
		}
		if d := leaf.NotAfter.Sub(leaf.NotBefore); d > nodeca.RamdiskValidity+nodeca.Backdate {
			t.Fatalf("certificate valid for %s", d)
		}
		if role, err := nodeca.CertificateRole(t.Context(), f.db, nodeca.Serial(leaf.SerialNumber)); err != nil || role != nodeca.RoleRamdisk {
			t.Fatalf("role %q %v", role, err)
		}
	})

	t.Run("kinds outside the flow are refused at dispatch", func(t *testing.T) {
		for _, kind := range []string{"inventory.refresh", "logs.collect", "node.reboot"} {
			c := f.settled(t, f.enqueue(t, nodeX, kind, nil))
			if c.State != commands.Failed || c.Reason != commands.ReasonInRamdisk || c.Attempts != 0 {
				t.Errorf("%s: %s %q after %d attempts", kind, c.State, c.Reason, c.Attempts)
			}
		}
	})

	var wipe commands.Command
	t.Run("diag.nvml and a signed disk.wipe run, and their results verify", func(t *testing.T) {
		diag := f.settled(t, f.enqueue(t, nodeX, "diag.nvml", &agentv1.DiagNvml{}))
		if diag.State != commands.Succeeded || !diag.NodeSigned() {
			t.Fatalf("diag.nvml: %s %q signed %v", diag.State, diag.Reason, diag.NodeSigned())
		}
		if err := commands.VerifyNodeSignature(t.Context(), f.db, diag, trustDomain); err != nil {
			t.Fatalf("diag.nvml: %v", err)
		}
		wipe = f.settled(t, f.enqueue(t, nodeX, "disk.wipe", &agentv1.DiskWipe{Disks: []string{disk}, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO, Reason: "commissioning"}))
		if wipe.State != commands.Succeeded || !wipe.NodeSigned() {
			t.Fatalf("disk.wipe: %s %q signed %v", wipe.State, wipe.Reason, wipe.NodeSigned())
		}
		if err := commands.VerifyNodeSignature(t.Context(), f.db, wipe, trustDomain); err != nil {
			t.Fatalf("disk.wipe: %v", err)
		}
		if b, _ := os.ReadFile(disk); len(b) == 0 || string(b[:3]) != "\x00\x00\x00" {
			t.Fatal("the disk was not wiped")
		}
	})

	t.Run("a tampered result fails verification", func(t *testing.T) {
		res := &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiskWipe{DiskWipe: &agentv1.DiskWipeResult{}}}
		b, _ := proto.Marshal(res)
		tampered := wipe
		tampered.Result = b
		if err := commands.VerifyNodeSignature(t.Context(), f.db, tampered, trustDomain); !errors.Is(err, resultsig.ErrBadSignature) {
			t.Fatalf("tampered result: %v", err)
		}
		failed := wipe
		failed.State, failed.Reason = commands.Failed, "failed"
		if err := commands.VerifyNodeSignature(t.Context(), f.db, failed, trustDomain); !errors.Is(err, resultsig.ErrBadSignature) {
			t.Fatalf("tampered state: %v", err)
		}
		if err := commands.VerifyNodeSignature(t.Context(), f.db, wipe, "other.domain"); !errors.Is(err, resultsig.ErrBadSignature) {
			t.Fatalf("another installation: %v", err)
		}
	})

	t.Run("a forged or unsigned wipe written through the gateway's path fails verification", func(t *testing.T) {
		ag.stop(t)
		_, forger, _ := ed25519.GenerateKey(rand.Reader)
		for name, sign := range map[string]func(*agentv1.CommandUpdate, resultsig.Subject){
			"unsigned":    func(*agentv1.CommandUpdate, resultsig.Subject) {},
			"another key": func(u *agentv1.CommandUpdate, s resultsig.Subject) { _ = resultsig.Sign(u, s, forger) },
			"the key, changed": func(u *agentv1.CommandUpdate, s resultsig.Subject) {
				_ = resultsig.Sign(u, s, key)
				u.Reason = "forged"
			},
		} {
			c := f.forge(t, nodeX, disk, sign)
			if c.State != commands.Succeeded && c.State != commands.Failed {
				t.Fatalf("%s: forged update not applied: %s", name, c.State)
			}
			if err := commands.VerifyNodeSignature(t.Context(), f.db, c, trustDomain); !errors.Is(err, resultsig.ErrBadSignature) {
				t.Errorf("%s: %v", name, err)
			}
		}
	})

	t.Run("the installed system's token makes X adopting again, a node, never sent disk.wipe", func(t *testing.T) {
		id2, ag2 := f.agent(t, f.token(t, nodeX, jointoken.RoleNode), nil, nil)
		defer ag2.stop(t)
		if id2.NodeID != nodeX || nodeState(t, f.db, nodeX) != nodes.StateAdopting {
			t.Fatalf("joined as %s, state %s", id2.NodeID, nodeState(t, f.db, nodeX))
		}
		leaf, _ := id2.Leaf()
		if role, err := nodeca.CertificateRole(t.Context(), f.db, nodeca.Serial(leaf.SerialNumber)); err != nil || role != nodeca.RoleNode {
			t.Fatalf("role %q %v", role, err)
		}
		c := f.settled(t, f.enqueue(t, nodeX, "disk.wipe", &agentv1.DiskWipe{Disks: []string{disk}, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO}))
		if c.State != commands.Failed || c.Reason != commands.ReasonRamdiskOnly || c.Attempts != 0 {
			t.Fatalf("disk.wipe to a node: %s %q after %d attempts", c.State, c.Reason, c.Attempts)
		}
		// A node session is sent what it always was.
		inv := f.settled(t, f.enqueue(t, nodeX, "inventory.refresh", nil))
		if inv.State != commands.Succeeded {
			t.Fatalf("inventory.refresh to a node: %s %q", inv.State, inv.Reason)
		}
	})
}

// forge puts a disk.wipe for node in flight under the node's current
// session epoch and applies a final update made by sign, as a gateway
// would: what a compromised gateway could write.
func (f *ramdiskFixture) forge(t *testing.T, node, disk string, sign func(*agentv1.CommandUpdate, resultsig.Subject)) commands.Command {
	t.Helper()
	ctx := t.Context()
	var c commands.Command
	err := pgx.BeginFunc(ctx, f.db, func(tx pgx.Tx) error {
		var err error
		c, _, err = f.kinds.Enqueue(ctx, tx, commands.Request{NodeID: node, Kind: "disk.wipe", NotAfter: time.Now().Add(5 * time.Minute),
			Payload: &agentv1.DiskWipe{Disks: []string{disk}, Method: agentv1.WipeMethod_WIPE_METHOD_ZERO}})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	n, err := nodes.Lookup(ctx, f.db, node)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := commands.Claim(ctx, f.db, node, n.SessionEpoch); err != nil {
		t.Fatal(err)
	}
	res := &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiskWipe{DiskWipe: &agentv1.DiskWipeResult{}}}
	u := &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, Result: res}
	sign(u, resultsig.Subject{TrustDomain: trustDomain, NodeID: node, CommandID: c.ID, Kind: c.Kind, Seq: c.Seq})
	err = pgx.BeginFunc(ctx, f.db, func(tx pgx.Tx) error {
		a, err := f.kinds.Apply(ctx, tx, commands.TxWaker(tx), node, n.SessionEpoch, u)
		if err == nil && a.Ignored {
			err = errors.New("ignored")
		}
		return err
	})
	if err != nil {
		t.Fatalf("apply forged update: %v", err)
	}
	out, err := commands.Lookup(ctx, f.db, node, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	return out
}
