package seed_test

import (
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/seed"
)

const key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBetterComputeTestKeyOnly tenant@laptop"

func spec() vps.Spec {
	return vps.Spec{ID: "inst_abc123", Image: "tiny.qcow2", Power: vps.Running, Size: vps.Size{VCPUs: 1, MemoryMiB: 128, DiskGiB: 1},
		Hostname: "web-1", SSHKeys: []string{key}}
}

func build(t *testing.T, s vps.Spec) (string, map[string][]byte) {
	t.Helper()
	img, err := seed.Build(s)
	if err != nil {
		t.Fatal(err)
	}
	label, files, err := seed.Read(img)
	if err != nil {
		t.Fatal(err)
	}
	return label, files
}

func TestBuild_ReadsBackKeysHostnameAndNothingElse(t *testing.T) {
	t.Parallel()
	label, files := build(t, spec())
	if label != seed.Label {
		t.Errorf("label %q, want %q", label, seed.Label)
	}
	if got := slices.Sorted(maps.Keys(files)); !slices.Equal(got, []string{"meta-data", "user-data"}) {
		t.Fatalf("files %v, want exactly meta-data and user-data", got)
	}
	if got, want := string(files["meta-data"]), "instance-id: \"inst_abc123\"\nlocal-hostname: \"web-1\"\n"; got != want {
		t.Errorf("meta-data %q, want %q", got, want)
	}
	want := "#cloud-config\nhostname: \"web-1\"\npreserve_hostname: false\nssh_authorized_keys:\n  - \"" + key + "\"\n"
	if got := string(files["user-data"]); got != want {
		t.Errorf("user-data:\n%s\nwant exactly:\n%s", got, want)
	}
}

func TestBuild_TenantUserDataIsItsOwnPart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, data, ctype string
	}{
		{"cloud-config merged", "#cloud-config\npackages: [nginx]\n", "Content-Type: text/cloud-config"},
		{"script", "#!/bin/sh\necho hello > /tmp/hello\n", "Content-Type: text/x-shellscript"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := spec()
			s.UserData = tc.data
			_, files := build(t, s)
			ud := string(files["user-data"])
			if !strings.HasPrefix(ud, "Content-Type: multipart/mixed; boundary=") {
				t.Fatalf("user-data is not multipart:\n%s", ud)
			}
			parts := strings.Count(ud, "\nContent-Disposition: attachment")
			if parts != 2 {
				t.Errorf("%d parts, want 2 (ours and the tenant's):\n%s", parts, ud)
			}
			if !strings.Contains(ud, tc.data) || !strings.Contains(ud, key) || !strings.Contains(ud, `hostname: "web-1"`) {
				t.Errorf("user-data lacks the tenant's data, the key or the host name:\n%s", ud)
			}
			_, tenantPart, _ := strings.Cut(ud, `filename="user-data"`)
			if !strings.Contains(ud, tc.ctype) || strings.Contains(tenantPart, "bettercompute") {
				t.Errorf("tenant part wrong:\n%s", ud)
			}
			if tc.name == "cloud-config merged" && !strings.Contains(ud, "Merge-Type: "+seed.MergeType) {
				t.Errorf("a tenant #cloud-config must carry Merge-Type so its lists add to ours:\n%s", ud)
			}
		})
	}
}

func TestBuild_NoPlatformSecretsOrAgent(t *testing.T) {
	t.Parallel()
	s := spec()
	s.UserData = "#cloud-config\nruncmd: [[echo, ok]]\n"
	s.NetworkConfig = "version: 2\nethernets:\n  eth0:\n    dhcp4: true\n"
	_, files := build(t, s)
	if got := slices.Sorted(maps.Keys(files)); !slices.Equal(got, []string{"meta-data", "network-config", "user-data"}) {
		t.Fatalf("files %v", got)
	}
	if string(files["network-config"]) != s.NetworkConfig {
		t.Errorf("network-config %q", files["network-config"])
	}
	all := string(files["meta-data"]) + string(files["user-data"]) + string(files["network-config"])
	for _, bad := range []string{"bcjt_", "bck_", "bcst_", "bcd", "join", "token", "BEGIN ", "write_files", "/opt/bettercompute"} {
		if strings.Contains(all, bad) {
			t.Errorf("the seed contains %q:\n%s", bad, all)
		}
	}
	// Everything beyond the tenant's own text is the fixed set of our keys.
	ours := strings.ReplaceAll(all, s.UserData, "")
	for _, line := range strings.Split(ours, "\n") {
		k, _, _ := strings.Cut(strings.TrimSpace(line), ":")
		switch {
		case line == "", strings.HasPrefix(line, "--=="), strings.HasPrefix(strings.TrimSpace(line), "- \"ssh-"), strings.HasPrefix(line, " "):
		case slices.Contains([]string{"#cloud-config", "hostname", "preserve_hostname", "ssh_authorized_keys", "instance-id", "local-hostname",
			"Content-Type", "MIME-Version", "Content-Disposition", "Merge-Type", "version", "ethernets"}, k):
		default:
			t.Errorf("unexpected line in the seed: %q", line)
		}
	}
}

func TestBuild_Bounds(t *testing.T) {
	t.Parallel()
	for name, mut := range map[string]func(*vps.Spec){
		"user data over 64 KiB": func(s *vps.Spec) { s.UserData = "#!/bin/sh\n" + strings.Repeat("x", vps.MaxUserDataBytes) },
		"bad ssh key":           func(s *vps.Spec) { s.SSHKeys = []string{"rm -rf /"} },
		"key with newline":      func(s *vps.Spec) { s.SSHKeys = []string{"ssh-ed25519 AAAA\nruncmd: [x]"} },
		"bad hostname":          func(s *vps.Spec) { s.Hostname = "web_1\nruncmd" },
	} {
		s := spec()
		mut(&s)
		if _, err := seed.Build(s); err == nil {
			t.Errorf("%s: built a seed", name)
		}
	}
}
