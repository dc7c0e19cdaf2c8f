package cdi_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/cdi"
	lib "tags.cncf.io/container-device-interface/pkg/cdi"
)

// host is a fake node under a temp root: /dev/nvidia<minor> for every GPU
// (regular files: the generator only looks for them), the control nodes, a
// driver's libraries and nvidia-smi, and a fake nvidia-ctk.
type host struct {
	dev, driver, ctk, dir string
	gpus                  []cdi.GPU
}

func touch(t testing.TB, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
}

// newHost makes n GPUs whose minor numbers are not their positions (minor
// of GPU-i is n-1-i), so a spec that used the index would be caught.
func newHost(t testing.TB, n int) host {
	t.Helper()
	root := t.TempDir()
	h := host{dev: filepath.Join(root, "dev-root"), driver: filepath.Join(root, "driver-root"),
		ctk: filepath.Join(root, "bin", "nvidia-ctk"), dir: filepath.Join(root, "cdi")}
	for i := range n {
		g := cdi.GPU{UUID: fmt.Sprintf("GPU-%08d-0000-0000-0000-000000000000", i), Minor: n - 1 - i}
		h.gpus = append(h.gpus, g)
		touch(t, filepath.Join(h.dev, "dev", fmt.Sprintf("nvidia%d", g.Minor)))
	}
	for _, p := range []string{"dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-uvm-tools", "dev/nvidia-modeset"} {
		touch(t, filepath.Join(h.dev, p))
	}
	for _, p := range []string{"usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15", "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.86.15", "usr/bin/nvidia-smi"} {
		touch(t, filepath.Join(h.driver, p))
	}
	touch(t, h.ctk)
	return h
}

