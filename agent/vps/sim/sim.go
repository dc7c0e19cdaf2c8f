// Package sim is a simulated VPS runtime: each running instance is a real
// OS process (by default `sleep infinity`; with ReExec, the current binary
// started again as an instance, see ServeInstance), so tests and `make run`
// exercise a real process lifecycle. Processes start in their own session
// and outlive the daemon. Everything lives under the state directory:
//
//	<dir>/<id>/instance.json  the applied spec: generation, image, size, GPUs, power
//	<dir>/<id>/pid            "<pid> <start time>" of the running process
//	<dir>/<id>/seed.iso       the instance's NoCloud seed (vps/seed)
//	<dir>/<id>/booted         written by a re-exec'd instance: its pid and size
//	<dir>/<id>/console.log    the process's output
//	<dir>/<id>/fail           injected failure: Ensure fails with its text
//	<dir>/fail                injected failure for every instance
//
// A process found dead while its instance should run is observed Failed;
// Ensure starts it again. A resize stops the process and starts a new one
// with the new size.
package sim

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/seed"
)

// Files under an instance's directory.
const (
	InstanceFile = "instance.json"
	PIDFile      = "pid"
	SeedFile     = "seed.iso"
	BootedFile   = "booted"
	ConsoleFile  = "console.log"
	FailFile     = "fail"
)

// EnvInstance, set in a re-exec'd process, is the instance directory it
// serves (see ServeInstance).
const EnvInstance = "BC_VPS_SIM_INSTANCE"

// Config sets up a Runtime.
type Config struct {
	// Dir is the state directory. Required.
	Dir string
	// ReExec starts each instance as the current binary with EnvInstance
	// set; the binary must call ServeInstance first thing in main (or
	// TestMain). False runs Command.
	ReExec bool
	// Command is the process of an instance when not ReExec; empty means
	// ["sleep", "infinity"].
	Command []string
	// StopTimeout is how long Stop waits after SIGTERM before SIGKILL;
	// zero means 10 s.
	StopTimeout time.Duration
	// Logger logs process starts and stops; nil means slog.Default().
	Logger *slog.Logger
}

// Runtime is the simulated runtime. It implements vps.Runtime.
type Runtime struct {
	cfg Config
	mu  sync.Mutex
}

var _ vps.Runtime = (*Runtime)(nil)

// New returns a Runtime over cfg.Dir, adopting whatever instances it
// already holds.
func New(cfg Config) (*Runtime, error) {
	if cfg.Dir == "" {
		return nil, errors.New("vps/sim: a state directory is required")
	}
	if len(cfg.Command) == 0 {
		cfg.Command = []string{"sleep", "infinity"}
	}
	cfg.StopTimeout = cmp.Or(cfg.StopTimeout, 10*time.Second)
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("vps/sim: %w", err)
	}
	return &Runtime{cfg: cfg}, nil
}

// record is InstanceFile.
type record struct {
	ID         string    `json:"id"`
	Generation int64     `json:"generation"`
	Image      string    `json:"image"`
	Size       vps.Size  `json:"size"`
	GPUs       []string  `json:"gpus"`
	Power      vps.State `json:"power"`
}

// Booted is BootedFile, written by a re-exec'd instance once it runs.
type Booted struct {
	PID  int      `json:"pid"`
	Size vps.Size `json:"size"`
	GPUs []string `json:"gpus"`
}

func (r *Runtime) dir(id string) string { return filepath.Join(r.cfg.Dir, id) }

// Dir is an instance's directory.
func (r *Runtime) Dir(id string) string { return r.dir(id) }

func (r *Runtime) load(id string) (*record, error) {
	b, err := os.ReadFile(filepath.Join(r.dir(id), InstanceFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var rec record
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("%s: %w", InstanceFile, err)
	}
	return &rec, nil
}

func (r *Runtime) save(rec *record) error {
	b, _ := json.MarshalIndent(rec, "", "  ") // plain fields always marshal
	return writeAtomic(filepath.Join(r.dir(rec.ID), InstanceFile), append(b, '\n'))
}

func writeAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// proc is a process the runtime started: its pid and kernel start time.
type proc struct {
	pid   int
	start string
}

// readProc returns the process of id if it runs (alive, not a zombie, the
// same start time as recorded).
func (r *Runtime) readProc(id string) (proc, bool) {
	b, err := os.ReadFile(filepath.Join(r.dir(id), PIDFile))
	if err != nil {
		return proc{}, false
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return proc{}, false
	}
	pid, err := strconv.Atoi(f[0])
	if err != nil || pid <= 0 {
		return proc{}, false
	}
	p := proc{pid: pid, start: f[1]}
	return p, alive(p)
}

// stat returns the state letter and start time of pid from /proc.
func stat(pid int) (state, start string, ok bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", "", false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return "", "", false
	}
	f := strings.Fields(s[i+1:])
	// After the command: state is field 3, starttime field 22.
	if len(f) < 20 {
		return "", "", false
	}
	return f[0], f[19], true
}

