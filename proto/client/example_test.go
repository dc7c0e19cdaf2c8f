package client_test

import (
	"context"
	"fmt"
	"log"
	"net"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"
)

// Calls System.Version on a plaintext (h2c) server, such as the one
// `better-compute dev` runs, with an API key.
func Example() {
	addr, stop := startExampleServer() // a stand-in for the API server
	defer stop()

	ctx := context.Background()
	conn, err := client.Dial(ctx, "http://"+addr, client.WithToken("bck_example.secret"))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = conn.Close() }()

	c := client.NewClient(conn)
	v, err := c.System.Version(ctx, &computev1.VersionRequest{})
	if err != nil {
		log.Fatal(client.EnvelopeOf(err))
	}
	fmt.Println(v.GetVersion(), v.GetRequiredSchemaVersion())
	// Output: v1.2.3 7
}

// Reads the envelope of a failed call: the code and field come from the
// status's ErrorInfo detail.
func ExampleEnvelopeOf() {
	// What the API answers a request with an unknown tenant.
	st, _ := status.New(codes.NotFound, `tenant "acme" does not exist`).WithDetails(&errdetails.ErrorInfo{
		Reason:   "NOT_FOUND",
		Domain:   client.ErrorDomain,
		Metadata: map[string]string{"field": "tenantId"},
	})
	err := st.Err()

	env := client.EnvelopeOf(err)
	if env.Code == client.CodeNotFound {
		fmt.Println(env.Field)
	}
	fmt.Println(env)
	// Output:
	// tenantId
	// NOT_FOUND tenantId: tenant "acme" does not exist
}

type exampleSystem struct {
	computev1.UnimplementedSystemServiceServer
}

func (exampleSystem) Version(context.Context, *computev1.VersionRequest) (*computev1.VersionResponse, error) {
	return &computev1.VersionResponse{Version: "v1.2.3", RequiredSchemaVersion: 7}, nil
}

func startExampleServer() (addr string, stop func()) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	s := grpc.NewServer()
	computev1.RegisterSystemServiceServer(s, exampleSystem{})
	healthpb.RegisterHealthServer(s, health.NewServer())
	go func() { _ = s.Serve(lis) }()
	return lis.Addr().String(), s.Stop
}
