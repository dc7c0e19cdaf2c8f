package redfish_test

import (
	"context"
	"fmt"

	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/site/redfish"
)

// Example PXE-boots a machine once through its BMC, as the site agent does
// for inspection: read the inventory, set a one-time PXE override, power on.
func Example() {
	bmc := fakebmc.Must(fakebmc.Config{
		Username:  "admin",
		Password:  "example-password",
		OnPowerOn: func(target string) { fmt.Println("machine boots from", target) },
	})
	srv, err := fakebmc.StartTLS(bmc, "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer srv.Close()

	ctx := context.Background()
	c, err := redfish.Connect(ctx, redfish.Config{
		Endpoint: srv.URL, Username: "admin", Password: "example-password",
		CAPEM: srv.CAPEM, // the BMC's self-signed certificate, pinned
	})
	if err != nil {
		panic(err)
	}
	defer c.Close()

	inv, err := c.Inventory(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println(inv.SerialNumber, inv.PowerState, inv.CPUCount, "CPUs", inv.MemoryMiB/1024, "GiB", inv.NICs[0].MAC)
	if err := c.BootOnce(ctx, redfish.BootPXE); err != nil {
		panic(err)
	}
	if err := c.Power(ctx, redfish.ActionOn); err != nil {
		panic(err)
	}
	fmt.Println(bmc.BootOverride())
	// Output:
	// SIM0000001 Off 2 CPUs 1024 GiB 02:00:00:00:00:01
	// machine boots from Pxe
	// Disabled None
}