func alive(p proc) bool {
	st, start, ok := stat(p.pid)
	return ok && start == p.start && st != "Z" && st != "X"
}

// failure returns the injected failure for id, if any.
func (r *Runtime) failure(id string) string {
	for _, p := range []string{filepath.Join(r.cfg.Dir, FailFile), filepath.Join(r.dir(id), FailFile)} {
		if b, err := os.ReadFile(p); err == nil {
			return cmp.Or(strings.TrimSpace(string(b)), "injected failure")
		}
	}
	return ""
}

// Ensure implements vps.Runtime.
func (r *Runtime) Ensure(ctx context.Context, spec vps.Spec) (vps.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := vps.Validate([]vps.Spec{spec}); err != nil {
		return vps.Observed{}, err
	}
	if f := r.failure(spec.ID); f != "" {
		return vps.Observed{}, errors.New(f)
	}
	rec, err := r.load(spec.ID)
	if err != nil {
		return vps.Observed{}, err
	}
	if rec != nil && rec.Image != spec.Image {
		return vps.Observed{}, fmt.Errorf("the image is fixed at create: %s, not %s (delete and create again)", rec.Image, spec.Image)
	}
	if rec != nil && spec.Size.DiskGiB < rec.Size.DiskGiB {
		return vps.Observed{}, fmt.Errorf("the disk cannot shrink from %d GiB to %d GiB", rec.Size.DiskGiB, spec.Size.DiskGiB)
	}
	if err := os.MkdirAll(r.dir(spec.ID), 0o755); err != nil {
		return vps.Observed{}, err
	}
	iso, err := seed.Build(spec)
	if err != nil {
		return vps.Observed{}, err
	}
	if have, _ := os.ReadFile(filepath.Join(r.dir(spec.ID), SeedFile)); string(have) != string(iso) {
		if err := writeAtomic(filepath.Join(r.dir(spec.ID), SeedFile), iso); err != nil {
			return vps.Observed{}, err
		}
	}
	p, running := r.readProc(spec.ID)
	changed := rec == nil || rec.Size != spec.Size || !slices.Equal(rec.GPUs, spec.GPUs)
	if running && (changed || spec.Power == vps.Stopped) {
		if err := r.stop(ctx, spec.ID, p); err != nil {
			return vps.Observed{}, err
		}
		running = false
	}
	next := &record{ID: spec.ID, Generation: spec.Generation, Image: spec.Image, Size: spec.Size, GPUs: slices.Clone(spec.GPUs), Power: spec.Power}
	if err := r.save(next); err != nil {
		return vps.Observed{}, err
	}
	if spec.Power == vps.Running && !running {
		if err := r.start(next); err != nil {
			return vps.Observed{}, err
		}
	}
	return r.observe(next), nil
}