func (h host) writer(t testing.TB) *cdi.Writer {
	t.Helper()
	w, err := cdi.New(cdi.Config{Dir: h.dir, DevRoot: h.dev, DriverRoot: h.driver, NvidiaCTK: h.ctk})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func write(t testing.TB, w *cdi.Writer, gpus []cdi.GPU, rsvs ...cdi.Reservation) cdi.Spec {
	t.Helper()
	s, err := w.Generate(gpus, rsvs)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// load reads the CDI directory as an engine does, with the library's cache.
func load(t *testing.T, dir string) *lib.Cache {
	t.Helper()
	c, err := lib.NewCache(lib.WithSpecDirs(dir), lib.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := c.GetErrors(); len(errs) > 0 {
		t.Fatalf("the library rejects the spec: %v", errs)
	}
	return c
}

// nodes are the device nodes a container asking for name gets: the
// device's own and the spec's common ones (host paths).
func nodes(t *testing.T, c *lib.Cache, name string) []string {
	t.Helper()
	d := c.GetDevice(name)
	if d == nil {
		t.Fatalf("%s does not resolve (devices: %v)", name, c.ListDevices())
	}
	var out []string
	for _, n := range append(slices.Clone(d.ContainerEdits.DeviceNodes), d.GetSpec().ContainerEdits.DeviceNodes...) {
		out = append(out, n.HostPath)
	}
	slices.Sort(out)
	return out
}

func (h host) want(gpus ...cdi.GPU) []string {
	out := []string{}
	for _, p := range []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"} {
		out = append(out, filepath.Join(h.dev, "dev", p))
	}
	for _, g := range gpus {
		out = append(out, filepath.Join(h.dev, "dev", fmt.Sprintf("nvidia%d", g.Minor)))
	}
	slices.Sort(out)
	return out
}

// TestCDISpecValidatesWithTheLibrary: the written spec loads in the CDI
// reference library's cache without errors, and bettercompute.io/gpu=<uuid>
// and =<reservation> resolve to exactly their GPUs' device nodes (by minor
// number) plus the control nodes; the driver's files are mounted and the
// ldcache hook runs nvidia-ctk over the library folder.
func TestCDISpecValidatesWithTheLibrary(t *testing.T) {
	t.Parallel()
	h := newHost(t, 8)
	w := h.writer(t)
	s := write(t, w, h.gpus, cdi.Reservation{ID: "rsv_b", GPUs: []string{h.gpus[5].UUID, h.gpus[2].UUID}},
		cdi.Reservation{ID: "rsv_a", GPUs: []string{h.gpus[0].UUID}})
	if len(s.Notes) != 0 {
		t.Fatalf("notes %v", s.Notes)
	}
	if w.Path() != filepath.Join(h.dir, "bettercompute.io-gpu.json") {
		t.Fatalf("path %s", w.Path())
	}
	c := load(t, h.dir)
	if got, want := nodes(t, c, "bettercompute.io/gpu=rsv_b"), h.want(h.gpus[5], h.gpus[2]); !slices.Equal(got, want) {
		t.Fatalf("rsv_b resolves to %v, want %v", got, want)
	}
	if got, want := nodes(t, c, "bettercompute.io/gpu=rsv_a"), h.want(h.gpus[0]); !slices.Equal(got, want) {
		t.Fatalf("rsv_a resolves to %v, want %v", got, want)
	}
	if got, want := nodes(t, c, "bettercompute.io/gpu="+h.gpus[2].UUID), h.want(h.gpus[2]); !slices.Equal(got, want) {
		t.Fatalf("GPU 2 resolves to %v, want %v", got, want)
	}
	spec := c.GetDevice("bettercompute.io/gpu=rsv_a").GetSpec()
	if spec.Version == "" || spec.Kind != cdi.Kind {
		t.Fatalf("version %q kind %q", spec.Version, spec.Kind)
	}
	var mounts []string
	for _, m := range spec.ContainerEdits.Mounts {
		mounts = append(mounts, m.ContainerPath)
	}
	if want := []string{"/usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.86.15", "/usr/bin/nvidia-smi"}; !slices.Equal(mounts, want) {
		t.Fatalf("mounts %v, want %v", mounts, want)
	}
	if hk := spec.ContainerEdits.Hooks; len(hk) != 1 || hk[0].HookName != "createContainer" || hk[0].Path != h.ctk ||
		!slices.Equal(hk[0].Args, []string{"nvidia-ctk", "hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"}) {
		t.Fatalf("hooks %+v", hk)
	}
	if fi, err := os.Stat(w.Path()); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("spec file %v %v", fi, err)
	}

	// Without nvidia-ctk there is no hook, and the notes say so.
	w2, err := cdi.New(cdi.Config{Dir: h.dir, DevRoot: h.dev, DriverRoot: h.driver, NvidiaCTK: filepath.Join(h.dev, "absent")})
	if err != nil {
		t.Fatal(err)
	}
	s2, err := w2.Generate(h.gpus, []cdi.Reservation{{ID: "rsv_a", GPUs: []string{h.gpus[0].UUID}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(s2.Raw.ContainerEdits.Hooks) != 0 || !slices.Contains(s2.Notes, "nvidia-ctk not installed: the spec has no update-ldcache hook") {
		t.Fatalf("hooks %+v notes %v", s2.Raw.ContainerEdits.Hooks, s2.Notes)
	}
}

// TestCDISpecOffersNoUnbookedGPU: of eight GPUs with two booked, the spec
// names only the two and their reservation; an unbooked GPU's UUID does not
// resolve and no device carries its node. Nothing booked: no spec file.
func TestCDISpecOffersNoUnbookedGPU(t *testing.T) {
	t.Parallel()
	h := newHost(t, 8)
	w := h.writer(t)
	write(t, w, h.gpus, cdi.Reservation{ID: "rsv_a", GPUs: []string{h.gpus[1].UUID, h.gpus[6].UUID}})
	c := load(t, h.dir)
	want := []string{"bettercompute.io/gpu=" + h.gpus[1].UUID, "bettercompute.io/gpu=" + h.gpus[6].UUID, "bettercompute.io/gpu=rsv_a"}
	slices.Sort(want)
	if got := c.ListDevices(); !slices.Equal(got, want) {
		t.Fatalf("devices %v, want %v", got, want)
	}
	booked := map[string]bool{}
	for _, p := range h.want(h.gpus[1], h.gpus[6]) {
		booked[p] = true
	}
	for _, name := range c.ListDevices() {
		for _, p := range nodes(t, c, name) {
			if !booked[p] {
				t.Fatalf("%s offers %s, not booked", name, p)
			}
		}
	}
	if c.GetDevice("bettercompute.io/gpu="+h.gpus[0].UUID) != nil {
		t.Fatal("an unbooked GPU resolves")
	}

	write(t, w, h.gpus)
	if _, err := os.Stat(w.Path()); !os.IsNotExist(err) {
		t.Fatalf("with nothing booked the spec file is there: %v", err)
	}
	if _, err := w.Generate(h.gpus, []cdi.Reservation{{ID: "rsv_x", GPUs: []string{"GPU-not-here"}}}); err == nil {
		t.Fatal("a GPU NVML does not report was offered")
	}
}

// TestCDISpecCheckTellsDriftFromStale: Check says Current for what was
// written, Stale for an older booking this writer wrote, Drifted for a
// file edited or removed by someone else.
func TestCDISpecCheckTellsDriftFromStale(t *testing.T) {
	t.Parallel()
	h := newHost(t, 2)
	w := h.writer(t)
	old := write(t, w, h.gpus, cdi.Reservation{ID: "rsv_a", GPUs: []string{h.gpus[0].UUID}})
	next, err := w.Generate(h.gpus, []cdi.Reservation{{ID: "rsv_b", GPUs: []string{h.gpus[1].UUID}}})
	if err != nil {
		t.Fatal(err)
	}
	check := func(s cdi.Spec, last []byte, want cdi.State) {
		t.Helper()
		if got, err := w.Check(s, last); err != nil || got != want {
			t.Fatalf("check %v %v, want %v", got, err, want)
		}
	}
	check(old, old.Data, cdi.Current)
	check(next, old.Data, cdi.Stale)
	if err := os.WriteFile(w.Path(), []byte(`{"cdiVersion":"0.5.0","kind":"bettercompute.io/gpu","devices":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	check(old, old.Data, cdi.Drifted)
	if err := os.Remove(w.Path()); err != nil {
		t.Fatal(err)
	}
	check(old, old.Data, cdi.Drifted)
	check(cdi.Spec{}, old.Data, cdi.Current)
}

// BenchmarkBookingChangeToSpecOnDisk: one booking change (a GPU moves
// between two reservations) on an 8-GPU node, from generation to the
// library's validated, renamed-into-place file.
func BenchmarkBookingChangeToSpecOnDisk(b *testing.B) {
	h := newHost(b, 8)
	w := h.writer(b)
	u := func(i int) string { return h.gpus[i].UUID }
	bookings := [2][]cdi.Reservation{
		{{ID: "rsv_a", GPUs: []string{u(0), u(1), u(2), u(3)}}, {ID: "rsv_b", GPUs: []string{u(4), u(5), u(6), u(7)}}},
		{{ID: "rsv_a", GPUs: []string{u(0), u(1), u(2)}}, {ID: "rsv_b", GPUs: []string{u(3), u(4), u(5), u(6), u(7)}}},
	}
	b.ReportAllocs()
	var took []time.Duration
	for i := 0; b.Loop(); i++ {
		start := time.Now()
		write(b, w, h.gpus, bookings[i%2]...)
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(took[len(took)*99/100].Nanoseconds()), "p99-ns")
}

// TestCDISpecMIGSlice: a booked MIG slice is a device named by its MIG
// UUID with its parent GPU's node and its GPU and compute instances'
// capability nodes (minors from the driver's mig-minors), nothing of the
// GPU's other slices; a reservation holding two slices of one GPU has the
// parent's node once.
func TestCDISpecMIGSlice(t *testing.T) {
	t.Parallel()
	h := newHost(t, 2)
	parent := h.gpus[1] // minor 0
	touch(t, filepath.Join(h.driver, cdi.MigMinorsFile))
	if err := os.WriteFile(filepath.Join(h.driver, cdi.MigMinorsFile), []byte("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\ngpu1/gi1/access 112\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{12, 13, 21, 22, 112} {
		touch(t, filepath.Join(h.dev, "dev", "nvidia-caps", fmt.Sprintf("nvidia-cap%d", n)))
	}
	a := cdi.GPU{UUID: "MIG-aaaaaaaa-0000-0000-0000-000000000000", Minor: parent.Minor, MIG: &cdi.MIGInstance{GI: 1, CI: 0}}
	b := cdi.GPU{UUID: "MIG-bbbbbbbb-0000-0000-0000-000000000000", Minor: parent.Minor, MIG: &cdi.MIGInstance{GI: 2, CI: 0}}
	gpus := append(slices.Clone(h.gpus), a, b)
	s := write(t, h.writer(t), gpus, cdi.Reservation{ID: "rsv_a", GPUs: []string{a.UUID}}, cdi.Reservation{ID: "rsv_ab", GPUs: []string{b.UUID}})
	if len(s.Notes) != 0 {
		t.Fatalf("notes %v", s.Notes)
	}
	c := load(t, h.dir)
	capNode := func(n int) string { return filepath.Join(h.dev, "dev", "nvidia-caps", fmt.Sprintf("nvidia-cap%d", n)) }
	want := append(h.want(parent), capNode(12), capNode(13))
	slices.Sort(want)
	if got := nodes(t, c, "bettercompute.io/gpu="+a.UUID); !slices.Equal(got, want) {
		t.Fatalf("slice a resolves to %v, want %v", got, want)
	}
	if got := nodes(t, c, "bettercompute.io/gpu=rsv_a"); !slices.Equal(got, want) {
		t.Fatalf("rsv_a resolves to %v, want %v", got, want)
	}
	if d := c.GetDevice("bettercompute.io/gpu=" + parent.UUID); d != nil {
		t.Fatalf("the parent GPU is offered whole")
	}
	// Two slices of one GPU: the parent's node once.
	write(t, h.writer(t), gpus, cdi.Reservation{ID: "rsv_ab", GPUs: []string{a.UUID, b.UUID}})
	c = load(t, h.dir)
	want = append(h.want(parent), capNode(12), capNode(13), capNode(21), capNode(22))
	slices.Sort(want)
	if got := nodes(t, c, "bettercompute.io/gpu=rsv_ab"); !slices.Equal(got, want) {
		t.Fatalf("rsv_ab resolves to %v, want %v", got, want)
	}
	// A slice the driver lists no capability for is noted.
	x := cdi.GPU{UUID: "MIG-cccccccc-0000-0000-0000-000000000000", Minor: parent.Minor, MIG: &cdi.MIGInstance{GI: 5, CI: 0}}
	s = write(t, h.writer(t), append(gpus, x), cdi.Reservation{ID: "rsv_x", GPUs: []string{x.UUID}})
	if len(s.Notes) != 1 || s.Notes[0] != "MIG capabilities not in "+cdi.MigMinorsFile+": gpu0/gi5/access, gpu0/gi5/ci0/access" {
		t.Fatalf("notes %v", s.Notes)
	}
}
