package client_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"
)

// The main workflow against the API server at BETTER_COMPUTE_URL with the
// API key in BETTER_COMPUTE_TOKEN: create a pool and a join token, wait for
// the node that joins with it (`bcd join --token …` on the server), reserve
// GPUs on it, run inventory.refresh on the reserved node and wait for the
// command to finish, then release the reservation.
//
// services/dev's Example_clientWorkflow runs the same calls, with a
// simulated node joining, against a real control plane under `go test`.
func Example_workflow() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	conn, err := client.Dial(ctx, os.Getenv("BETTER_COMPUTE_URL"), client.WithToken(os.Getenv("BETTER_COMPUTE_TOKEN")))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	c := client.NewClient(conn)

	pool, err := c.Pools.Create(ctx, &computev1.PoolsServiceCreateRequest{
		TenantId: "root", Name: "h200", Class: "gpu", IdempotencyKey: "example-pool",
	})
	if err != nil {
		log.Fatal("pools.create: ", client.EnvelopeOf(err))
	}
	poolID := pool.GetPool().GetId()
	tok, err := c.JoinTokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{
		TenantId: "root", PoolId: poolID, Name: "rack-1", Uses: 1, IdempotencyKey: "example-token",
	})
	if err != nil {
		log.Fatal("joinTokens.create: ", client.EnvelopeOf(err))
	}
	fmt.Println("on the node: bcd join --token", tok.GetToken(), "…")

	nodes, err := c.WaitSchedulable(ctx, "root", poolID, 1)
	if err != nil {
		log.Fatal("wait for the node: ", err)
	}
	node := nodes[0]
	fmt.Println("node", node.GetId(), node.GetState(), len(node.GetDevices()), "GPUs")

	created, err := c.Reservations.Create(ctx, &computev1.ReservationsServiceCreateRequest{
		TenantId: "root", PoolId: poolID, GpuCount: 2, IdempotencyKey: "example-reservation",
	})
	if err != nil {
		log.Fatal("reservations.create: ", client.EnvelopeOf(err))
	}
	rsv, err := c.WaitReservation(ctx, "root", created.GetReservation().GetId())
	if err != nil {
		log.Fatal("wait for the reservation: ", err)
	}
	if rsv.GetState() != client.ReservationBound {
		log.Fatalf("reservation %s is %s: %s", rsv.GetId(), rsv.GetState(), rsv.GetReason())
	}
	fmt.Println("reservation", rsv.GetId(), rsv.GetState(), "on", rsv.GetBookings()[0].GetNodeId())

	payload, err := structpb.NewStruct(map[string]any{"sections": []any{"gpus"}, "rescan": true})
	if err != nil {
		log.Fatal(err)
	}
	run, err := c.Commands.Run(ctx, &computev1.CommandsServiceRunRequest{
		TenantId: "root", NodeId: rsv.GetBookings()[0].GetNodeId(), Kind: "inventory.refresh",
		Payload: payload, IdempotencyKey: "example-refresh",
	})
	if err != nil {
		log.Fatal("commands.run: ", client.EnvelopeOf(err))
	}
	cmd, err := c.WaitCommand(ctx, "root", run.GetCommand().GetNodeId(), run.GetCommand().GetId())
	if err != nil {
		log.Fatal("wait for the command: ", err)
	}
	if cmd.GetState() != client.CommandSucceeded {
		log.Fatalf("command %s %s: %s", cmd.GetId(), cmd.GetState(), cmd.GetReason())
	}
	fmt.Println("inventory.refresh found", cmd.GetResult().GetFields()["gpuCount"].GetNumberValue(), "GPUs")

	if _, err := c.Reservations.Release(ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: "root", ReservationId: rsv.GetId()}); err != nil {
		log.Fatal("reservations.release: ", client.EnvelopeOf(err))
	}
}
