package engines_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/engines"
)

func put(t *testing.T, root, rel, data string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func file(t *testing.T, res engines.Result, rel string) (string, bool) {
	t.Helper()
	for _, f := range res.Files {
		if f.Path == rel {
			return string(f.Data), f.Data != nil
		}
	}
	t.Fatalf("no %s in %v", rel, res.Files)
	return "", false
}

// TestContainerd_ConfigVersionAndImports: the drop-in follows config.toml's
// version (3: containerd 2's CRI runtime plugin) and the status says when
// config.toml does not import it.
func TestContainerd_ConfigVersionAndImports(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, conf, plugin, status string
	}{
		{"v2 imported", "version = 2\nimports = ['/etc/containerd/conf.d/*.toml']\n", `[plugins."io.containerd.grpc.v1.cri"]`, "containerd reads it at its next restart"},
		{"v3 imported by name", "version = 3 # containerd 2\nimports = [\"/etc/containerd/conf.d/50-bettercompute.toml\"]\n", `[plugins."io.containerd.cri.v1.runtime"]`, "containerd reads it at its next restart"},
		{"imports in a table do not count", "version = 2\n[plugins]\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n", `[plugins."io.containerd.grpc.v1.cri"]`, "not imported: add imports"},
		{"other imports", "version = 2\nimports = [\"/etc/containerd/other/*.toml\"]\n", `[plugins."io.containerd.grpc.v1.cri"]`, "not imported: add imports"},
	} {
		root := t.TempDir()
		put(t, root, engines.ContainerdConf, c.conf)
		res, err := engines.Plan(context.Background(), engines.Config{Root: root}, []string{"containerd"}, []string{"/var/run/cdi"}, engines.Record{}, false)
		if err != nil {
			t.Fatal(err)
		}
		data, _ := file(t, res, engines.ContainerdDropIn)
		if !strings.Contains(data, c.plugin+"\n  enable_cdi = true\n  cdi_spec_dirs = [\"/var/run/cdi\"]\n") {
			t.Errorf("%s: drop-in\n%s", c.name, data)
		}
		if len(res.Engines) != 1 || !strings.Contains(res.Engines[0].Config, c.status) {
			t.Errorf("%s: status %v, want %q", c.name, res.Engines, c.status)
		}
	}
}

// TestDocker_OperatorsOwnCDIKeysSurviveRevert: keys the operator had set
// before bcd are left as they were when docker leaves the section.
func TestDocker_OperatorsOwnCDIKeysSurviveRevert(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	orig := `{"features":{"cdi":true},"cdi-spec-dirs":["/etc/cdi"],"debug":true}`
	put(t, root, engines.DockerConf, orig)
	cfg := engines.Config{Root: root}
	res, err := engines.Plan(context.Background(), cfg, []string{"docker"}, []string{"/var/run/cdi"}, engines.Record{}, false)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := file(t, res, engines.DockerConf)
	var got map[string]any
	if err := json.Unmarshal([]byte(data), &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got["cdi-spec-dirs"], []any{"/var/run/cdi"}) || got["debug"] != true {
		t.Fatalf("merged %s", data)
	}
	put(t, root, engines.DockerConf, data)
	res, err = engines.Plan(context.Background(), cfg, nil, nil, res.Record, false)
	if err != nil {
		t.Fatal(err)
	}
	data, _ = file(t, res, engines.DockerConf)
	var back, want map[string]any
	_ = json.Unmarshal([]byte(data), &back)
	_ = json.Unmarshal([]byte(orig), &want)
	if !reflect.DeepEqual(back, want) || res.Record.Docker != nil {
		t.Fatalf("reverted %s (record %+v), want %s", data, res.Record.Docker, orig)
	}
}

// TestToolkit_FindsTheBinary: an explicit nvidia-ctk path that is not there
// is reported as such.
func TestToolkit_FindsTheBinary(t *testing.T) {
	t.Parallel()
	have, why := engines.Toolkit(context.Background(), engines.Config{Runner: engines.Exec{}, NvidiaCTK: "/nonexistent/nvidia-ctk"}, "1.14.0")
	if have != "" || why != "nvidia-ctk not found at /nonexistent/nvidia-ctk (min_container_toolkit_version 1.14.0)" {
		t.Fatalf("%q %q", have, why)
	}
}

// TestCheck_CRIODefaultsPrintedCommentedOut: crio prints a key left at its
// default commented out; that is what the daemon runs with.
func TestCheck_CRIODefaultsPrintedCommentedOut(t *testing.T) {
	t.Parallel()
	bin := t.TempDir()
	out := "[crio.runtime]\n# Directories to scan for CDI Spec files.\n# cdi_spec_dirs = [\n# \t\"/etc/cdi\",\n# \t\"/var/run/cdi\",\n# ]\n\n[crio.image]\n"
	if err := os.WriteFile(filepath.Join(bin, "crio"), []byte("#!/bin/sh\nprintf '%s' '"+out+"'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	r := engines.Exec{Dirs: []string{bin}}
	if got := engines.Check(context.Background(), r, "cri-o", []string{"/var/run/cdi"}); got != "loaded" {
		t.Errorf("default dirs: %q", got)
	}
	if got := engines.Check(context.Background(), r, "cri-o", []string{"/opt/cdi"}); got != "not loaded: cri-o reads CDI specs from [/etc/cdi, /var/run/cdi], not /opt/cdi, restart crio" {
		t.Errorf("other dir: %q", got)
	}
}

// TestCheck_RealTools asks the engines' real tools where they are
// installed: their output must parse (an engine not running is "not
// checked" with the tool's error).
func TestCheck_RealTools(t *testing.T) {
	t.Parallel()
	ran := 0
	for engine, tool := range map[string]string{"podman": "podman", "docker": "docker", "containerd": "crictl", "cri-o": "crio"} {
		if _, err := (engines.Exec{}).LookPath(tool); err != nil {
			continue
		}
		ran++
		got := engines.Check(context.Background(), engines.Exec{}, engine, []string{"/var/run/cdi"})
		switch {
		case strings.Contains(got, "unexpected output"), strings.Contains(got, "shows no"), strings.Contains(got, "no CRI config"):
			t.Errorf("%s: %q", tool, got)
		case engine == "podman" && !strings.HasPrefix(got, "loaded: podman ") && !strings.HasPrefix(got, "not loaded: podman "):
			t.Errorf("podman: %q", got)
		}
		t.Logf("%s: %s", tool, got)
	}
	if ran == 0 {
		t.Skip("no engine tool installed (podman, docker, crictl, crio)")
	}
}
