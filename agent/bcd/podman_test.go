package bcd_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	tcdi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/bettercompute/bettercompute/agent/cdi"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestPodman_SeesExactlyTheBookedGPUs runs a real container engine against
// the CDI spec the real daemon writes: `bcd node` (mock NVML, eight GPUs,
// minors 0 to 7) with --dev-root a temp root of character devices made with
// mknod standing in for /dev/nvidia*, and --cdi-dir the directory Podman
// reads. With two GPUs booked to a reservation, `podman run --device
// bettercompute.io/gpu=<reservation>` of a local busybox image sees exactly
// those two GPUs' device nodes (and the control nodes), none of the other
// six; a booked GPU's UUID gives that GPU alone; an unbooked GPU's UUID does
// not resolve; after release the reservation's and its GPUs' names no
// longer resolve, another booking's does, and with nothing booked nothing
// does.
//
// It needs root, podman (Debian's 4.3 reads CDI specs only from /etc/cdi
// and /var/run/cdi, so the daemon writes into /var/run/cdi, which the test
// locks against another run of itself and cleans up), a static busybox, and
// an engine that can start a container here (with runc where crun cannot);
// it skips, saying which is missing, otherwise.
func TestPodman_SeesExactlyTheBookedGPUs(t *testing.T) {
	t.Parallel()
	pm := newPodman(t)
	cdiDir := lockCDIDir(t, tcdi.DefaultDynamicDir)

	// The host's device nodes: a GPU's /dev/nvidia<minor> is (195, minor),
	// as the NVIDIA driver makes them; nvidia-uvm's major is dynamic.
	devRoot := t.TempDir()
	want := map[string]string{ // container path -> "major,minor"
		"nvidiactl": "195,255", "nvidia-modeset": "195,254", "nvidia-uvm": "510,0", "nvidia-uvm-tools": "510,1",
	}
	control := maps.Clone(want)
	for i := range 8 {
		want[fmt.Sprintf("nvidia%d", i)] = fmt.Sprintf("195,%d", i)
	}
	if err := os.MkdirAll(filepath.Join(devRoot, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, dev := range want {
		var major, minor uint32
		if _, err := fmt.Sscanf(dev, "%d,%d", &major, &minor); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mknod(filepath.Join(devRoot, "dev", name), unix.S_IFCHR|0o666, int(unix.Mkdev(major, minor))); err != nil {
			t.Skipf("mknod of a character device under %s: %v", devRoot, err)
		}
	}

	cp := testcontrol.New(t)
	root := joinMock(t, cp, t.TempDir())
	nodeID := startNode(t, cp, []string{"node", "--gateway", cp.Addr, "--root", root, "--nvml", "mock", "--boot-id", "boot-podman",
		"--cdi-dir", cdiDir, "--dev-root", devRoot, "--driver-root", t.TempDir()})
	var gpus []*agentv1.GPU
	select {
	case rep := <-cp.Reports:
		gpus = rep.GetGpus()
	case <-t.Context().Done():
		t.Fatal("no inventory from bcd node")
	}
	if len(gpus) != 8 {
		t.Fatalf("the mock reports %d GPUs, want 8", len(gpus))
	}
	uuid := func(i int) string { return gpus[i].GetUuid() } // index = minor on the mock

	// Nothing booked yet: no device, and the reservation does not resolve.
	if got := pm.devices(t); len(got) != 0 {
		t.Fatalf("a container without --device sees %v", got)
	}
	pm.unresolvable(t, cdi.Kind+"=rsv_podman")

	// rsv_podman holds GPUs 1 and 5.
	book := func(gen int64, asg ...*agentv1.DeviceAssignment) string {
		t.Helper()
		cp.SetDesired(&agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{
			Identity: &agentv1.NodeIdentity{NodeId: nodeID},
			Devices:  &agentv1.DeviceAssignments{Assignments: asg},
		}})
		return waitDevicesConverged(t, cp, gen)
	}
	reason := book(1, &agentv1.DeviceAssignment{ReservationId: "rsv_podman", GpuUuids: []string{uuid(1), uuid(5)}})
	// The section's own check injects the devices as an engine does: the
	// reservation and its two GPUs, two GPU nodes and the control nodes.
	if !strings.Contains(reason, "; 3 devices resolve as the engines resolve them (") || strings.Contains(reason, "injection not tried") {
		t.Errorf("devices reason %q lacks the injection check", reason)
	}
	only := func(names ...string) map[string]string {
		m := maps.Clone(control)
		for _, n := range names {
			m[n] = want[n]
		}
		return m
	}
	if got, w := pm.devices(t, cdi.Kind+"=rsv_podman"), only("nvidia1", "nvidia5"); !maps.Equal(got, w) {
		t.Fatalf("the reservation's container sees %v, want %v", got, w)
	}
	if got, w := pm.devices(t, cdi.Kind+"="+uuid(5)), only("nvidia5"); !maps.Equal(got, w) {
		t.Fatalf("GPU 5's container sees %v, want %v", got, w)
	}
	pm.unresolvable(t, cdi.Kind+"="+uuid(2)) // not booked

	// Released; rsv_other books GPU 2: the spec is there, without rsv_podman.
	book(2, &agentv1.DeviceAssignment{ReservationId: "rsv_other", GpuUuids: []string{uuid(2)}})
	pm.unresolvable(t, cdi.Kind+"=rsv_podman")
	pm.unresolvable(t, cdi.Kind+"="+uuid(1))
	if got, w := pm.devices(t, cdi.Kind+"=rsv_other"), only("nvidia2"); !maps.Equal(got, w) {
		t.Fatalf("rsv_other's container sees %v, want %v", got, w)
	}

	// Nothing booked: no spec, no name.
	book(3)
	if _, err := os.Stat(filepath.Join(cdiDir, cdi.SpecFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("nothing booked, yet %s: %v", cdi.SpecFile, err)
	}
	pm.unresolvable(t, cdi.Kind+"=rsv_other")
}

// waitDevicesConverged waits for the node's report of generation gen with
// the devices section CONVERGED and returns the section's reason.
func waitDevicesConverged(t *testing.T, cp *testcontrol.Server, gen int64) string {
	t.Helper()
	for {
		select {
		case o := <-cp.Observed:
			if o.GetGeneration() != gen {
				continue
			}
			for _, s := range o.GetSections() {
				if s.GetSection() != "devices" {
					continue
				}
				if s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
					t.Fatalf("generation %d: devices %v", gen, s)
				}
				return s.GetReason()
			}
		case <-t.Context().Done():
			t.Fatalf("no report of generation %d", gen)
		}
	}
}

// podman runs containers of a test image with the flags that start one
// here.
type podman struct {
	path  string
	flags []string // global flags before "run"
	run   []string // flags after "run"
	image string
}

// podmanTimeout bounds one podman call (a stuck engine fails the test
// instead of hanging it).
const podmanTimeout = 2 * time.Minute

func (p *podman) cmd(ctx context.Context, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, podmanTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, p.path, append(slices.Clone(p.flags), args...)...).CombinedOutput()
	if ctx.Err() != nil {
		return out, fmt.Errorf("podman %s: %w", strings.Join(args, " "), ctx.Err())
	}
	return out, err
}

