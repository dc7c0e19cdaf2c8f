package dev_test

import (
	"context"
	"crypto/rand"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pglocal"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/dev"
)

// The main workflow of the Go client (package proto/client) against a real
// control plane — `better-compute dev` in process, on real PostgreSQL and
// embedded NATS: an operator creates a pool and a join token, a node joins
// with the token, the operator reserves GPUs on it and runs
// inventory.refresh on the reserved node. The operator's side uses only
// proto/client and computev1 (structpb for the command's payload);
// proto/client's Example_workflow shows the same calls against
// BETTER_COMPUTE_URL.
//
// The node's side is a simulated daemon (agent/sim: the real agent's join,
// session and command code with a mock DGX H200), which does what
// `bcd join --token` does on a server: it joins with the token the operator
// created, through the gateway, over mutual TLS.
func Example_clientWorkflow() {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	env, stop, err := startExampleControlPlane(ctx)
	if err != nil {
		fmt.Println("start the control plane:", err)
		return
	}
	defer stop()

	// The operator: BETTER_COMPUTE_URL and BETTER_COMPUTE_TOKEN are the
	// dev server's base URL and its root credential.
	conn, err := client.Dial(ctx, env.BaseURL(), client.WithToken(env.Credential))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = conn.Close() }()
	c := client.NewClient(conn)
	c.PollInterval = 100 * time.Millisecond

	pool, err := c.Pools.Create(ctx, &computev1.PoolsServiceCreateRequest{
		TenantId: "root", Name: "h200", Class: "gpu", IdempotencyKey: "example-pool",
	})
	if err != nil {
		fmt.Println("pools.create:", client.EnvelopeOf(err))
		return
	}
	poolID := pool.GetPool().GetId()
	tok, err := c.JoinTokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{
		TenantId: "root", PoolId: poolID, Name: "rack-1", Uses: 1, IdempotencyKey: "example-token",
	})
	if err != nil {
		fmt.Println("joinTokens.create:", client.EnvelopeOf(err))
		return
	}
	fmt.Println("join token:", strings.HasPrefix(tok.GetToken(), "bcjt_"), "uses", tok.GetJoinToken().GetUses())

	// The node: `bcd join --token <token>` on the server.
	fleet, err := joinSimulatedNode(ctx, env, tok.GetToken())
	if err != nil {
		fmt.Println("join:", err)
		return
	}
	defer fleet.Stop()

	// The operator again: wait for the node the token let in.
	nodes, err := c.WaitSchedulable(ctx, "root", poolID, 1)
	if err != nil {
		fmt.Println("wait for the node:", err)
		return
	}
	node := nodes[0]
	fmt.Println("node:", node.GetState(), "schedulable", node.GetSchedulable(), "GPUs", len(node.GetDevices()), "joined with the token", node.GetId() == fleet.Nodes()[0])

	created, err := c.Reservations.Create(ctx, &computev1.ReservationsServiceCreateRequest{
		TenantId: "root", PoolId: poolID, GpuCount: 2, IdempotencyKey: "example-reservation",
	})
	if err != nil {
		fmt.Println("reservations.create:", client.EnvelopeOf(err))
		return
	}
	rsv, err := c.WaitReservation(ctx, "root", created.GetReservation().GetId())
	if err != nil {
		fmt.Println("wait for the reservation:", err)
		return
	}
	fmt.Println("reservation:", rsv.GetState(), "GPUs", len(rsv.GetBookings()), "on the node", rsv.GetBookings()[0].GetNodeId() == node.GetId())

	payload, err := structpb.NewStruct(map[string]any{"sections": []any{"gpus"}, "rescan": true})
	if err != nil {
		fmt.Println(err)
		return
	}
	run, err := c.Commands.Run(ctx, &computev1.CommandsServiceRunRequest{
		TenantId: "root", NodeId: rsv.GetBookings()[0].GetNodeId(), Kind: "inventory.refresh",
		Payload: payload, IdempotencyKey: "example-refresh",
	})
	if err != nil {
		fmt.Println("commands.run:", client.EnvelopeOf(err))
		return
	}
	cmd, err := c.WaitCommand(ctx, "root", run.GetCommand().GetNodeId(), run.GetCommand().GetId())
	if err != nil {
		fmt.Println("wait for the command:", err)
		return
	}
	fmt.Println("command:", cmd.GetKind(), cmd.GetState(), "GPUs found", cmd.GetResult().GetFields()["gpuCount"].GetNumberValue())

	released, err := c.Reservations.Release(ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: "root", ReservationId: rsv.GetId()})
	if err != nil {
		fmt.Println("reservations.release:", client.EnvelopeOf(err))
		return
	}
	fmt.Println("reservation:", released.GetReservation().GetState())
	// Output:
	// join token: true uses 1
	// node: adopted schedulable true GPUs 8 joined with the token true
	// reservation: bound GPUs 2 on the node true
	// command: inventory.refresh succeeded GPUs found 8
	// reservation: released
}

