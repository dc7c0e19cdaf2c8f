package libvirt_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/seed"
)

// guestInit is the whole guest: PID 1 of an initramfs. It prints a marker
// on the serial console, reports whether it can read the seed cdrom's
// label, and powers off.
const guestInit = `package main

import (
	"fmt"
	"os"
	"syscall"
)

func main() {
	_ = os.MkdirAll("/dev", 0o755)
	_ = syscall.Mount("devtmpfs", "/dev", "devtmpfs", 0, "")
	seen := "no-seed-device"
	for _, dev := range []string{"/dev/sr0", "/dev/vdb", "/dev/sda"} {
		f, err := os.Open(dev)
		if err != nil {
			continue
		}
		b := make([]byte, 32)
		// The primary volume descriptor is at 32 KiB; its volume id at +40.
		if _, err := f.ReadAt(b, 32768+40); err == nil {
			seen = "seed-label=" + string(bytes(b))
		}
		f.Close()
		break
	}
	fmt.Println("BC-VPS-BOOTED", seen)
	syscall.Sync()
	_ = syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF)
}

func bytes(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == 0) {
		b = b[:len(b)-1]
	}
	return b
}
`

// TestQEMU_TCGBootsWithTheSeedAttached boots the tiniest guest this
// machine can make from local files — the host's kernel and an initramfs
// of one static Go program — under QEMU's software emulation, with the
// instance's NoCloud seed as a cdrom, and waits for the guest's serial
// marker. Nothing is downloaded.
func TestQEMU_TCGBootsWithTheSeedAttached(t *testing.T) {
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("qemu-system-x86_64 not installed")
	}
	kernel := os.Getenv("BC_TEST_KERNEL")
	if kernel == "" {
		matches, _ := filepath.Glob("/boot/vmlinuz*")
		if len(matches) == 0 {
			t.Skip("no kernel to boot: set BC_TEST_KERNEL or install one under /boot")
		}
		kernel = matches[len(matches)-1]
	}
	if _, err := os.ReadFile(kernel); err != nil {
		t.Skipf("kernel %s is not readable: %v", kernel, err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(guestInit), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module guestinit\n\ngo 1.22\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", "build", "-o", "init", ".")
	build.Dir = dir
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64", "GOWORK=off", "GOFLAGS=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the guest init: %v\n%s", err, out)
	}
	initBin, err := os.ReadFile(filepath.Join(dir, "init"))
	if err != nil {
		t.Fatal(err)
	}
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := os.WriteFile(initrd, cpio(map[string][]byte{"init": initBin}), 0o644); err != nil {
		t.Fatal(err)
	}
	iso, err := seed.Build(vps.Spec{ID: "inst_boot1", Hostname: "boot1", SSHKeys: []string{"ssh-ed25519 AAAAboot t@h"}})
	if err != nil {
		t.Fatal(err)
	}
	seedPath := filepath.Join(dir, "seed.iso")
	if err := os.WriteFile(seedPath, iso, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, qemu, "-machine", "q35,accel=tcg", "-m", "256", "-nographic", "-no-reboot",
		"-kernel", kernel, "-initrd", initrd, "-append", "console=ttyS0 panic=-1 quiet",
		"-drive", "file="+seedPath+",media=cdrom,readonly=on,if=ide")
	cmd.Stdout, cmd.Stderr = &out, &out
	_ = cmd.Run()
	line := ""
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.Contains(l, "BC-VPS-BOOTED") {
			line = strings.TrimSpace(l)
		}
	}
	if line == "" {
		t.Fatalf("no serial marker from the guest:\n%s", tail(out.String(), 4000))
	}
	t.Logf("guest said: %s", line)
	if strings.Contains(line, "seed-label=") && !strings.Contains(line, "seed-label="+seed.Label) {
		t.Errorf("the guest read the cdrom but its label is not %q: %s", seed.Label, line)
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// cpio writes a newc archive of regular files (mode 0755) at the root.
func cpio(files map[string][]byte) []byte {
	var b bytes.Buffer
	ino := 1
	entry := func(name string, mode uint32, data []byte) {
		fmt.Fprintf(&b, "070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
			ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
		ino++
		b.WriteString(name)
		b.WriteByte(0)
		for b.Len()%4 != 0 {
			b.WriteByte(0)
		}
		b.Write(data)
		for b.Len()%4 != 0 {
			b.WriteByte(0)
		}
	}
	for name, data := range files {
		entry(name, 0o100755, data)
	}
	entry("TRAILER!!!", 0, nil)
	return b.Bytes()
}
