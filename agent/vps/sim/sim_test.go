package sim_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/leaktest"
	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/seed"
	"github.com/bettercompute/bettercompute/agent/vps/sim"
)

func TestMain(m *testing.M) {
	sim.ServeInstance() // a re-exec'd instance runs here and never returns
	leaktest.Main(m)
}

type env struct {
	dir string
	rt  *sim.Runtime
	rec *vps.Reconciler
}

func setup(t *testing.T, dir string) env {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	rt, err := sim.New(sim.Config{Dir: dir, ReExec: true, StopTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	gpus := map[string]string{"GPU-a": "0000:18:00.0", "GPU-b": "0000:2A:00.0"}
	rec, err := vps.NewReconciler(vps.Config{Runtime: rt, GPUs: func(context.Context) (map[string]string, error) { return gpus, nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		obs, _ := rt.List(context.Background())
		for _, o := range obs {
			_ = rt.Delete(context.Background(), o.ID)
		}
	})
	return env{dir: dir, rt: rt, rec: rec}
}

func (e env) apply(t *testing.T, specs ...vps.Spec) vps.Result {
	t.Helper()
	if err := vps.Validate(specs); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	resolved, failed, err := e.rec.Resolve(ctx, specs)
	if err != nil {
		t.Fatal(err)
	}
	return e.rec.Apply(ctx, resolved, failed)
}

func spec(id string, power vps.State, vcpus uint32) vps.Spec {
	return vps.Spec{ID: id, Generation: 1, Image: "tiny.qcow2", Power: power, Size: vps.Size{VCPUs: vcpus, MemoryMiB: 512, DiskGiB: 10},
		SSHKeys: []string{"ssh-ed25519 AAAAtest tenant"}}
}

// booted waits for the instance's process to report itself and returns
// what it reported.
func booted(t *testing.T, e env, id string, pid int) sim.Booted {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(e.rt.Dir(id), sim.BootedFile))
		var got sim.Booted
		if err == nil && json.Unmarshal(b, &got) == nil && got.PID == pid {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: process %d never reported itself booted (last %q, %v)", id, pid, b, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func state(t *testing.T, res vps.Result, id string) vps.Observed {
	t.Helper()
	for _, o := range res.Instances {
		if o.ID == id {
			return o
		}
	}
	t.Fatalf("no status for %s in %+v", id, res.Instances)
	return vps.Observed{}
}

func TestLifecycle_StartStopResizeDelete(t *testing.T) {
	t.Parallel()
	e := setup(t, "")
	res := e.apply(t, spec("inst_a", vps.Running, 2))
	if res.Err != nil || state(t, res, "inst_a").State != vps.Running {
		t.Fatalf("create: %+v", res)
	}
	pid, ok := e.rt.PID("inst_a")
	if !ok {
		t.Fatal("no process")
	}
	if b := booted(t, e, "inst_a", pid); b.Size.VCPUs != 2 || b.Size.MemoryMiB != 512 {
		t.Errorf("the process runs with %+v", b.Size)
	}
	if _, err := os.Stat(filepath.Join(e.rt.Dir("inst_a"), sim.SeedFile)); err != nil {
		t.Errorf("no seed: %v", err)
	}

	t.Run("applying the same spec changes nothing", func(t *testing.T) {
		res := e.apply(t, spec("inst_a", vps.Running, 2))
		if res.Err != nil || len(res.Steps) != 0 {
			t.Fatalf("%+v", res)
		}
		if p, _ := e.rt.PID("inst_a"); p != pid {
			t.Errorf("pid %d, was %d", p, pid)
		}
	})
	t.Run("resize restarts with the new size", func(t *testing.T) {
		s := spec("inst_a", vps.Running, 4)
		s.Generation = 2
		res := e.apply(t, s)
		o := state(t, res, "inst_a")
		if res.Err != nil || o.State != vps.Running || o.Size.VCPUs != 4 || o.Generation != 2 {
			t.Fatalf("%+v", res)
		}
		p, _ := e.rt.PID("inst_a")
		if p == pid {
			t.Error("a resize kept the old process")
		}
		if b := booted(t, e, "inst_a", p); b.Size.VCPUs != 4 {
			t.Errorf("the new process runs with %+v", b.Size)
		}
		pid = p
	})
	t.Run("stop", func(t *testing.T) {
		s := spec("inst_a", vps.Stopped, 4)
		s.Generation = 3
		res := e.apply(t, s)
		if res.Err != nil || state(t, res, "inst_a").State != vps.Stopped {
			t.Fatalf("%+v", res)
		}
		if _, ok := e.rt.PID("inst_a"); ok {
			t.Error("still a process")
		}
		if _, err := os.Stat("/proc/" + itoa(pid)); err == nil {
			if b, _ := os.ReadFile("/proc/" + itoa(pid) + "/stat"); !strings.Contains(string(b), ") Z") {
				t.Errorf("process %d still runs", pid)
			}
		}
	})
	t.Run("start again", func(t *testing.T) {
		s := spec("inst_a", vps.Running, 4)
		s.Generation = 4
		if res := e.apply(t, s); res.Err != nil || state(t, res, "inst_a").State != vps.Running {
			t.Fatalf("%+v", res)
		}
	})
	t.Run("reboot is a new process with the same size", func(t *testing.T) {
		before, _ := e.rt.PID("inst_a")
		if err := e.rec.Reboot(context.Background(), "inst_a"); err != nil {
			t.Fatal(err)
		}
		after, ok := e.rt.PID("inst_a")
		if !ok || after == before {
			t.Fatalf("pid %d → %d (%v)", before, after, ok)
		}
		if b := booted(t, e, "inst_a", after); b.Size.VCPUs != 4 {
			t.Errorf("%+v", b)
		}
	})
	t.Run("left out means deleted", func(t *testing.T) {
		res := e.apply(t)
		if res.Err != nil || len(res.Instances) != 0 || !slices.Contains(res.Steps, vps.Step{ID: "inst_a", Op: vps.OpDelete}) {
			t.Fatalf("%+v", res)
		}
		if _, err := os.Stat(e.rt.Dir("inst_a")); !os.IsNotExist(err) {
			t.Errorf("the instance directory is still there: %v", err)
		}
	})
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func TestRestart_AdoptsAndNeverRecreates(t *testing.T) {
	t.Parallel()
	e := setup(t, "")
	specs := []vps.Spec{spec("inst_a", vps.Running, 1), spec("inst_b", vps.Stopped, 1)}
	if res := e.apply(t, specs...); res.Err != nil {
		t.Fatal(res.Err)
	}
	pid, _ := e.rt.PID("inst_a")

	// A new daemon: a new runtime and reconciler over the same directory.
	e2 := setup(t, e.dir)
	adopted, err := e2.rec.Adopt(context.Background())
	if err != nil || len(adopted) != 2 || adopted[0].State != vps.Running || adopted[1].State != vps.Stopped {
		t.Fatalf("adopted %+v, %v", adopted, err)
	}
	res := e2.apply(t, specs...)
	if res.Err != nil || len(res.Steps) != 0 {
		t.Fatalf("re-applying after a restart took steps: %+v", res)
	}
	if p, ok := e2.rt.PID("inst_a"); !ok || p != pid {
		t.Errorf("pid %d after the restart, was %d: the instance was re-created", p, pid)
	}
}

func TestFailures(t *testing.T) {
	t.Parallel()
	t.Run("injected failure is reported and then cleared", func(t *testing.T) {
		t.Parallel()
		e := setup(t, "")
		if err := os.MkdirAll(e.rt.Dir("inst_f"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(e.rt.Dir("inst_f"), sim.FailFile), []byte("no space left on the host\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		res := e.apply(t, spec("inst_f", vps.Running, 1), spec("inst_ok", vps.Running, 1))
		if o := state(t, res, "inst_f"); res.Err == nil || o.State != vps.Failed || o.Reason != "no space left on the host" {
			t.Fatalf("%+v", res)
		}
		if o := state(t, res, "inst_ok"); o.State != vps.Running {
			t.Errorf("one failure stopped another instance: %+v", o)
		}
		_ = os.Remove(filepath.Join(e.rt.Dir("inst_f"), sim.FailFile))
		if res := e.apply(t, spec("inst_f", vps.Running, 1), spec("inst_ok", vps.Running, 1)); res.Err != nil || state(t, res, "inst_f").State != vps.Running {
			t.Fatalf("%+v", res)
		}
	})
	t.Run("a dead process is failed, then started again", func(t *testing.T) {
		t.Parallel()
		e := setup(t, "")
		e.apply(t, spec("inst_d", vps.Running, 1))
		pid, _ := e.rt.PID("inst_d")
		booted(t, e, "inst_d", pid)
		p, _ := os.FindProcess(pid)
		_ = p.Kill()
		deadline := time.Now().Add(30 * time.Second)
		for {
			obs, _ := e.rt.List(context.Background())
			if len(obs) == 1 && obs[0].State == vps.Failed && strings.Contains(obs[0].Reason, "exited") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("a killed instance is observed %+v", obs)
			}
			time.Sleep(20 * time.Millisecond)
		}
		res := e.apply(t, spec("inst_d", vps.Running, 1))
		if res.Err != nil || state(t, res, "inst_d").State != vps.Running || !slices.Contains(res.Steps, vps.Step{ID: "inst_d", Op: vps.OpStart}) {
			t.Fatalf("%+v", res)
		}
	})
	t.Run("a GPU the host lacks fails only that instance", func(t *testing.T) {
		t.Parallel()
		e := setup(t, "")
		g := spec("inst_g", vps.Running, 1)
		g.GPUUUIDs = []string{"GPU-b", "GPU-zzz"}
		res := e.apply(t, g)
		if o := state(t, res, "inst_g"); o.State != vps.Failed || !strings.Contains(o.Reason, "GPU-zzz") {
			t.Fatalf("%+v", res)
		}
		g.GPUUUIDs = []string{"GPU-b", "GPU-a"}
		res = e.apply(t, g)
		if o := state(t, res, "inst_g"); res.Err != nil || !slices.Equal(o.GPUs, []string{"0000:18:00.0", "0000:2a:00.0"}) {
			t.Fatalf("%+v", res)
		}
	})
}

func TestSleepCommand(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	rt, err := sim.New(sim.Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	o, err := rt.Ensure(context.Background(), spec("inst_s", vps.Running, 1))
	if err != nil || o.State != vps.Running {
		t.Fatalf("%+v %v", o, err)
	}
	pid, _ := rt.PID("inst_s")
	if b, _ := os.ReadFile("/proc/" + itoa(pid) + "/cmdline"); !strings.HasPrefix(string(b), "sleep\x00") {
		t.Errorf("the instance runs %q", b)
	}
	img, _ := os.ReadFile(filepath.Join(rt.Dir("inst_s"), sim.SeedFile))
	if _, files, err := seed.Read(img); err != nil || !strings.Contains(string(files["user-data"]), "ssh-ed25519 AAAAtest") {
		t.Errorf("seed: %v %q", err, files["user-data"])
	}
	if err := rt.Delete(context.Background(), "inst_s"); err != nil {
		t.Fatal(err)
	}
	if obs, _ := rt.List(context.Background()); len(obs) != 0 {
		t.Errorf("after delete: %+v", obs)
	}
}
