package ramdisk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// Kexecer loads a kernel and boots into it (node.kexec).
type Kexecer interface {
	// Load loads kernel (and initrd, when not empty) with cmdline for a
	// later Exec.
	Load(ctx context.Context, kernel, initrd, cmdline string) error
	// Exec boots the loaded kernel: on a real machine it does not return
	// when it works.
	Exec(ctx context.Context) error
}

// ToolKexec runs kexec-tools: `kexec -l` then `kexec -e`.
type ToolKexec struct {
	// Path is the kexec binary; empty means "kexec" on PATH.
	Path string
}

func (k ToolKexec) run(ctx context.Context, args ...string) error {
	bin := k.Path
	if bin == "" {
		bin = "kexec"
	}
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// Load implements [Kexecer].
func (k ToolKexec) Load(ctx context.Context, kernel, initrd, cmdline string) error {
	args := []string{"-l", kernel, "--command-line=" + cmdline}
	if initrd != "" {
		args = append(args, "--initrd="+initrd)
	}
	return k.run(ctx, args...)
}

// Exec implements [Kexecer].
func (k ToolKexec) Exec(ctx context.Context) error { return k.run(ctx, "-e") }

// LoadKexec runs the first half of node.kexec: it downloads the kernel and
// the initrd into WorkDir, checks their SHA-256 and loads them. Nothing is
// loaded when a download or a hash fails.
func (r *Ramdisk) LoadKexec(ctx context.Context, p *agentv1.NodeKexec) error {
	if r.cfg.Kexec == nil || r.cfg.WorkDir == "" {
		return errors.New("kexec is not available on this ramdisk")
	}
	if err := checkURL("payload.kernelUrl", p.GetKernelUrl()); err != nil {
		return err
	}
	if err := checkSHA256("payload.kernelSha256", p.GetKernelSha256()); err != nil {
		return err
	}
	if p.GetInitrdUrl() != "" {
		if err := checkURL("payload.initrdUrl", p.GetInitrdUrl()); err != nil {
			return err
		}
		if err := checkSHA256("payload.initrdSha256", p.GetInitrdSha256()); err != nil {
			return err
		}
	}
	if n := len([]rune(p.GetCmdline())); n > commandkinds.MaxKexecCmdline {
		return fieldErr("payload.cmdline", "at most %d characters, got %d", commandkinds.MaxKexecCmdline, n)
	}
	kernel := filepath.Join(r.cfg.WorkDir, "kexec-kernel")
	if err := r.fetch(ctx, "payload.kernelSha256", p.GetKernelUrl(), p.GetKernelSha256(), kernel, MaxKexecFile); err != nil {
		return err
	}
	var initrd string
	if p.GetInitrdUrl() != "" {
		initrd = filepath.Join(r.cfg.WorkDir, "kexec-initrd")
		if err := r.fetch(ctx, "payload.initrdSha256", p.GetInitrdUrl(), p.GetInitrdSha256(), initrd, MaxKexecFile); err != nil {
			return err
		}
	}
	if err := r.cfg.Kexec.Load(ctx, kernel, initrd, p.GetCmdline()); err != nil {
		return err
	}
	r.mu.Lock()
	r.loaded = true
	r.mu.Unlock()
	r.log.Warn("kexec kernel loaded", "kernel", p.GetKernelUrl(), "initrd", p.GetInitrdUrl(), "cmdline", p.GetCmdline())
	return nil
}

// ExecKexec boots the kernel LoadKexec loaded.
func (r *Ramdisk) ExecKexec(ctx context.Context) error {
	r.mu.Lock()
	loaded := r.loaded
	r.mu.Unlock()
	if !loaded {
		return errors.New("no kexec kernel is loaded")
	}
	r.log.Warn("kexec: booting the loaded kernel")
	return r.cfg.Kexec.Exec(ctx)
}