// container runs `ls -l /dev` in a new container of the test image with
// the devices asked for, and returns podman's output.
func (p *podman) container(ctx context.Context, devices ...string) ([]byte, error) {
	args := append([]string{"run", "--rm", "--network", "none", "--name", "bcd-podman-test-" + randHex()}, p.run...)
	for _, d := range devices {
		args = append(args, "--device", d)
	}
	return p.cmd(ctx, append(args, p.image, "/bin/ls", "-l", "/dev")...)
}

// devices returns the /dev/nvidia* a container given devices sees, by name,
// with their "major,minor".
func (p *podman) devices(t *testing.T, devices ...string) map[string]string {
	t.Helper()
	out, err := p.container(t.Context(), devices...)
	if err != nil {
		t.Fatalf("podman run --device %v: %v\n%s", devices, err, out)
	}
	got := map[string]string{}
	for line := range strings.Lines(string(out)) {
		// busybox: crw-rw-rw-    1 root     root      195,   1 Dec  2 08:31 nvidia1
		f := strings.Fields(line)
		if len(f) < 6 || !strings.HasPrefix(f[len(f)-1], "nvidia") {
			continue
		}
		if !strings.HasPrefix(f[0], "c") {
			t.Fatalf("%s is not a character device in the container: %q", f[len(f)-1], line)
		}
		got[f[len(f)-1]] = f[4] + f[5]
	}
	t.Logf("podman run --device %v sees %v", devices, got)
	return got
}

// unresolvable checks that podman refuses to start a container given
// device, because no CDI spec offers it.
func (p *podman) unresolvable(t *testing.T, device string) {
	t.Helper()
	out, err := p.container(t.Context(), device)
	if err == nil || !strings.Contains(string(out), "unresolvable CDI devices "+device) {
		t.Fatalf("podman run --device %s: %v, want unresolvable CDI devices:\n%s", device, err, out)
	}
	t.Logf("podman run --device %s: %s", device, bytes.TrimSpace(out))
}