// startExampleControlPlane starts dev's control plane with no simulated
// fleet of its own, on a database of its own: an example has no testing.T
// for pgtest, so it resolves the server as pgtest does (TEST_DATABASE_URL,
// else the local server, else a private cluster) and creates an empty
// database, which the control plane migrates. stop stops the control plane
// and drops the database.
func startExampleControlPlane(ctx context.Context) (_ *dev.Env, stop func(), err error) {
	srv, err := pglocal.Resolve(ctx, pglocal.Options{URLEnv: pgtest.EnvURL, Fast: true})
	if err != nil {
		return nil, nil, err
	}
	var undo []func()
	cleanup := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	defer func() {
		if err != nil {
			cleanup()
		}
	}()
	undo = append(undo, func() { _ = srv.Stop() })

	name := "bcex_client_" + strings.ToLower(rand.Text()[:10])
	admin, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return nil, nil, err
	}
	defer func() { _ = admin.Close(context.WithoutCancel(ctx)) }()
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, nil, err
	}
	undo = append(undo, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if conn, err := pgx.Connect(ctx, srv.URL); err == nil {
			_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
			_ = conn.Close(ctx)
		}
	})
	dbURL, err := pglocal.DatabaseURL(srv.URL, name)
	if err != nil {
		return nil, nil, err
	}
	dataDir, err := os.MkdirTemp("", "bc-client-example-")
	if err != nil {
		return nil, nil, err
	}
	undo = append(undo, func() { _ = os.RemoveAll(dataDir) })

	port, none, noVPS := 0, 0, false
	cfg := &config.Config{
		Database: config.Database{URL: dbURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: dataDir, SimNodes: &none, SimMachines: &none, SimInstances: &noVPS},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond), LivenessInterval: config.Duration(200 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.Start(ctx, cfg, nil)
	if err != nil {
		return nil, nil, err
	}
	undo = append(undo, func() { env.Stop(context.Background()) })
	return env, cleanup, nil
}

// joinSimulatedNode runs one simulated daemon that joins env with token, as
// `bcd join --token token --joinservice-key <env.JoinKeyFile> --ca
// <env.CAFile>` would, and keeps its session open until the fleet stops.
func joinSimulatedNode(ctx context.Context, env *dev.Env, token string) (*sim.Fleet, error) {
	keyPEM, err := os.ReadFile(env.JoinKeyFile)
	if err != nil {
		return nil, err
	}
	pub, keyID, err := join.ParsePublicKey(keyPEM)
	if err != nil {
		return nil, err
	}
	caPEM, err := os.ReadFile(env.CAFile)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	return sim.Start(ctx, sim.Config{
		Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, CommandKey: env.CommandKey,
		Root: filepath.Join(filepath.Dir(env.CredentialPath), "node"), Prefix: "gpu-host",
	}, 1)
}
