package cdi_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/bettercompute/bettercompute/agent/cdi"
)

// TestResolve_AsEnginesDo: every device of a written spec resolves to
// bcd's file through the library's cache; injection really runs (a regular
// file where a device node should be fails it, as it would fail an
// engine's container create); a name the spec lacks is unresolvable.
func TestResolve_AsEnginesDo(t *testing.T) {
	t.Parallel()
	h := newHost(t, 4)
	w := h.writer(t)
	write(t, w, h.gpus, cdi.Reservation{ID: "rsv_1", GPUs: []string{h.gpus[0].UUID, h.gpus[2].UUID}})
	names := []string{cdi.Kind + "=rsv_1", cdi.Kind + "=" + h.gpus[0].UUID, cdi.Kind + "=" + h.gpus[2].UUID}

	res, err := cdi.Resolve([]string{h.dir}, names, false)
	if err != nil {
		t.Fatal(err)
	}
	if res.Devices != 3 || len(res.Problems) != 0 || res.DeviceNodes != 0 {
		t.Errorf("lookup only: %+v, want 3 devices, no problems, no injection", res)
	}
	// The fake host's device nodes are regular files: the library's
	// injection stats them and refuses, as an engine would.
	res, err = cdi.Resolve([]string{h.dir}, names, true)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Problems) != 1 || !strings.HasPrefix(res.Problems[0], "injecting: ") {
		t.Errorf("injecting regular files: %+v, want one injection problem", res)
	}

	res, err = cdi.Resolve([]string{h.dir}, []string{cdi.Kind + "=rsv_2", cdi.Kind + "=" + h.gpus[1].UUID}, false)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{cdi.Kind + "=rsv_2: unresolvable", cdi.Kind + "=" + h.gpus[1].UUID + ": unresolvable"}
	if fmt.Sprint(res.Problems) != fmt.Sprint(want) || res.Devices != 0 {
		t.Errorf("names the spec lacks: %+v, want %v", res, want)
	}
}

// TestResolve_InjectsRealDeviceNodes: with character devices where the
// spec points (mknod, root only), injection gives the OCI spec each booked
// GPU's node and the control nodes.
func TestResolve_InjectsRealDeviceNodes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mknod needs root")
	}
	t.Parallel()
	h := newHost(t, 2)
	err := filepath.WalkDir(filepath.Join(h.dev, "dev"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if err := os.Remove(p); err != nil {
			return err
		}
		return unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(195, 0)))
	})
	if err != nil {
		t.Fatal(err)
	}
	w := h.writer(t)
	write(t, w, h.gpus, cdi.Reservation{ID: "rsv_1", GPUs: []string{h.gpus[0].UUID, h.gpus[1].UUID}})
	res, err := cdi.Resolve([]string{h.dir}, []string{cdi.Kind + "=rsv_1"}, true)
	if err != nil {
		t.Fatal(err)
	}
	// Two GPUs and four control nodes.
	if len(res.Problems) != 0 || res.Devices != 1 || res.DeviceNodes != 6 {
		t.Errorf("%+v, want 1 device injecting 6 device nodes", res)
	}
}

// TestResolve_ConflictOrOverrideIsAProblem: another vendor's file naming
// the same device in the same directory makes the library drop it (a
// conflict an engine would fail on), and a file in a later directory of
// the engine's list overrides bcd's: both are problems naming the file.
func TestResolve_ConflictOrOverrideIsAProblem(t *testing.T) {
	t.Parallel()
	h := newHost(t, 2)
	w := h.writer(t)
	write(t, w, h.gpus, cdi.Reservation{ID: "rsv_1", GPUs: []string{h.gpus[0].UUID}})
	other := `{"cdiVersion":"0.6.0","kind":"` + cdi.Kind + `","devices":[{"name":"rsv_1","containerEdits":{"deviceNodes":[{"path":"/dev/null"}]}}]}`
	if err := os.WriteFile(filepath.Join(h.dir, "other.json"), []byte(other), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := cdi.Resolve([]string{h.dir}, []string{cdi.Kind + "=rsv_1"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Problems) != 1 || !strings.Contains(res.Problems[0], "conflicting device") || !strings.Contains(res.Problems[0], "other.json") {
		t.Errorf("same directory: %+v, want a conflict naming other.json", res)
	}

	if err := os.Remove(filepath.Join(h.dir, "other.json")); err != nil {
		t.Fatal(err)
	}
	later := t.TempDir()
	if err := os.WriteFile(filepath.Join(later, "other.json"), []byte(other), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err = cdi.Resolve([]string{h.dir, later}, []string{cdi.Kind + "=rsv_1"}, false)
	if err != nil {
		t.Fatal(err)
	}
	want := cdi.Kind + "=rsv_1: resolves to " + filepath.Join(later, "other.json") + ", not bcd's spec"
	if len(res.Problems) != 1 || res.Problems[0] != want {
		t.Errorf("later directory: %+v, want %q", res, want)
	}
}
