package runtimespec

import (
	"strings"
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

func TestValidate(t *testing.T) {
	ok := []*agentv1.RuntimeSettings{
		nil,
		{},
		{Engines: []string{"containerd", "docker"}, CdiSpecDirs: []string{"/etc/cdi", "/var/run/cdi"}, MinContainerToolkitVersion: "1.14.0"},
		{Engines: []string{"podman", "cri-o"}, MinContainerToolkitVersion: "v1.17.3-rc.1"},
		{CdiSpecDirs: []string{"/run/cdi", "/etc/cdi/tenant-a"}},
	}
	for _, r := range ok {
		if bad := Validate(r); len(bad) > 0 {
			t.Errorf("Validate(%v) = %v, want none", r, bad)
		}
	}
	for _, c := range []struct {
		r     *agentv1.RuntimeSettings
		field string
	}{
		{&agentv1.RuntimeSettings{Engines: []string{"lxc"}}, "engines"},
		{&agentv1.RuntimeSettings{Engines: []string{"docker", "docker"}}, "engines"},
		{&agentv1.RuntimeSettings{Engines: []string{"docker", "podman", "cri-o", "containerd", "docker"}}, "engines"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"etc/cdi"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/../cdi"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cron.d"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cdix"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{`/etc/cdi/x"]` + "\nenable_cdi=false"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cdi", "/etc/cdi"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cdi/a", "/etc/cdi/b", "/etc/cdi/c", "/etc/cdi/d", "/etc/cdi/e"}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cdi/" + strings.Repeat("a", 300)}}, "cdi_spec_dirs"},
		{&agentv1.RuntimeSettings{MinContainerToolkitVersion: "latest"}, "min_container_toolkit_version"},
		{&agentv1.RuntimeSettings{MinContainerToolkitVersion: "1"}, "min_container_toolkit_version"},
		{&agentv1.RuntimeSettings{MinContainerToolkitVersion: "1.014.0"}, "min_container_toolkit_version"},
	} {
		bad := Validate(c.r)
		if len(bad) == 0 || bad[0].Field != c.field {
			t.Errorf("Validate(%v) = %v, want a problem with %s", c.r, bad, c.field)
		}
	}
}

func TestVersionOrder(t *testing.T) {
	for _, c := range []struct {
		a, b string
		less bool
	}{
		{"1.13.5", "1.14.0", true},
		{"1.14.0", "1.14.0", false},
		{"1.14", "1.14.0", false},
		{"1.17.3", "1.9.0", false},
		{"0.9.9", "1.0.0", true},
	} {
		a, err := ParseVersion(c.a)
		if err != nil {
			t.Fatal(err)
		}
		b, err := ParseVersion(c.b)
		if err != nil {
			t.Fatal(err)
		}
		if a.Less(b) != c.less {
			t.Errorf("%s < %s = %v, want %v", c.a, c.b, a.Less(b), c.less)
		}
	}
}

func TestDirsDefault(t *testing.T) {
	if d := Dirs(nil); len(d) != 1 || d[0] != DefaultDir {
		t.Fatalf("Dirs(nil) = %v", d)
	}
	r := &agentv1.RuntimeSettings{CdiSpecDirs: []string{"/etc/cdi"}}
	if d := Dirs(r); len(d) != 1 || d[0] != "/etc/cdi" {
		t.Fatalf("Dirs = %v", d)
	}
}
