package client

import (
	"time"

	"google.golang.org/grpc"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

// Client holds one generated client per API group of package computev1, all
// on one connection. The fields are the generated interfaces themselves, so
// every method, request and response is the API's own:
//
//	c := client.NewClient(conn)
//	nodes, err := c.Nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "root"})
//
// A Client is safe for concurrent use; it does not own the connection, so
// close that when done. TestClientCoversEveryService fails when a service of
// the compute.v1 proto files has no field here.
type Client struct {
	ApiKeys      computev1.ApiKeysServiceClient
	Audit        computev1.AuditServiceClient
	Capacity     computev1.CapacityServiceClient
	Commands     computev1.CommandsServiceClient
	Events       computev1.EventsServiceClient
	Identities   computev1.IdentitiesServiceClient
	Instances    computev1.InstancesServiceClient
	JoinTokens   computev1.JoinTokensServiceClient
	Metal        computev1.MetalServiceClient
	Nodes        computev1.NodesServiceClient
	Policies     computev1.PoliciesServiceClient
	Pools        computev1.PoolsServiceClient
	Reservations computev1.ReservationsServiceClient
	Rollouts     computev1.RolloutsServiceClient
	Sites        computev1.SitesServiceClient
	System       computev1.SystemServiceClient
	Tenants      computev1.TenantsServiceClient
	Tunnels      computev1.TunnelsServiceClient
	Webhooks     computev1.WebhooksServiceClient

	// PollInterval is how long the Wait methods pause between reads; zero
	// means [DefaultPollInterval].
	PollInterval time.Duration
}

// DefaultPollInterval is the pause between the reads of the Wait methods
// unless [Client.PollInterval] is set.
const DefaultPollInterval = 500 * time.Millisecond

// NewClient returns a [Client] whose groups all call through cc: a [*Conn]
// from [New] or [Dial], or any other [grpc.ClientConnInterface].
func NewClient(cc grpc.ClientConnInterface) *Client {
	return &Client{
		ApiKeys:      computev1.NewApiKeysServiceClient(cc),
		Audit:        computev1.NewAuditServiceClient(cc),
		Capacity:     computev1.NewCapacityServiceClient(cc),
		Commands:     computev1.NewCommandsServiceClient(cc),
		Events:       computev1.NewEventsServiceClient(cc),
		Identities:   computev1.NewIdentitiesServiceClient(cc),
		Instances:    computev1.NewInstancesServiceClient(cc),
		JoinTokens:   computev1.NewJoinTokensServiceClient(cc),
		Metal:        computev1.NewMetalServiceClient(cc),
		Nodes:        computev1.NewNodesServiceClient(cc),
		Policies:     computev1.NewPoliciesServiceClient(cc),
		Pools:        computev1.NewPoolsServiceClient(cc),
		Reservations: computev1.NewReservationsServiceClient(cc),
		Rollouts:     computev1.NewRolloutsServiceClient(cc),
		Sites:        computev1.NewSitesServiceClient(cc),
		System:       computev1.NewSystemServiceClient(cc),
		Tenants:      computev1.NewTenantsServiceClient(cc),
		Tunnels:      computev1.NewTunnelsServiceClient(cc),
		Webhooks:     computev1.NewWebhooksServiceClient(cc),
	}
}
