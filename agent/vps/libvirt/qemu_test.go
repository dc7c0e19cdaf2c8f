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

// guestInit is the whole guest: PID 1 of an initramfs. It loads the CD-ROM
// drivers it was given, prints a marker on the serial console with the
// seed cdrom's volume label if it can read it, and powers off.
const guestInit = `package main

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

func main() {
	_ = os.MkdirAll("/dev", 0o755)
	_ = syscall.Mount("devtmpfs", "/dev", "devtmpfs", 0, "")
	// The CD-ROM's drivers, when the test put them here (NN-name.ko, in
	// load order): the distribution kernel builds them as modules.
	entries, _ := os.ReadDir("/")
	var mods []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".ko") {
			mods = append(mods, e.Name())
		}
	}
	sort.Strings(mods)
	empty := []byte{0}
	for _, m := range mods {
		f, err := os.Open("/" + m)
		if err != nil {
			continue
		}
		const sysFinitModule = 313 // amd64
		_, _, errno := syscall.Syscall(sysFinitModule, f.Fd(), uintptr(unsafe.Pointer(&empty[0])), 0)
		if errno != 0 && errno != syscall.EEXIST {
			fmt.Println("BC-VPS-MODULE", m, errno.Error())
		}
		f.Close()
	}
	seen := "no-seed-device"
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline) && seen == "no-seed-device"; time.Sleep(100 * time.Millisecond) {
		for _, dev := range []string{"/dev/sr0", "/dev/vdb"} {
			f, err := os.Open(dev)
			if err != nil {
				continue
			}
			b := make([]byte, 32)
			// The primary volume descriptor is at 32 KiB; its volume id at +40.
			if _, err := f.ReadAt(b, 32768+40); err == nil {
				seen = "seed-label=" + string(trim(b))
			}
			f.Close()
			break
		}
		if len(mods) == 0 {
			break
		}
	}
	fmt.Println("BC-VPS-BOOTED", seen)
	syscall.Sync()
	_ = syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF)
}

func trim(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == 0) {
		b = b[:len(b)-1]
	}
	return b
}
`

// cdromModules are the modules, in load order, a distribution kernel needs
// to read an IDE cdrom on q35 (AHCI): when the kernel's module tree is on
// this machine, the guest loads them and the test requires it to read the
// seed's volume label.
var cdromModules = []string{
	"drivers/scsi/scsi_common.ko", "drivers/scsi/scsi_mod.ko", "drivers/ata/libata.ko", "drivers/ata/libahci.ko",
	"drivers/ata/ahci.ko", "drivers/cdrom/cdrom.ko", "drivers/scsi/sr_mod.ko",
}

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
	files := map[string][]byte{"init": initBin}
	// The module tree of the kernel booted: /lib/modules/<version> for
	// /boot/vmlinuz-<version>.
	modDir := filepath.Join("/lib/modules", strings.TrimPrefix(filepath.Base(kernel), "vmlinuz-"))
	withModules := true
	for i, m := range cdromModules {
		b, err := os.ReadFile(filepath.Join(modDir, "kernel", m))
		if err != nil {
			withModules = false
			break
		}
		files[fmt.Sprintf("%02d-%s", i, filepath.Base(m))] = b
	}
	if !withModules {
		for name := range files {
			if name != "init" {
				delete(files, name)
			}
		}
	}
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := os.WriteFile(initrd, cpio(files), 0o644); err != nil {
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
	switch {
	case withModules && !strings.Contains(line, "seed-label="+seed.Label):
		t.Errorf("the guest loaded the cdrom drivers but did not read the seed labelled %q: %s\n%s", seed.Label, line, tail(out.String(), 4000))
	case !withModules && strings.Contains(line, "seed-label=") && !strings.Contains(line, "seed-label="+seed.Label):
		t.Errorf("the guest read the cdrom but its label is not %q: %s", seed.Label, line)
	case !withModules:
		t.Logf("no module tree at %s: the guest booted, but reading the seed is not checked", modDir)
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
