package converge_test

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"tags.cncf.io/container-device-interface/pkg/cdi"

	cdipkg "github.com/bettercompute/bettercompute/agent/cdi"
	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/engines"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// runtimeNode is a converger whose runtime root (the engines' files, the
// CDI directories) is sys and whose tools are the scripts in bin.
type runtimeNode struct {
	c        *converge.Converger
	root     string // state root
	sys, bin string
	writes   atomic.Int64 // files written through Config.Write
}

func newRuntimeNode(t *testing.T) *runtimeNode {
	t.Helper()
	n := &runtimeNode{root: t.TempDir(), sys: t.TempDir(), bin: t.TempDir()}
	var err error
	n.c, err = converge.New(converge.Config{Root: n.root, NodeID: "node_1",
		GPUs: func(context.Context) ([]string, error) { return []string{"GPU-a", "GPU-b", "GPU-c"}, nil },
		Write: func(path string, data []byte, mode os.FileMode) error {
			n.writes.Add(1)
			return state.WriteAtomic(path, data, mode)
		},
		Runtime: converge.Runtime{Root: n.sys, Runner: engines.Exec{Dirs: []string{n.bin}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// tool installs a fake command-line tool: a shell script printing out.
func (n *runtimeNode) tool(t *testing.T, name, out string) {
	t.Helper()
	script := "#!/bin/sh\ncat <<'EOF'\n" + out + "\nEOF\n"
	if err := os.WriteFile(filepath.Join(n.bin, name), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
}

func (n *runtimeNode) put(t *testing.T, rel, data string) {
	t.Helper()
	p := filepath.Join(n.sys, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// read returns rel under the system root, "" when absent.
func (n *runtimeNode) read(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(n.sys, rel))
	if os.IsNotExist(err) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func (n *runtimeNode) converge(t *testing.T, gen int64, spec *agentv1.NodeSpec) map[string]*agentv1.SectionStatus {
	t.Helper()
	spec.Identity = &agentv1.NodeIdentity{NodeId: "node_1"}
	ss, _ := n.c.Converge(context.Background(), &agentv1.DesiredState{Generation: gen, Spec: spec})
	return states(ss)
}

const operatorDaemonJSON = `{
    "log-driver": "journald",
    "features": {"buildkit": true},
    "registry-mirrors": ["https://mirror.example"]
}`

func jsonOf(t *testing.T, s string) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("%v: %q", err, s)
	}
	return v
}

// TestRuntime_EnginesConfiguredIdempotentAndReverted: each named engine
// gets its CDI configuration, a second pass writes nothing, daemon.json
// keeps the operator's keys, and an engine taken out of the section is
// reverted (drop-in removed, daemon.json back to the operator's).
func TestRuntime_EnginesConfiguredIdempotentAndReverted(t *testing.T) {
	t.Parallel()
	n := newRuntimeNode(t)
	n.put(t, engines.ContainerdConf, "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"] # bcd's drop-ins\n\n[plugins]\n")
	n.put(t, engines.DockerConf, operatorDaemonJSON)
	rt := &agentv1.RuntimeSettings{Engines: []string{"containerd", "cri-o", "docker", "podman"}, CdiSpecDirs: []string{"/etc/cdi", "/var/run/cdi"}}
	st := n.converge(t, 1, &agentv1.NodeSpec{Runtime: rt})["runtime"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("runtime %v", st)
	}
	dirs := `["/etc/cdi", "/var/run/cdi"]`
	for rel, want := range map[string]string{
		engines.ContainerdDropIn: "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  enable_cdi = true\n  cdi_spec_dirs = " + dirs + "\n",
		engines.CRIODropIn:       "[crio.runtime]\ncdi_spec_dirs = " + dirs + "\n",
		engines.PodmanDropIn:     "[engine]\ncdi_spec_dirs = " + dirs + "\n",
	} {
		if got := n.read(t, rel); !strings.HasPrefix(got, "# Written by bcd") || !strings.HasSuffix(got, want) {
			t.Errorf("%s:\n%s\nwant it to end with\n%s", rel, got, want)
		}
	}
	d := jsonOf(t, n.read(t, engines.DockerConf))
	want := jsonOf(t, `{"log-driver": "journald", "features": {"buildkit": true, "cdi": true},
		"registry-mirrors": ["https://mirror.example"], "cdi-spec-dirs": ["/etc/cdi", "/var/run/cdi"]}`)
	if !reflect.DeepEqual(d, want) {
		t.Errorf("daemon.json %v, want %v", d, want)
	}
	for _, part := range []string{
		"CDI spec directories /etc/cdi, /var/run/cdi",
		"containerd: /" + engines.ContainerdDropIn + " written, containerd reads it at its next restart (bcd does not restart it) (not checked: crictl not found)",
		"cri-o: /" + engines.CRIODropIn + " written",
		"docker: features.cdi and cdi-spec-dirs merged into /" + engines.DockerConf,
		"podman: /" + engines.PodmanDropIn + " written, podman reads it at every run (not checked: podman not found)",
	} {
		if !strings.Contains(st.GetReason(), part) {
			t.Errorf("reason %q lacks %q", st.GetReason(), part)
		}
	}

	before := n.writes.Load()
	st = n.converge(t, 2, &agentv1.NodeSpec{Runtime: rt})["runtime"]
	if got := n.writes.Load() - before; got != 2 {
		t.Errorf("a second pass wrote %d files, want 2 (the observed generation and the desired state)", got)
	}
	if !strings.Contains(st.GetReason(), "/"+engines.ContainerdDropIn+" in place") || !strings.Contains(st.GetReason(), "in place in /"+engines.DockerConf) {
		t.Errorf("second pass reason %q", st.GetReason())
	}

	// Docker and Podman taken out.
	rt2 := &agentv1.RuntimeSettings{Engines: []string{"containerd", "cri-o"}, CdiSpecDirs: rt.CdiSpecDirs}
	st = n.converge(t, 3, &agentv1.NodeSpec{Runtime: rt2})["runtime"]
	if got := n.read(t, engines.PodmanDropIn); got != "" {
		t.Errorf("podman drop-in left: %q", got)
	}
	if got := jsonOf(t, n.read(t, engines.DockerConf)); !reflect.DeepEqual(got, jsonOf(t, operatorDaemonJSON)) {
		t.Errorf("daemon.json after revert %v, want the operator's %s", got, operatorDaemonJSON)
	}
	if n.read(t, engines.ContainerdDropIn) == "" || n.read(t, engines.CRIODropIn) == "" {
		t.Error("containerd's or CRI-O's drop-in removed with docker's")
	}
	for _, part := range []string{"podman: reverted: /" + engines.PodmanDropIn + " removed", "docker: reverted: features.cdi and cdi-spec-dirs restored"} {
		if !strings.Contains(st.GetReason(), part) {
			t.Errorf("reason %q lacks %q", st.GetReason(), part)
		}
	}

	// The section removed: nothing of bcd's is left.
	st = n.converge(t, 4, &agentv1.NodeSpec{})["runtime"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("runtime %v", st)
	}
	for _, rel := range []string{engines.ContainerdDropIn, engines.CRIODropIn} {
		if got := n.read(t, rel); got != "" {
			t.Errorf("%s left: %q", rel, got)
		}
	}
	if _, err := os.Stat(filepath.Join(n.root, converge.RuntimeFile)); !os.IsNotExist(err) {
		t.Errorf("%s left: %v", converge.RuntimeFile, err)
	}
	if !strings.Contains(st.GetReason(), "containerd: reverted") {
		t.Errorf("reason %q", st.GetReason())
	}
}

// TestRuntime_DockerCreatedThenRemoved: a daemon.json bcd created is removed
// on revert, and one that is not JSON is left alone with the section
// failed.
func TestRuntime_DockerCreatedThenRemoved(t *testing.T) {
	t.Parallel()
	n := newRuntimeNode(t)
	rt := &agentv1.RuntimeSettings{Engines: []string{"docker"}}
	n.converge(t, 1, &agentv1.NodeSpec{Runtime: rt})
	if got, want := jsonOf(t, n.read(t, engines.DockerConf)), jsonOf(t, `{"features":{"cdi":true},"cdi-spec-dirs":["/var/run/cdi"]}`); !reflect.DeepEqual(got, want) {
		t.Fatalf("daemon.json %v, want %v", got, want)
	}
	n.converge(t, 2, &agentv1.NodeSpec{})
	if _, err := os.Stat(filepath.Join(n.sys, engines.DockerConf)); !os.IsNotExist(err) {
		t.Fatalf("daemon.json bcd created is still there: %v", err)
	}

	n.put(t, engines.DockerConf, "{not json")
	st := n.converge(t, 3, &agentv1.NodeSpec{Runtime: rt})["runtime"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.Contains(st.GetReason(), "/etc/docker/daemon.json is not a JSON object") {
		t.Fatalf("runtime %v", st)
	}
	if got := n.read(t, engines.DockerConf); got != "{not json" {
		t.Fatalf("a broken daemon.json was rewritten: %q", got)
	}
}

// TestRuntime_BadSectionFailsNamingTheField: an invalid section is
// FAILED_TERMINAL naming its field and writes nothing.
func TestRuntime_BadSectionFailsNamingTheField(t *testing.T) {
	t.Parallel()
	for field, rt := range map[string]*agentv1.RuntimeSettings{
		"cdi_spec_dirs":                 {Engines: []string{"docker"}, CdiSpecDirs: []string{"var/run/cdi"}},
		"engines":                       {Engines: []string{"docker", "docker"}},
		"min_container_toolkit_version": {Engines: []string{"podman"}, MinContainerToolkitVersion: "latest"},
	} {
		n := newRuntimeNode(t)
		ss := n.converge(t, 1, &agentv1.NodeSpec{Runtime: rt, Devices: &agentv1.DeviceAssignments{
			Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{"GPU-a"}}}}})
		st := ss["runtime"]
		if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.HasPrefix(st.GetReason(), "invalid runtime section: "+field+": ") {
			t.Errorf("%s: %v", field, st)
		}
		if _, err := os.Stat(filepath.Join(n.sys, "etc")); !os.IsNotExist(err) {
			t.Errorf("%s: an invalid section wrote under the root: %v", field, err)
		}
		// The spec still goes where it goes without a runtime section.
		if readCDI(t, n.root) == nil {
			t.Errorf("%s: no CDI spec in the default directory", field)
		}
	}
}

// TestRuntime_ToolkitVersion: nvidia-ctk below the minimum, or absent,
// fails the section naming the versions; at or above it converges.
func TestRuntime_ToolkitVersion(t *testing.T) {
	t.Parallel()
	n := newRuntimeNode(t)
	rt := &agentv1.RuntimeSettings{Engines: []string{"podman"}, MinContainerToolkitVersion: "1.14.0"}
	st := n.converge(t, 1, &agentv1.NodeSpec{Runtime: rt})["runtime"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.HasPrefix(st.GetReason(), "nvidia-ctk not found (min_container_toolkit_version 1.14.0)") {
		t.Fatalf("no nvidia-ctk: %v", st)
	}
	if n.read(t, engines.PodmanDropIn) == "" {
		t.Error("the engines were not configured while the toolkit check failed")
	}
	n.tool(t, "nvidia-ctk", "NVIDIA Container Toolkit CLI version 1.13.5\ncommit: 6b8589dcb4dead72ab64f14a5912886e6165c079")
	st = n.converge(t, 2, &agentv1.NodeSpec{Runtime: rt})["runtime"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.HasPrefix(st.GetReason(), "nvidia-ctk 1.13.5 is older than min_container_toolkit_version 1.14.0") {
		t.Fatalf("old nvidia-ctk: %v", st)
	}
	n.tool(t, "nvidia-ctk", "NVIDIA Container Toolkit CLI version 1.17.3\ncommit: 3ad5ef1a")
	st = n.converge(t, 3, &agentv1.NodeSpec{Runtime: rt})["runtime"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.Contains(st.GetReason(), "nvidia-ctk 1.17.3 (min_container_toolkit_version 1.14.0)") {
		t.Fatalf("new nvidia-ctk: %v", st)
	}
}

// TestRuntime_EngineLoadedCheck: each engine's tool is asked whether the
// running engine reads the section's directories.
func TestRuntime_EngineLoadedCheck(t *testing.T) {
	t.Parallel()
	n := newRuntimeNode(t)
	n.put(t, engines.ContainerdConf, "version = 2\nimports = [\n  \"conf.d/*.toml\",\n]\n")
	rt := &agentv1.RuntimeSettings{Engines: []string{"containerd", "cri-o", "docker", "podman"}, CdiSpecDirs: []string{"/etc/cdi", "/var/run/cdi"}}
	n.tool(t, "docker", `["/etc/cdi","/var/run/cdi"]`)
	n.tool(t, "crictl", `{"status":{},"config":{"enableCDI":false,"cdiSpecDirs":["/etc/cdi","/var/run/cdi"]}}`)
	n.tool(t, "crio", "[crio.runtime]\n  cdi_spec_dirs = [\n    \"/etc/cdi\",\n  ]\n[crio.image]\n")
	n.tool(t, "podman", "5.5.2")
	reason := n.converge(t, 1, &agentv1.NodeSpec{Runtime: rt})["runtime"].GetReason()
	for _, part := range []string{
		"(bcd does not restart it) (not loaded: containerd runs with enable_cdi = false, restart containerd)",
		"(bcd does not restart it) (not loaded: cri-o reads CDI specs from [/etc/cdi], not /var/run/cdi, restart crio)",
		"(bcd does not restart it) (loaded)",
		"(loaded: podman 5.5.2 reads containers.conf.d at every run)",
	} {
		if !strings.Contains(reason, part) {
			t.Errorf("reason %q lacks %q", reason, part)
		}
	}
	n.tool(t, "docker", `[]`)
	n.tool(t, "podman", "4.9.3")
	if err := os.WriteFile(filepath.Join(n.bin, "crictl"), []byte("#!/bin/sh\necho 'connect: connection refused' >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	rt.CdiSpecDirs = []string{"/var/run/cdi", "/run/cdi"}
	reason = n.converge(t, 2, &agentv1.NodeSpec{Runtime: rt})["runtime"].GetReason()
	for _, part := range []string{
		"(not loaded: docker reads CDI specs from [], not /var/run/cdi, /run/cdi, restart docker)",
		"(not loaded: podman 4.9.3 ignores cdi_spec_dirs (read from 5.5) and reads only /etc/cdi, /var/run/cdi, not /run/cdi)",
		"(not checked: crictl: exit status 1: connect: connection refused)",
	} {
		if !strings.Contains(reason, part) {
			t.Errorf("reason %q lacks %q", reason, part)
		}
	}
}

// TestDevices_SpecInEachRuntimeDirectory: the spec lands in every CDI
// directory the runtime section names (under the runtime root), leaves the
// default one, and leaves a directory taken out of the section.
func TestDevices_SpecInEachRuntimeDirectory(t *testing.T) {
	t.Parallel()
	n := newRuntimeNode(t)
	devices := &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{"GPU-b", "GPU-a"}}}}
	n.converge(t, 1, &agentv1.NodeSpec{Devices: devices})
	if readCDI(t, n.root) == nil {
		t.Fatal("no spec in the default directory without a runtime section")
	}
	spec := func(dir string) []string {
		b, err := os.ReadFile(filepath.Join(n.sys, dir, "bettercompute.io-gpu.json"))
		if os.IsNotExist(err) {
			return nil
		}
		if err != nil {
			t.Fatal(err)
		}
		s, err := cdi.ParseSpec(b)
		if err != nil {
			t.Fatal(err)
		}
		return deviceNames(s)
	}
	rt := &agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cdi", "/var/run/cdi"}}
	st := n.converge(t, 2, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	want := []string{"GPU-a", "GPU-b", "rsv_1"}
	for _, dir := range rt.CdiSpecDirs {
		if got := spec(dir); !slices.Equal(got, want) {
			t.Errorf("%s offers %v, want %v", dir, got, want)
		}
	}
	if readCDI(t, n.root) != nil {
		t.Error("the spec stayed in the default directory once the runtime section named others")
	}
	wantReason := "exposes 2 GPUs: rsv_1 (GPU-b,GPU-a) as bettercompute.io/gpu=rsv_1; CDI spec in " +
		filepath.Join(n.sys, "etc/cdi") + ", " + filepath.Join(n.sys, "var/run/cdi")
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.HasPrefix(st.GetReason(), wantReason) {
		t.Errorf("devices %v, want reason %q", st, wantReason)
	}
	if n.c.DevicesDrifted() {
		t.Error("drifted right after writing")
	}

	rt.CdiSpecDirs = []string{"/var/run/cdi"}
	n.converge(t, 3, &agentv1.NodeSpec{Devices: devices, Runtime: rt})
	if got := spec("/etc/cdi"); got != nil {
		t.Errorf("/etc/cdi still offers %v after it left the section", got)
	}
	if got := spec("/var/run/cdi"); !slices.Equal(got, want) {
		t.Errorf("/var/run/cdi offers %v", got)
	}
	// A hand edit in a section directory is seen and restored.
	if err := os.Remove(filepath.Join(n.sys, "var/run/cdi", "bettercompute.io-gpu.json")); err != nil {
		t.Fatal(err)
	}
	if !n.c.DevicesDrifted() {
		t.Error("a removed spec in a section directory is not seen")
	}
	st = n.converge(t, 4, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	if !strings.HasPrefix(st.GetReason(), "drifted: "+filepath.Join(n.sys, "var/run/cdi", "bettercompute.io-gpu.json")) || spec("/var/run/cdi") == nil {
		t.Errorf("after removal: %v", st)
	}
}

// TestDevices_DriverUpgradeRegeneratesSpec: when NVML reports another
// driver version (the mock's), DevicesStale says so at the next drift
// check and the converge it triggers mounts the new driver's libraries.
func TestDevices_DriverUpgradeRegeneratesSpec(t *testing.T) {
	t.Parallel()
	mock := inventory.NewMock()
	inv, err := inventory.New(mock, inventory.Config{Hostname: "test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	root, drv := t.TempDir(), t.TempDir()
	lib := func(version string) string {
		return filepath.Join(drv, "usr/lib/x86_64-linux-gnu", "libcuda.so."+version)
	}
	if err := os.MkdirAll(filepath.Dir(lib("")), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(lib("550.54.15"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := cdipkg.New(cdipkg.Config{Dir: filepath.Join(root, "cdi"), DevRoot: t.TempDir(), DriverRoot: drv, NvidiaCTK: "/nonexistent"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := converge.New(converge.Config{Root: root, NodeID: "node_1", CDI: w, Minors: inv.Minors, Driver: inv.DriverVersion,
		GPUs: func(ctx context.Context) ([]string, error) {
			m, err := inv.Minors(ctx)
			return slices.Sorted(maps.Keys(m)), err
		}})
	if err != nil {
		t.Fatal(err)
	}
	minors, err := inv.Minors(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	gpu := slices.Sorted(maps.Keys(minors))[0]
	ds := &agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Devices: &agentv1.DeviceAssignments{
		Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{gpu}}}}}}
	mounts := func() []string {
		var out []string
		for _, m := range readCDI(t, root).ContainerEdits.Mounts {
			out = append(out, m.HostPath)
		}
		return out
	}
	c.Converge(context.Background(), ds)
	if got := mounts(); !slices.Equal(got, []string{lib("550.54.15")}) {
		t.Fatalf("mounts %v", got)
	}
	if c.DevicesStale(context.Background()) {
		t.Fatal("stale right after converging")
	}

	// The driver is upgraded: new files, and NVML reports the new version.
	if err := os.Rename(lib("550.54.15"), lib("560.35.03")); err != nil {
		t.Fatal(err)
	}
	mock.DriverVersion = "560.35.03"
	if !c.DevicesStale(context.Background()) {
		t.Fatal("a driver upgrade is not seen")
	}
	c.Converge(context.Background(), ds)
	if got := mounts(); !slices.Equal(got, []string{lib("560.35.03")}) {
		t.Fatalf("after the upgrade: mounts %v", got)
	}
	if c.DevicesStale(context.Background()) {
		t.Fatal("stale after regenerating")
	}
}

// TestDevices_EnginesResolveTheBooking: once the spec is on disk, the
// devices section checks that each device resolves as the engines resolve
// it (the CDI library over the section's directories) and, with docker
// named, that the daemon has discovered it; either failing is FAILED
// naming the device, and the section converges once it passes.
func TestDevices_EnginesResolveTheBooking(t *testing.T) {
	t.Parallel()
	n := newRuntimeNode(t)
	docker := func(discovered string) {
		script := "#!/bin/sh\ncase \"$3\" in\n*DiscoveredDevices*) echo '" + discovered + "' ;;\n*) echo '[\"/var/run/cdi\"]' ;;\nesac\n"
		if err := os.WriteFile(filepath.Join(n.bin, "docker"), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	rt := &agentv1.RuntimeSettings{Engines: []string{"docker"}, CdiSpecDirs: []string{"/var/run/cdi"}}
	devices := &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{"GPU-a", "GPU-b"}}}}

	// The daemon has not picked the spec up yet.
	docker(`[{"Source":"cdi","ID":"bettercompute.io/gpu=GPU-a"}]`)
	st := n.converge(t, 1, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED ||
		!strings.HasPrefix(st.GetReason(), "docker has not discovered bettercompute.io/gpu=GPU-b, bettercompute.io/gpu=rsv_1;") {
		t.Errorf("docker lacking the booking: %v", st)
	}
	docker(`[{"Source":"cdi","ID":"bettercompute.io/gpu=GPU-a"},{"Source":"cdi","ID":"bettercompute.io/gpu=GPU-b"},{"Source":"cdi","ID":"bettercompute.io/gpu=rsv_1"}]`)
	st = n.converge(t, 1, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED ||
		!strings.Contains(st.GetReason(), "; 3 devices resolve as the engines resolve them (injection not tried: device nodes missing); docker has discovered them") {
		t.Errorf("docker with the booking: %v", st)
	}

	// Another vendor's file naming the reservation's device in the same
	// directory: the library drops both, so no engine would resolve it.
	n.put(t, "var/run/cdi/other.json", `{"cdiVersion":"0.6.0","kind":"bettercompute.io/gpu","devices":[{"name":"rsv_2","containerEdits":{"deviceNodes":[{"path":"/dev/null"}]}}]}`)
	devices.Assignments = append(devices.Assignments, &agentv1.DeviceAssignment{ReservationId: "rsv_2", GpuUuids: []string{"GPU-c"}})
	st = n.converge(t, 2, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED ||
		!strings.Contains(st.GetReason(), "does not resolve bettercompute.io/gpu=rsv_2: conflicting device") {
		t.Errorf("conflicting file: %v", st)
	}
	if err := os.Remove(filepath.Join(n.sys, "var/run/cdi/other.json")); err != nil {
		t.Fatal(err)
	}
	docker(`[]`)
	st = n.converge(t, 2, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.Contains(st.GetReason(), "docker has not discovered") {
		t.Errorf("after the conflict went: %v", st)
	}
	// An older docker cannot say: not checked, not failed.
	if err := os.WriteFile(filepath.Join(n.bin, "docker"), []byte("#!/bin/sh\ncase \"$3\" in\n*DiscoveredDevices*) echo 'template: :1:8: executing \"\" at <.DiscoveredDevices>: can'\"'\"'t evaluate field DiscoveredDevices in type system.Info' >&2; exit 1 ;;\n*) echo '[\"/var/run/cdi\"]' ;;\nesac\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	st = n.converge(t, 2, &agentv1.NodeSpec{Devices: devices, Runtime: rt})["devices"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.Contains(st.GetReason(), "docker not checked: this docker does not list discovered devices (28.2 and later do)") {
		t.Errorf("older docker: %v", st)
	}
}
