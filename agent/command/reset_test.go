package command_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

func gpuReset(force bool, uuids ...string) *agentv1.CommandBody {
	return &agentv1.CommandBody{Kind: &agentv1.CommandBody_GpuReset{GpuReset: &agentv1.GpuReset{GpuUuids: uuids, Force: force, Reason: "test"}}}
}

// signedReset is a gpu.reset command signed with the fixture's key.
func (f *fixture) signedReset(seq int64, body *agentv1.CommandBody) *agentv1.Command {
	c := cmd(seq, command.KindGPUReset, body)
	commandsig.Sign(c, trustDomain, f.priv)
	return c
}

// finish returns the final update of seq after its ACCEPTED.
func (f *fixture) finish(t *testing.T, seq int64) *agentv1.CommandUpdate {
	t.Helper()
	expect(t, f.next(t), seq, accepted, noReject)
	u := f.next(t)
	if u.GetSeq() != seq {
		t.Fatalf("update %v, want seq %d", u, seq)
	}
	return u
}

func TestGPUReset(t *testing.T) {
	t.Parallel()

	t.Run("unsigned: BAD_SIGNATURE", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.e.Handle(cmd(1, command.KindGPUReset, gpuReset(false, "GPU-x")))
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
	})

	t.Run("refuses with compute processes unless forced; a fallen-off GPU comes back", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		inv := f.cfg.Inventory.(*inventory.Collector)
		gpus, err := inv.GPUs(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		lost, busy := gpus[2].GetUuid(), gpus[5].GetUuid()
		if err := inv.Faults().Inject(2, inventory.Fault{XIDs: []uint32{79}}); err != nil {
			t.Fatal(err)
		}
		if err := inv.Faults().Inject(5, inventory.Fault{ComputePIDs: []uint32{4242}, RowRemapPending: true}); err != nil {
			t.Fatal(err)
		}
		if g, _ := inv.GPUs(t.Context()); g[2].GetHealthy() || g[5].GetHealthy() {
			t.Fatalf("faults not seen: %v %v", g[2], g[5])
		}

		// The busy GPU is refused, and nothing is reset (the lost one
		// asked first stays lost).
		u := f.finish(t, f.signedResetSeq(1, gpuReset(false, lost, busy)))
		expect(t, u, 1, failed, noReject)
		if !strings.Contains(u.GetReason(), "compute processes are running on GPU "+busy+" (1: pids 4242)") || !strings.Contains(u.GetReason(), "force") {
			t.Fatalf("reason %q", u.GetReason())
		}
		if g, _ := inv.GPUs(t.Context()); g[2].GetHealthy() {
			t.Fatal("a refused gpu.reset reset a GPU")
		}

		// The lost GPU alone: reset, healthy again, a fresh report sent.
		u = f.finish(t, f.signedResetSeq(2, gpuReset(false, lost)))
		expect(t, u, 2, succeeded, noReject)
		res := u.GetResult().GetGpuReset()
		if len(res.GetResetUuids()) != 1 || res.GetResetUuids()[0] != lost || len(res.GetGpus()) != 1 || !res.GetGpus()[0].GetHealthy() {
			t.Fatalf("result %v", res)
		}
		rep := <-f.reports
		if len(rep.GetGpus()) != 8 || !rep.GetGpus()[2].GetHealthy() || rep.GetGpus()[5].GetHealthy() {
			t.Fatalf("report after reset %v", rep.GetGpus())
		}

		// Forced: the busy GPU is reset (its processes die with it).
		u = f.finish(t, f.signedResetSeq(3, gpuReset(true, busy)))
		expect(t, u, 3, succeeded, noReject)
		if pids, _, _ := inv.ComputeProcesses(t.Context(), busy); len(pids) != 0 {
			t.Fatalf("processes after a forced reset: %v", pids)
		}
		<-f.reports
	})

	t.Run("bad payloads and a failing resetter fail the command", func(t *testing.T) {
		t.Parallel()
		var mu sync.Mutex
		var calls []string
		f := setup(t, func(c *command.Config) {
			c.Resetter = resetFunc(func(_ context.Context, uuid string) error {
				mu.Lock()
				defer mu.Unlock()
				calls = append(calls, uuid)
				return errors.New("nvidia-smi: GPU busy")
			})
		})
		gpus, _ := f.cfg.Inventory.(*inventory.Collector).GPUs(t.Context())
		many := make([]string, commandkinds.MaxResetGPUs+1)
		for i := range many {
			many[i] = "GPU-" + strings.Repeat("a", i+1)
		}
		for seq, tc := range []struct {
			body *agentv1.CommandBody
			want string
		}{
			{gpuReset(false), "at least one GPU"},
			{gpuReset(false, many...), "65 GPUs, at most 64"},
			{gpuReset(false, gpus[0].GetUuid(), gpus[0].GetUuid()), "named twice"},
			{gpuReset(false, "GPU-nope"), "no GPU GPU-nope on this node"},
			{gpuReset(false, gpus[1].GetUuid()), "reset " + gpus[1].GetUuid() + ": nvidia-smi: GPU busy"},
		} {
			s := int64(seq + 1)
			u := f.finish(t, f.signedResetSeq(s, tc.body))
			expect(t, u, s, failed, noReject)
			if !strings.Contains(u.GetReason(), tc.want) {
				t.Errorf("seq %d: reason %q, want %q", s, u.GetReason(), tc.want)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if len(calls) != 1 || calls[0] != gpus[1].GetUuid() {
			t.Fatalf("resetter calls %v", calls)
		}
	})

	t.Run("without a GPU inventory: UNSUPPORTED", func(t *testing.T) {
		t.Parallel()
		f := setup(t, func(c *command.Config) { c.Inventory = reportOnly{} })
		f.e.Handle(f.signedReset(1, gpuReset(false, "GPU-x")))
		u := f.next(t)
		expect(t, u, 1, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		if !strings.Contains(u.GetReason(), "gpu.reset is not available") {
			t.Errorf("reason %q", u.GetReason())
		}
	})
}

// signedResetSeq hands a signed gpu.reset to the executor and returns seq.
func (f *fixture) signedResetSeq(seq int64, body *agentv1.CommandBody) int64 {
	f.e.Handle(f.signedReset(seq, body))
	return seq
}

type resetFunc func(ctx context.Context, uuid string) error

func (r resetFunc) Reset(ctx context.Context, uuid string) error { return r(ctx, uuid) }

type reportOnly struct{}

func (reportOnly) Report(context.Context, []string) (*agentv1.InventoryReport, error) {
	return &agentv1.InventoryReport{}, nil
}
