package api_test

import (
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestInstancesRebootIsACommand: instances.reboot queues instance.reboot
// on the instance's host with the deadline asked for (commands.run's
// bounds), replays under its idempotency key, and refuses a stopped or
// deleted instance.
func TestInstancesRebootIsACommand(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{}, apiOnly)
	pool := h.vpsPool(t, "r", 1, 0)
	c := computev1.NewInstancesServiceClient(h.conn)
	ctx := as(h.root)
	cr, err := c.Create(ctx, small(pool))
	if err != nil {
		t.Fatal(err)
	}
	in := cr.GetInstance()

	t.Run("bad deadlines name notAfterSeconds", func(t *testing.T) {
		for _, secs := range []int32{-1, 9, 3601} {
			_, err := c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root", InstanceId: in.GetId(), NotAfterSeconds: secs})
			wantCode(t, err, fault.InvalidInput, "notAfterSeconds")
		}
		_, err := c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root"})
		wantCode(t, err, fault.InvalidInput, "instanceId")
		_, err = c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root", InstanceId: "inst_nope"})
		wantCode(t, err, fault.NotFound, "instanceId")
	})
	t.Run("queues instance.reboot on the host", func(t *testing.T) {
		before := time.Now()
		r, err := c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root", InstanceId: in.GetId(), NotAfterSeconds: 30, IdempotencyKey: "rb-1"})
		if err != nil {
			t.Fatal(err)
		}
		cmd := r.GetCommand()
		if cmd.GetKind() != "instance.reboot" || cmd.GetNodeId() != in.GetNodeId() || cmd.GetState() != "pending" ||
			cmd.GetPayload().GetFields()["instanceId"].GetStringValue() != in.GetId() || r.GetInstance().GetId() != in.GetId() {
			t.Fatalf("reboot: %v", r)
		}
		if na := cmd.GetNotAfter().AsTime(); na.Before(before.Add(25*time.Second)) || na.After(time.Now().Add(35*time.Second)) {
			t.Fatalf("not after %v, want about 30 s from now", na)
		}
		again, err := c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root", InstanceId: in.GetId(), NotAfterSeconds: 30, IdempotencyKey: "rb-1"})
		if err != nil || again.GetCommand().GetId() != cmd.GetId() {
			t.Fatalf("replay: %v %v, want command %s", again, err, cmd.GetId())
		}
		if n := h.count(t, `SELECT count(*) FROM commands WHERE kind = 'instance.reboot' AND node_id = $1`, in.GetNodeId()); n != 1 {
			t.Fatalf("%d instance.reboot commands, want 1", n)
		}
		// Not a commands.run kind.
		_, err = computev1.NewCommandsServiceClient(h.conn).Run(ctx, &computev1.CommandsServiceRunRequest{TenantId: "root", NodeId: in.GetNodeId(), Kind: "instance.reboot"})
		wantCode(t, err, fault.Unsupported, "kind")
	})
	t.Run("a stopped or deleted instance is CONFLICT", func(t *testing.T) {
		if _, err := c.Stop(ctx, &computev1.InstancesServiceStopRequest{TenantId: "root", InstanceId: in.GetId()}); err != nil {
			t.Fatal(err)
		}
		_, err := c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root", InstanceId: in.GetId()})
		wantCode(t, err, fault.Conflict, "instanceId")
		if _, err := c.Delete(ctx, &computev1.InstancesServiceDeleteRequest{TenantId: "root", InstanceId: in.GetId()}); err != nil {
			t.Fatal(err)
		}
		_, err = c.Reboot(ctx, &computev1.InstancesServiceRebootRequest{TenantId: "root", InstanceId: in.GetId()})
		wantCode(t, err, fault.Conflict, "instanceId")
	})
}
