package command_test

import (
	"context"
	"crypto/ed25519"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

const wait = 20 * time.Second

const node = "node_1"

// trustDomain is the executor's: destructive commands are signed for it.
const trustDomain = "test.bettercompute"

type fixture struct {
	root    string
	cfg     command.Config
	e       *command.Executor
	updates chan *agentv1.CommandUpdate
	reports chan *agentv1.InventoryReport
	priv    ed25519.PrivateKey
	mock    *server.Server
	reboots atomic.Int64
	// outputs are the output chunks next and none passed over (updates
	// that carry one), in the order sent.
	outputs []*agentv1.CommandUpdate
}

// setup starts an Executor for node_1 over the mock DGX H200, with a
// pinned signing key, a fake reboot hook and mod applied to its config.
func setup(t *testing.T, mod func(*command.Config)) *fixture {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	mock := inventory.NewMock()
	inv, err := inventory.New(mock, inventory.Config{Hostname: "test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	f := &fixture{root: t.TempDir(), updates: make(chan *agentv1.CommandUpdate, 100), reports: make(chan *agentv1.InventoryReport, 10), priv: priv, mock: mock}
	f.cfg = command.Config{
		Root: f.root, NodeID: node, BootID: "boot-1", Logger: slog.New(slog.DiscardHandler),
		Send:        func(u *agentv1.CommandUpdate) { f.updates <- u },
		Inventory:   inv,
		OnInventory: func(r *agentv1.InventoryReport) { f.reports <- r },
		CommandKey:  pub,
		TrustDomain: trustDomain,
		RebootHook:  func(context.Context, string) error { f.reboots.Add(1); return nil },
	}
	if mod != nil {
		mod(&f.cfg)
	}
	f.e = f.open(t, f.cfg)
	return f
}

func (f *fixture) open(t *testing.T, cfg command.Config) *command.Executor {
	t.Helper()
	e, err := command.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// cmd builds a command of kind with body, due in ten minutes.
func cmd(seq int64, kind string, body *agentv1.CommandBody) *agentv1.Command {
	b, err := proto.Marshal(body)
	if err != nil {
		panic(err)
	}
	return &agentv1.Command{Id: "cmd_" + kind, NodeId: node, Seq: seq, Kind: kind, Body: b,
		NotAfter: timestamppb.New(time.Now().Add(10 * time.Minute)), Timeout: durationpb.New(time.Minute)}
}

func diag() *agentv1.CommandBody {
	return &agentv1.CommandBody{Kind: &agentv1.CommandBody_DiagNvml{DiagNvml: &agentv1.DiagNvml{}}}
}

func reboot() *agentv1.CommandBody {
	return &agentv1.CommandBody{Kind: &agentv1.CommandBody_NodeReboot{NodeReboot: &agentv1.NodeReboot{Reason: "test"}}}
}

func logs(maxBytes uint64, sources ...string) *agentv1.CommandBody {
	return &agentv1.CommandBody{Kind: &agentv1.CommandBody_LogsCollect{LogsCollect: &agentv1.LogsCollect{MaxBytes: maxBytes, Sources: sources}}}
}

// next returns the next update that is not an output chunk (those it
// passes over go to f.outputs).
func (f *fixture) next(t *testing.T) *agentv1.CommandUpdate {
	t.Helper()
	for {
		select {
		case u := <-f.updates:
			if u.GetOutput() != nil {
				f.outputs = append(f.outputs, u)
				continue
			}
			return u
		case <-time.After(wait):
			t.Fatalf("no CommandUpdate within %s", wait)
			return nil
		}
	}
}

// none asserts that no update is waiting (Handle answers synchronously, so
// an answer it gave would already be here).
func (f *fixture) none(t *testing.T) {
	t.Helper()
	for {
		select {
		case u := <-f.updates:
			if u.GetOutput() != nil {
				f.outputs = append(f.outputs, u)
				continue
			}
			t.Fatalf("unexpected update %v", u)
		default:
			return
		}
	}
}

func expect(t *testing.T, u *agentv1.CommandUpdate, seq int64, outcome agentv1.CommandOutcome, reject agentv1.RejectCode) {
	t.Helper()
	if u.GetSeq() != seq || u.GetOutcome() != outcome || u.GetReject() != reject {
		t.Fatalf("update %v, want seq %d %v %v", u, seq, outcome, reject)
	}
}

const (
	accepted  = agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED
	rejected  = agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED
	succeeded = agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED
	failed    = agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED
	cancelled = agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED
	noReject  = agentv1.RejectCode_REJECT_CODE_UNSPECIFIED
)

// blocking is an executor that runs until release is closed or its context
// ends; started receives each run's seq-less signal.
type blocking struct {
	started chan struct{}
	release chan struct{}
	runs    atomic.Int64
}

func newBlocking() *blocking {
	return &blocking{started: make(chan struct{}, 10), release: make(chan struct{})}
}

func (b *blocking) fn(ctx context.Context, _ *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	b.runs.Add(1)
	b.started <- struct{}{}
	select {
	case <-b.release:
		return &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiagNvml{DiagNvml: &agentv1.DiagNvmlResult{DriverVersion: "blocked"}}}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func TestChecks(t *testing.T) {
	t.Parallel()

	t.Run("UNSUPPORTED: unknown kind, journaled", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.e.Handle(cmd(1, "gpu.melt", diag()))
		u := f.next(t)
		expect(t, u, 1, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		if !strings.Contains(u.GetReason(), "gpu.melt") {
			t.Errorf("reason %q", u.GetReason())
		}
		f.e.Handle(cmd(1, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
	})

	t.Run("UNSUPPORTED: another node, not journaled", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		c := cmd(1, command.KindDiagNvml, diag())
		c.NodeId = "node_2"
		f.e.Handle(c)
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		f.e.Handle(cmd(1, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 1, accepted, noReject)
	})

	t.Run("UNSUPPORTED: body of another kind, denied kind, reboot not allowed", func(t *testing.T) {
		t.Parallel()
		f := setup(t, func(c *command.Config) { c.DenyKinds = []string{command.KindLogsCollect}; c.RebootHook = nil })
		f.e.Handle(cmd(1, command.KindDiagNvml, reboot()))
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		bad := cmd(2, command.KindDiagNvml, diag())
		bad.Body = []byte{0xff, 0xff}
		f.e.Handle(bad)
		expect(t, f.next(t), 2, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		f.e.Handle(cmd(3, command.KindLogsCollect, logs(0)))
		expect(t, f.next(t), 3, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		c := cmd(4, command.KindNodeReboot, reboot())
		commandsig.Sign(c, trustDomain, f.priv)
		f.e.Handle(c)
		u := f.next(t)
		expect(t, u, 4, rejected, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED)
		if !strings.Contains(u.GetReason(), "--allow-reboot") {
			t.Errorf("reason %q", u.GetReason())
		}
	})

	t.Run("STALE_GENERATION held, then satisfied before not_after: runs", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		c := cmd(1, command.KindDiagNvml, diag())
		c.MinGeneration = 3
		f.e.Handle(c)
		f.none(t)
		f.e.SetApplied(2)
		f.none(t)
		f.e.Handle(c) // a re-delivery while held: still no answer
		f.none(t)
		f.e.SetApplied(3)
		expect(t, f.next(t), 1, accepted, noReject)
		expect(t, f.next(t), 1, succeeded, noReject)
	})

	t.Run("STALE_GENERATION still ahead at not_after: rejected", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.e.SetApplied(1)
		c := cmd(1, command.KindDiagNvml, diag())
		c.MinGeneration = 2
		c.NotAfter = timestamppb.New(time.Now().Add(50 * time.Millisecond))
		f.e.Handle(c)
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_STALE_GENERATION)
		f.e.SetApplied(2) // too late: journaled
		f.e.Handle(c)
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_STALE_GENERATION)
	})

	t.Run("EXPIRED past not_after", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		c := cmd(1, command.KindDiagNvml, diag())
		c.NotAfter = timestamppb.New(time.Now().Add(-time.Second))
		f.e.Handle(c)
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_EXPIRED)
	})

	t.Run("BUSY when the lane is full, not journaled", func(t *testing.T) {
		t.Parallel()
		b := newBlocking()
		f := setup(t, func(c *command.Config) { c.Executors = map[string]command.Func{command.KindDiagNvml: b.fn} })
		f.e.Handle(cmd(1, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 1, accepted, noReject)
		<-b.started
		f.e.Handle(cmd(2, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 2, rejected, agentv1.RejectCode_REJECT_CODE_BUSY)
		// Another lane still has credit.
		f.e.Handle(cmd(3, command.KindLogsCollect, logs(0)))
		expect(t, f.next(t), 3, accepted, noReject)
		expect(t, f.next(t), 3, succeeded, noReject)
		close(b.release)
		expect(t, f.next(t), 1, succeeded, noReject)
		f.e.Handle(cmd(2, command.KindDiagNvml, diag())) // the retry runs
		expect(t, f.next(t), 2, accepted, noReject)
		expect(t, f.next(t), 2, succeeded, noReject)
	})

	t.Run("BAD_SIGNATURE unsigned, wrongly signed, no pinned key; signed: accepted, hook once", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.e.Handle(cmd(1, command.KindNodeReboot, reboot()))
		expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
		_, other, _ := ed25519.GenerateKey(nil)
		c := cmd(2, command.KindNodeReboot, reboot())
		commandsig.Sign(c, trustDomain, other)
		f.e.Handle(c)
		expect(t, f.next(t), 2, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
		c = cmd(3, command.KindNodeReboot, reboot())
		commandsig.Sign(c, trustDomain, f.priv)
		c.MinGeneration = 0
		c.Body = append(c.Body, 0x22, 0x00) // tampered after signing (still a NodeReboot)
		f.e.Handle(c)
		expect(t, f.next(t), 3, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)

		c = cmd(4, command.KindNodeReboot, reboot())
		commandsig.Sign(c, trustDomain, f.priv)
		f.e.Handle(c)
		expect(t, f.next(t), 4, accepted, noReject)
		f.e.Handle(c) // re-delivery: journaled, not rebooted again
		expect(t, f.next(t), 4, accepted, noReject)
		f.e.Close()
		if n := f.reboots.Load(); n != 1 {
			t.Fatalf("reboot hook called %d times, want 1", n)
		}
		f.none(t) // a self-terminating command never answers SUCCEEDED itself

		nokey := setup(t, func(c *command.Config) { c.CommandKey = nil })
		c = cmd(1, command.KindNodeReboot, reboot())
		commandsig.Sign(c, trustDomain, nokey.priv)
		nokey.e.Handle(c)
		u := nokey.next(t)
		expect(t, u, 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
		if !strings.Contains(u.GetReason(), "--command-key") {
			t.Errorf("reason %q", u.GetReason())
		}
	})
}

func TestJournal(t *testing.T) {
	t.Parallel()

	t.Run("duplicate delivery while running and when finished runs once", func(t *testing.T) {
		t.Parallel()
		b := newBlocking()
		f := setup(t, func(c *command.Config) { c.Executors = map[string]command.Func{command.KindDiagNvml: b.fn} })
		c := cmd(1, command.KindDiagNvml, diag())
		f.e.Handle(c)
		expect(t, f.next(t), 1, accepted, noReject)
		<-b.started
		f.e.Handle(c)
		expect(t, f.next(t), 1, accepted, noReject)
		close(b.release)
		expect(t, f.next(t), 1, succeeded, noReject)
		f.e.Handle(c)
		u := f.next(t)
		expect(t, u, 1, succeeded, noReject)
		if u.GetResult().GetDiagNvml().GetDriverVersion() != "blocked" {
			t.Errorf("re-sent result %v", u.GetResult())
		}
		// A new Executor on the same root (a restarted daemon) answers
		// from the journal too.
		e2 := f.open(t, f.cfg)
		e2.Handle(c)
		expect(t, f.next(t), 1, succeeded, noReject)
		if n := b.runs.Load(); n != 1 {
			t.Fatalf("ran %d times, want 1", n)
		}
	})

	t.Run("cancel running, unknown, finished and held", func(t *testing.T) {
		t.Parallel()
		b := newBlocking()
		f := setup(t, func(c *command.Config) { c.Executors = map[string]command.Func{command.KindDiagNvml: b.fn} })
		f.e.Handle(cmd(1, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 1, accepted, noReject)
		<-b.started
		f.e.Cancel(&agentv1.CommandCancel{Id: "cmd_diag.nvml", Seq: 1})
		expect(t, f.next(t), 1, cancelled, noReject)

		f.e.Cancel(&agentv1.CommandCancel{Id: "cmd_x", Seq: 2})
		expect(t, f.next(t), 2, cancelled, noReject)
		f.e.Handle(cmd(2, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 2, cancelled, noReject)

		f.e.Handle(cmd(3, command.KindLogsCollect, logs(0)))
		expect(t, f.next(t), 3, accepted, noReject)
		expect(t, f.next(t), 3, succeeded, noReject)
		f.e.Cancel(&agentv1.CommandCancel{Id: "cmd_logs.collect", Seq: 3})
		expect(t, f.next(t), 3, succeeded, noReject)

		held := cmd(4, command.KindLogsCollect, logs(0))
		held.MinGeneration = 9
		f.e.Handle(held)
		f.none(t)
		f.e.Cancel(&agentv1.CommandCancel{Id: "cmd_logs.collect", Seq: 4})
		expect(t, f.next(t), 4, cancelled, noReject)
		f.e.SetApplied(9) // no longer held: nothing runs
		f.none(t)
		f.e.Handle(held)
		expect(t, f.next(t), 4, cancelled, noReject)
		if n := b.runs.Load(); n != 1 {
			t.Fatalf("ran %d times, want 1", n)
		}
	})

	t.Run("timeout fails the command", func(t *testing.T) {
		t.Parallel()
		b := newBlocking()
		f := setup(t, func(c *command.Config) { c.Executors = map[string]command.Func{command.KindDiagNvml: b.fn} })
		c := cmd(1, command.KindDiagNvml, diag())
		c.Timeout = durationpb.New(20 * time.Millisecond)
		f.e.Handle(c)
		expect(t, f.next(t), 1, accepted, noReject)
		u := f.next(t)
		expect(t, u, 1, failed, noReject)
		if !strings.HasPrefix(u.GetReason(), "timeout") {
			t.Errorf("reason %q", u.GetReason())
		}
	})

	t.Run("restart: accepted reboot from another boot succeeds, interrupted command fails", func(t *testing.T) {
		t.Parallel()
		b := newBlocking()
		f := setup(t, func(c *command.Config) { c.Executors = map[string]command.Func{command.KindDiagNvml: b.fn} })
		r := cmd(1, command.KindNodeReboot, reboot())
		commandsig.Sign(r, trustDomain, f.priv)
		f.e.Handle(r)
		expect(t, f.next(t), 1, accepted, noReject)
		f.e.Handle(cmd(2, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 2, accepted, noReject)
		<-b.started

		// Same boot (the daemon restarted, the machine did not): the
		// reboot stays accepted, the running command is interrupted.
		same := f.open(t, f.cfg)
		same.Handle(r)
		expect(t, f.next(t), 1, accepted, noReject)
		same.Handle(cmd(2, command.KindDiagNvml, diag()))
		u := f.next(t)
		expect(t, u, 2, failed, noReject)
		if u.GetReason() != command.InterruptedReason {
			t.Errorf("reason %q", u.GetReason())
		}
		same.Close()

		cfg := f.cfg
		cfg.BootID = "boot-2"
		next := f.open(t, cfg)
		next.Handle(r)
		expect(t, f.next(t), 1, succeeded, noReject)
		// The first boot's executor calls the hook after it sent ACCEPTED,
		// on its own goroutine: wait for that one call, and no second.
		for deadline := time.Now().Add(30 * time.Second); f.reboots.Load() == 0 && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond) // between reads, not an assertion
		}
		if n := f.reboots.Load(); n != 1 {
			t.Fatalf("reboot hook called %d times, want 1", n)
		}
		close(b.release)
	})
}

func TestKinds(t *testing.T) {
	t.Parallel()

	t.Run("diag.nvml on the mock: eight healthy GPUs", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.e.Handle(cmd(1, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 1, accepted, noReject)
		u := f.next(t)
		expect(t, u, 1, succeeded, noReject)
		res := u.GetResult().GetDiagNvml()
		if len(res.GetGpus()) != 8 || res.GetDriverVersion() == "" {
			t.Fatalf("result %v", res)
		}
		for _, g := range res.GetGpus() {
			if !g.GetHealthy() || g.GetTemperatureCelsius() == 0 {
				t.Errorf("gpu %v", g)
			}
		}
	})

	t.Run("diag.nvml with a hot GPU and one with ECC errors fails with the result", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		hot := f.mock.Devices[3].(*server.Device)
		hot.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 95, nvml.SUCCESS }
		ecc := f.mock.Devices[5].(*server.Device)
		ecc.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 2, nvml.SUCCESS }
		f.e.Handle(cmd(1, command.KindDiagNvml, diag()))
		expect(t, f.next(t), 1, accepted, noReject)
		u := f.next(t)
		expect(t, u, 1, failed, noReject)
		if !strings.Contains(u.GetReason(), "2 of 8 GPUs unhealthy") {
			t.Errorf("reason %q", u.GetReason())
		}
		gpus := u.GetResult().GetDiagNvml().GetGpus()
		if len(gpus) != 8 || gpus[3].GetHealthy() || gpus[3].GetTemperatureCelsius() != 95 || gpus[5].GetHealthy() || gpus[5].GetUncorrectableEccErrors() != 2 || !gpus[0].GetHealthy() {
			t.Fatalf("gpus %v", gpus)
		}
		// Only the GPUs asked for; an unknown UUID is unhealthy.
		body := &agentv1.CommandBody{Kind: &agentv1.CommandBody_DiagNvml{DiagNvml: &agentv1.DiagNvml{GpuUuids: []string{gpus[0].GetUuid(), "GPU-nope"}}}}
		f.e.Handle(cmd(2, command.KindDiagNvml, body))
		expect(t, f.next(t), 2, accepted, noReject)
		u = f.next(t)
		expect(t, u, 2, failed, noReject)
		if g := u.GetResult().GetDiagNvml().GetGpus(); len(g) != 2 || !g[0].GetHealthy() || g[1].GetReason() != "no such GPU" {
			t.Fatalf("gpus %v", g)
		}
	})

	t.Run("inventory.refresh rescans and hands the report over", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		body := &agentv1.CommandBody{Kind: &agentv1.CommandBody_InventoryRefresh{InventoryRefresh: &agentv1.InventoryRefresh{Sections: []string{"gpus"}, Rescan: true}}}
		f.e.Handle(cmd(1, command.KindInventoryRefresh, body))
		expect(t, f.next(t), 1, accepted, noReject)
		u := f.next(t)
		expect(t, u, 1, succeeded, noReject)
		if r := u.GetResult().GetInventoryRefresh(); r.GetGpuCount() != 8 || len(r.GetSections()) != 1 {
			t.Fatalf("result %v", r)
		}
		rep := <-f.reports
		if len(rep.GetGpus()) != 8 || rep.GetHost() != nil {
			t.Fatalf("report %v", rep)
		}
	})

	t.Run("logs.collect keeps the tail within max_bytes; unknown source fails", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		l, err := command.OpenLog(command.LogPath(f.root), 4096)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 200 {
			if _, err := l.Write([]byte(strings.Repeat("x", 30) + " line " + string(rune('a'+i%26)) + "\n")); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := l.Write([]byte("the last line\n")); err != nil {
			t.Fatal(err)
		}
		_ = l.Close()
		if st, err := os.Stat(command.LogPath(f.root)); err != nil || st.Size() > 4096 {
			t.Fatalf("log not bounded: %v %v", st.Size(), err)
		}
		if _, err := os.Stat(command.LogPath(f.root) + ".1"); err != nil {
			t.Fatalf("no rotated log: %v", err)
		}

		f.e.Handle(cmd(1, command.KindLogsCollect, logs(1000)))
		expect(t, f.next(t), 1, accepted, noReject)
		u := f.next(t)
		expect(t, u, 1, succeeded, noReject)
		r := u.GetResult().GetLogsCollect()
		if !r.GetTruncated() || len(r.GetData()) > 1000 || len(r.GetData()) < 900 || !strings.HasSuffix(string(r.GetData()), "the last line\n") || !strings.HasPrefix(string(r.GetData()), "xxx") {
			t.Fatalf("truncated %v, %d bytes: %q", r.GetTruncated(), len(r.GetData()), r.GetData())
		}

		f.e.Handle(cmd(2, command.KindLogsCollect, logs(1<<30)))
		expect(t, f.next(t), 2, accepted, noReject)
		u = f.next(t)
		if r := u.GetResult().GetLogsCollect(); r.GetTruncated() || !strings.HasSuffix(string(r.GetData()), "the last line\n") {
			t.Fatalf("whole log: truncated %v, %d bytes", r.GetTruncated(), len(r.GetData()))
		}

		f.e.Handle(cmd(3, command.KindLogsCollect, logs(0, "dmesg")))
		expect(t, f.next(t), 3, accepted, noReject)
		u = f.next(t)
		expect(t, u, 3, failed, noReject)
		if !strings.Contains(u.GetReason(), `unknown log source "dmesg"`) {
			t.Errorf("reason %q", u.GetReason())
		}
	})

	t.Run("a corrupted journal entry stops the daemon from starting", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		if err := os.WriteFile(filepath.Join(f.root, command.JournalDir, "cmd-9.json"), []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := command.New(f.cfg); err == nil || !strings.Contains(err.Error(), "cmd-9.json") {
			t.Fatalf("New: %v", err)
		}
	})
}

// TestUnsignedCommandDoesNotBurnSeq: an unsigned (or badly signed)
// destructive command under seq N — one a compromised gateway made up — is
// rejected BAD_SIGNATURE before anything is journaled or held, so the
// validly signed command under the same seq still runs, also after a
// restart.
func TestUnsignedCommandDoesNotBurnSeq(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	forged := cmd(5, command.KindNodeReboot, reboot())
	forged.Id = "cmd_forged"
	f.e.Handle(forged)
	expect(t, f.next(t), 5, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
	// One that would be held for a generation far ahead is not held either.
	ahead := cmd(5, command.KindNodeReboot, reboot())
	ahead.Id, ahead.MinGeneration = "cmd_forged_ahead", 1<<40
	f.e.Handle(ahead)
	expect(t, f.next(t), 5, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
	if _, err := os.Stat(filepath.Join(f.root, command.JournalDir, "cmd-5.json")); !os.IsNotExist(err) {
		t.Fatalf("the rejected forgery is journaled: %v", err)
	}
	// A restart does not find it either.
	f.e.Close()
	e := f.open(t, f.cfg)
	e.Handle(forged)
	expect(t, f.next(t), 5, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)

	signed := cmd(5, command.KindNodeReboot, reboot())
	commandsig.Sign(signed, trustDomain, f.priv)
	e.Handle(signed)
	u := f.next(t)
	expect(t, u, 5, accepted, noReject)
	if u.GetId() != signed.GetId() {
		t.Fatalf("answered for %q, want %q", u.GetId(), signed.GetId())
	}
	e.Close()
	if n := f.reboots.Load(); n != 1 {
		t.Fatalf("reboot hook called %d times, want 1", n)
	}
}

// TestReplayedSignatureWithChangedFieldsIsBadSignature: a valid signature
// replayed on the command with another id or timeout, or to a daemon of
// another installation (trust domain) pinning the same key, is
// BAD_SIGNATURE; the command as signed runs.
func TestReplayedSignatureWithChangedFieldsIsBadSignature(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	signed := cmd(1, command.KindNodeReboot, reboot())
	commandsig.Sign(signed, trustDomain, f.priv)

	otherID := proto.Clone(signed).(*agentv1.Command)
	otherID.Id = "cmd_other"
	f.e.Handle(otherID)
	expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)

	longer := proto.Clone(signed).(*agentv1.Command)
	longer.Timeout = durationpb.New(time.Hour)
	f.e.Handle(longer)
	expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)

	otherKeyID := proto.Clone(signed).(*agentv1.Command)
	otherKeyID.KeyId = "0011223344556677"
	f.e.Handle(otherKeyID)
	expect(t, f.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)

	// Another installation whose daemons pin the same key.
	other := setup(t, func(c *command.Config) { c.TrustDomain, c.CommandKey = "other.bettercompute", f.cfg.CommandKey })
	other.e.Handle(proto.Clone(signed).(*agentv1.Command))
	expect(t, other.next(t), 1, rejected, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE)
	other.e.Close()
	if n := other.reboots.Load(); n != 0 {
		t.Fatalf("the other installation rebooted %d times", n)
	}

	f.e.Handle(signed)
	expect(t, f.next(t), 1, accepted, noReject)
	f.e.Close()
	if n := f.reboots.Load(); n != 1 {
		t.Fatalf("reboot hook called %d times, want 1", n)
	}
}