// start starts rec's process and records its pid.
func (r *Runtime) start(rec *record) error {
	dir := r.dir(rec.ID)
	name, args := r.cfg.Command[0], r.cfg.Command[1:]
	env := os.Environ()
	if r.cfg.ReExec {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		name, args = exe, nil
		env = append(env, EnvInstance+"="+dir)
	}
	_ = os.Remove(filepath.Join(dir, BootedFile))
	out, err := os.OpenFile(filepath.Join(dir, ConsoleFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command(name, args...)
	cmd.Env = append(env,
		fmt.Sprintf("BC_VPS_VCPUS=%d", rec.Size.VCPUs), fmt.Sprintf("BC_VPS_MEMORY_MIB=%d", rec.Size.MemoryMiB),
		fmt.Sprintf("BC_VPS_DISK_GIB=%d", rec.Size.DiskGiB), "BC_VPS_GPUS="+strings.Join(rec.GPUs, ","))
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", rec.ID, err)
	}
	go cmd.Wait() //nolint:errcheck // reaps the child; its state is read from /proc
	_, start, ok := stat(cmd.Process.Pid)
	if !ok {
		return fmt.Errorf("starting %s: process %d exited at once", rec.ID, cmd.Process.Pid)
	}
	if err := writeAtomic(filepath.Join(dir, PIDFile), fmt.Appendf(nil, "%d %s\n", cmd.Process.Pid, start)); err != nil {
		_ = cmd.Process.Kill()
		return err
	}
	r.cfg.Logger.Info("started instance", "instance", rec.ID, "pid", cmd.Process.Pid, "size", rec.Size.String())
	return nil
}

// stop ends p with SIGTERM, then SIGKILL after StopTimeout.
func (r *Runtime) stop(ctx context.Context, id string, p proc) error {
	_ = syscall.Kill(p.pid, syscall.SIGTERM)
	if !waitGone(ctx, p, r.cfg.StopTimeout) {
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
		if !waitGone(ctx, p, r.cfg.StopTimeout) {
			return fmt.Errorf("stopping %s: process %d did not exit", id, p.pid)
		}
	}
	_ = os.Remove(filepath.Join(r.dir(id), PIDFile))
	r.cfg.Logger.Info("stopped instance", "instance", id, "pid", p.pid)
	return nil
}

// waitGone waits until p no longer runs, at most d.
func waitGone(ctx context.Context, p proc, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for alive(p) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return !alive(p)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

func (r *Runtime) observe(rec *record) vps.Observed {
	o := vps.Observed{ID: rec.ID, Generation: rec.Generation, Image: rec.Image, Size: rec.Size, GPUs: slices.Clone(rec.GPUs), State: vps.Stopped}
	p, running := r.readProc(rec.ID)
	switch {
	case running:
		o.State = vps.Running
	case rec.Power == vps.Running:
		o.State, o.Reason = vps.Failed, fmt.Sprintf("the instance's process (pid %d) exited", p.pid)
	}
	return o
}

// Stop implements vps.Runtime.
func (r *Runtime) Stop(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, err := r.load(id)
	if err != nil {
		return err
	}
	if rec == nil {
		return fmt.Errorf("%s: %w", id, vps.ErrNotFound)
	}
	if p, ok := r.readProc(id); ok {
		if err := r.stop(ctx, id, p); err != nil {
			return err
		}
	}
	rec.Power = vps.Stopped
	return r.save(rec)
}

// Delete implements vps.Runtime.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p, ok := r.readProc(id); ok {
		if err := r.stop(ctx, id, p); err != nil {
			return err
		}
	}
	return os.RemoveAll(r.dir(id))
}

// Reboot implements vps.Runtime: a new process with the same definition.
func (r *Runtime) Reboot(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, err := r.load(id)
	if err != nil {
		return err
	}
	if rec == nil {
		return fmt.Errorf("%s: %w", id, vps.ErrNotFound)
	}
	p, ok := r.readProc(id)
	if !ok {
		return fmt.Errorf("%s: %w", id, vps.ErrNotRunning)
	}
	if err := r.stop(ctx, id, p); err != nil {
		return err
	}
	return r.start(rec)
}

// List implements vps.Runtime.
func (r *Runtime) List(context.Context) ([]vps.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ents, err := os.ReadDir(r.cfg.Dir)
	if err != nil {
		return nil, err
	}
	var out []vps.Observed
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		rec, err := r.load(e.Name())
		if err != nil {
			return nil, err
		}
		if rec == nil || rec.ID != e.Name() {
			continue
		}
		out = append(out, r.observe(rec))
	}
	slices.SortFunc(out, func(a, b vps.Observed) int { return cmp.Compare(a.ID, b.ID) })
	return out, nil
}

// PID returns the pid of a running instance's process.
func (r *Runtime) PID(id string) (int, bool) {
	p, ok := r.readProc(id)
	return p.pid, ok
}

// ServeInstance runs this process as a simulated instance when it was
// started as one (EnvInstance set): it writes BootedFile with its pid and
// size, waits for SIGTERM or SIGINT and exits 0, never returning. Otherwise
// it returns at once. Call it first thing in main or TestMain.
func ServeInstance() {
	dir := os.Getenv(EnvInstance)
	if dir == "" {
		return
	}
	atoi := func(k string) uint64 { n, _ := strconv.ParseUint(os.Getenv(k), 10, 64); return n }
	b := Booted{PID: os.Getpid(), Size: vps.Size{VCPUs: uint32(atoi("BC_VPS_VCPUS")), MemoryMiB: atoi("BC_VPS_MEMORY_MIB"),
		DiskGiB: uint32(atoi("BC_VPS_DISK_GIB"))}}
	if g := os.Getenv("BC_VPS_GPUS"); g != "" {
		b.GPUs = strings.Split(g, ",")
	}
	data, _ := json.Marshal(b) // plain fields always marshal
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	if err := writeAtomic(filepath.Join(dir, BootedFile), data); err != nil {
		fmt.Fprintln(os.Stderr, "vps/sim instance:", err)
		os.Exit(1)
	}
	fmt.Println("instance booted", b.PID)
	<-sig
	os.Exit(0)
}
