package ramdisk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// chunk is the unit of every write and read back.
const chunk = 1 << 20

var zeros = make([]byte, chunk)

// Eraser runs a drive's own secure erase on a block device. It must
// return once ctx ends (or the drive finishes: an ATA erase cannot be
// interrupted).
type Eraser interface {
	SecureErase(ctx context.Context, device string) error
}

// ToolEraser erases with the drive's tools: `nvme format --ses=1` for an
// NVMe namespace, ATA security erase through hdparm otherwise. Not run in
// tests (they have no drives).
type ToolEraser struct{}

// SecureErase implements [Eraser].
func (ToolEraser) SecureErase(ctx context.Context, device string) error {
	run := func(name string, args ...string) error {
		out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
		}
		return nil
	}
	if strings.HasPrefix(filepath.Base(device), "nvme") {
		return run("nvme", "format", device, "--ses=1", "--force")
	}
	const pass = "bc-wipe"
	if err := run("hdparm", "--user-master", "u", "--security-set-pass", pass, device); err != nil {
		return err
	}
	return run("hdparm", "--user-master", "u", "--security-erase", pass, device)
}

// WipeDisks runs disk.wipe: every disk is checked against the inventory
// first (a refusal names "payload.disks" and touches nothing), then wiped
// in order and read back. The result lists the disks wiped so far, also
// when it returns an error.
func (r *Ramdisk) WipeDisks(ctx context.Context, p *agentv1.DiskWipe) (*agentv1.DiskWipeResult, error) {
	disks := p.GetDisks()
	if len(disks) == 0 || len(disks) > commandkinds.MaxWipeDisks {
		return nil, fieldErr("payload.disks", "want 1 to %d disks, got %d", commandkinds.MaxWipeDisks, len(disks))
	}
	switch p.GetMethod() {
	case agentv1.WipeMethod_WIPE_METHOD_DISCARD, agentv1.WipeMethod_WIPE_METHOD_ZERO, agentv1.WipeMethod_WIPE_METHOD_SECURE_ERASE:
	default:
		return nil, fieldErr("payload.method", "want WIPE_METHOD_DISCARD, WIPE_METHOD_ZERO or WIPE_METHOD_SECURE_ERASE, got %s", p.GetMethod())
	}
	paths := make([]string, len(disks))
	for i, d := range disks {
		path, err := r.disk("payload.disks", d)
		if err != nil {
			return nil, err
		}
		if slices.Contains(paths[:i], path) {
			return nil, fieldErr("payload.disks", "disk %s named twice (%s)", d, path)
		}
		paths[i] = path
	}
	res := &agentv1.DiskWipeResult{}
	for i, path := range paths {
		w, err := r.wipe(ctx, path, p.GetMethod())
		if err != nil {
			return res, fmt.Errorf("wipe %s: %w", disks[i], err)
		}
		w.Path = disks[i]
		res.Disks = append(res.Disks, w)
		r.log.Info("disk wiped", "disk", disks[i], "method", w.GetMethod().String(), "bytes", w.GetBytes(), "verified", w.GetVerified())
	}
	return res, nil
}

// wipe wipes one disk with method (or the fallback it needs) and reads it
// back.
func (r *Ramdisk) wipe(ctx context.Context, path string, method agentv1.WipeMethod) (*agentv1.DiskWiped, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	block := fi.Mode()&os.ModeDevice != 0
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, err
	}
	out := &agentv1.DiskWiped{Bytes: uint64(size)}
	switch {
	case method == agentv1.WipeMethod_WIPE_METHOD_SECURE_ERASE && block:
		if r.cfg.Eraser == nil {
			return nil, errors.New("secure erase is not available on this ramdisk (no eraser)")
		}
		if err := r.cfg.Eraser.SecureErase(ctx, path); err != nil {
			return nil, err
		}
		dropCache(f)
		// A drive's erase need not read back as zeros (a crypto erase
		// reads as noise): a sample is checked and reported.
		ok, err := sampleZero(ctx, f, size)
		if err != nil {
			return nil, err
		}
		out.Method, out.Verified = method, ok
		return out, nil
	case method == agentv1.WipeMethod_WIPE_METHOD_DISCARD:
		if err := discard(f, size, block); err == nil {
			dropCache(f)
			ok, err := allZero(ctx, f, size)
			if err != nil {
				return nil, err
			}
			if ok {
				out.Method, out.Verified = method, true
				return out, nil
			}
			r.log.Warn("discarded blocks do not read back as zeros; overwriting with zeros", "disk", path)
		} else {
			r.log.Info("discard not supported; overwriting with zeros", "disk", path, "err", err)
		}
	}
	// ZERO, a SECURE_ERASE of a file-backed disk, a DISCARD that needs the
	// fallback.
	if err := writeZeros(ctx, f, size); err != nil {
		return nil, err
	}
	dropCache(f)
	ok, err := allZero(ctx, f, size)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, errors.New("zeros written, but a non-zero byte was read back")
	}
	out.Method, out.Verified = agentv1.WipeMethod_WIPE_METHOD_ZERO, true
	return out, nil
}

// writeZeros overwrites size bytes of f from offset 0 and syncs.
func writeZeros(ctx context.Context, f *os.File, size int64) error {
	for off := int64(0); off < size; off += chunk {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		n := min(chunk, size-off)
		if _, err := f.WriteAt(zeros[:n], off); err != nil {
			return err
		}
	}
	return f.Sync()
}

// allZero reads size bytes of f back and reports whether every one is 0.
func allZero(ctx context.Context, f *os.File, size int64) (bool, error) {
	buf := make([]byte, chunk)
	for off := int64(0); off < size; off += chunk {
		if err := ctx.Err(); err != nil {
			return false, context.Cause(ctx)
		}
		n := int(min(chunk, size-off))
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			return false, fmt.Errorf("read back at %d: %w", off, err)
		}
		if !bytes.Equal(buf[:n], zeros[:n]) {
			return false, nil
		}
	}
	return true, nil
}

// samples is how many chunks a sampled read covers.
const samples = 16

// sampleOffsets are the offsets of the chunks a sampled read covers:
// evenly spread, 4 KiB aligned, the first and the last included.
func sampleOffsets(size int64) []int64 {
	if size <= samples*chunk {
		var offs []int64
		for off := int64(0); off < size; off += chunk {
			offs = append(offs, off)
		}
		return offs
	}
	offs := make([]int64, 0, samples)
	for i := range int64(samples) {
		off := (size - chunk) * i / (samples - 1)
		offs = append(offs, off&^4095)
	}
	return offs
}

// sampleZero reads the sample chunks back and reports whether all are 0.
func sampleZero(ctx context.Context, f *os.File, size int64) (bool, error) {
	buf := make([]byte, chunk)
	for _, off := range sampleOffsets(size) {
		if err := ctx.Err(); err != nil {
			return false, context.Cause(ctx)
		}
		n := int(min(chunk, size-off))
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			return false, fmt.Errorf("read back at %d: %w", off, err)
		}
		if !bytes.Equal(buf[:n], zeros[:n]) {
			return false, nil
		}
	}
	return true, nil
}
