// Package kernelargs is the kernel command line contract of a machine's
// commissioning boot: the arguments the site's boot server (agent/site/pxe)
// adds to every ramdisk boot and `bcd ramdisk` reads from /proc/cmdline,
// and how a command line splits into them. It imports nothing of either
// side, so the node daemon links no boot server and the boot server no
// daemon.
package kernelargs

import "strings"

// The arguments, each written as name=value.
const (
	// Gateway is the control-plane gateway address (host:port).
	Gateway = "bc.gateway"
	// BootToken is the machine's one-time boot token.
	BootToken = "bc.boot_token"
	// BootMAC is the MAC the machine booted from.
	BootMAC = "bc.boot_mac"
)

// Parse splits a kernel command line into its name=value arguments; a bare
// word maps to "", a later argument wins.
func Parse(cmdline string) map[string]string {
	out := map[string]string{}
	for _, w := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(w, "=")
		out[k] = v
	}
	return out
}