func randHex() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newPodman imports a busybox image under a unique name (removed with the
// test) and finds the podman flags that start a container of it here: the
// defaults with modest ulimits first (a host whose hard limit on open files
// is below Podman's default refuses it), then runc with cgroupfs (Debian's
// crun cannot run in a cgroup v1+v2 hybrid). It skips when the test cannot
// run here, saying why.
func newPodman(t *testing.T) *podman {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("not root: podman with CDI devices and mknod need root")
	}
	path, err := exec.LookPath("podman")
	if err != nil {
		t.Skip("podman not installed (apt-get install podman runc busybox-static; tools/scripts/test-deps.sh)")
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox not installed (apt-get install busybox-static)")
	}
	if err := static(bb); err != nil {
		t.Skipf("%s: %v (apt-get install busybox-static)", bb, err)
	}
	p := &podman{path: path, image: "localhost/bcd-podman-test-" + randHex() + ":1"}
	tarball := filepath.Join(t.TempDir(), "rootfs.tar")
	if err := busyboxRootfs(bb, tarball); err != nil {
		t.Fatal(err)
	}
	if out, err := p.cmd(t.Context(), "import", tarball, p.image); err != nil {
		t.Skipf("podman import of a busybox image fails here: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := p.cmd(context.Background(), "rmi", "-f", p.image); err != nil {
			t.Errorf("podman rmi %s: %v\n%s", p.image, err, out)
		}
	})
	ulimits := []string{"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"}
	var tried []string
	for _, flags := range [][]string{nil, {"--runtime", "runc", "--cgroup-manager", "cgroupfs"}} {
		p.flags, p.run = flags, ulimits
		if slices.Contains(flags, "runc") {
			if _, err := exec.LookPath("runc"); err != nil {
				if _, err := os.Stat("/usr/sbin/runc"); err != nil { // podman's own search path, not PATH
					tried = append(tried, "runc not installed (apt-get install runc)")
					continue
				}
			}
		}
		out, err := p.container(t.Context())
		if err == nil {
			t.Logf("podman %s run %s starts containers here", strings.Join(flags, " "), strings.Join(ulimits, " "))
			return p
		}
		tried = append(tried, fmt.Sprintf("podman %s run: %v: %s", strings.Join(flags, " "), err, bytes.TrimSpace(out)))
	}
	t.Skipf("podman cannot start a container here:\n%s", strings.Join(tried, "\n"))
	return nil
}

// static says why the binary at path is not a static executable (nil when
// it is): a dynamic busybox does not run in an image without a libc.
func static(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errors.New("dynamically linked, the test image has no libc")
		}
	}
	return nil
}

// busyboxRootfs writes a root filesystem tarball for podman import:
// bin/busybox (a copy of bb) and the applets the test runs as links.
func busyboxRootfs(bb, tarball string) error {
	body, err := os.ReadFile(bb)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"bin/", "dev/", "proc/", "sys/", "tmp/", "etc/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755}); err != nil {
			return err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(body))}); err != nil {
		return err
	}
	if _, err := tw.Write(body); err != nil {
		return err
	}
	for _, a := range []string{"sh", "ls"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777}); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return os.WriteFile(tarball, buf.Bytes(), 0o644)
}

// lockCDIDir returns dir, a CDI directory Podman reads, once no other run
// of this test uses it (an exclusive flock on the directory, held until
// the test ends), and removes the spec from it when the test ends. A spec
// file there that is not a leftover of this test (its device nodes under
// the temp directory), or any other spec offering bettercompute.io/gpu
// devices to Podman, skips the test: it is a node's, and the test would
// replace it or be misled by it.
func lockCDIDir(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Skipf("the CDI directory %s: %v", dir, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(d.Fd()), unix.LOCK_EX); err != nil {
		_ = d.Close()
		t.Fatalf("flock %s: %v", dir, err)
	}
	spec := filepath.Join(dir, cdi.SpecFile)
	t.Cleanup(func() {
		if err := os.Remove(spec); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("removing the test's CDI spec: %v", err)
		}
		_ = d.Close() // releases the lock
	})
	if b, err := os.ReadFile(spec); err == nil {
		if !leftover(b) {
			t.Skipf("%s is there and not this test's (a node's?); not replacing it", spec)
		}
		if err := os.Remove(spec); err != nil {
			t.Fatal(err)
		}
	}
	reg, err := tcdi.NewCache(tcdi.WithSpecDirs(tcdi.DefaultStaticDir, tcdi.DefaultDynamicDir), tcdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range reg.ListDevices() {
		if strings.HasPrefix(name, cdi.Kind+"=") {
			t.Skipf("a CDI spec in %s or %s already offers %s; the test would be misled", tcdi.DefaultStaticDir, tcdi.DefaultDynamicDir, name)
		}
	}
	return dir
}

// leftover reports whether spec (a bettercompute.io-gpu.json) is one this
// test left behind when killed: every device node's host path is under the
// temp directory.
func leftover(spec []byte) bool {
	s, err := tcdi.ParseSpec(spec)
	if err != nil {
		return false
	}
	tmp := filepath.Clean(os.TempDir()) + string(filepath.Separator)
	var nodes []string
	for _, d := range s.Devices {
		for _, n := range d.ContainerEdits.DeviceNodes {
			nodes = append(nodes, n.HostPath)
		}
	}
	for _, n := range s.ContainerEdits.DeviceNodes {
		nodes = append(nodes, n.HostPath)
	}
	for _, n := range nodes {
		if !strings.HasPrefix(n, tmp) {
			return false
		}
	}
	return len(nodes) > 0
}
