package kernelargs_test

import (
	"maps"
	"testing"

	"github.com/bettercompute/bettercompute/agent/kernelargs"
)

func TestParse(t *testing.T) {
	t.Parallel()
	got := kernelargs.Parse("BOOT_IMAGE=/vmlinuz quiet bc.gateway=gw:7443 bc.boot_token=bcjt_a.b bc.gateway=gw:8443\n")
	want := map[string]string{"BOOT_IMAGE": "/vmlinuz", "quiet": "", kernelargs.Gateway: "gw:8443", kernelargs.BootToken: "bcjt_a.b"}
	if !maps.Equal(got, want) {
		t.Fatalf("Parse = %v, want %v", got, want)
	}
}
