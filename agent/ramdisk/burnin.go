package ramdisk

import (
	"context"
	"fmt"
	"io"
	"os"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// maxReason bounds a DiskCheck's reason, in bytes.
const maxReason = 1024

// CheckDisks is the burn-in check of every disk of the inventory (added to
// diag.nvml's result by the executor): each is opened read-only, sized and
// read in up to 16 chunks of 1 MiB spread over it. A disk that cannot be
// opened, is empty or fails a read is unhealthy, with the reason; only
// ctx ending is an error.
func (r *Ramdisk) CheckDisks(ctx context.Context) ([]*agentv1.DiskCheck, error) {
	out := make([]*agentv1.DiskCheck, 0, len(r.cfg.Disks))
	for _, d := range r.cfg.Disks {
		if err := ctx.Err(); err != nil {
			return out, context.Cause(ctx)
		}
		c := &agentv1.DiskCheck{Path: d}
		if err := checkDisk(ctx, d, c); err != nil {
			if ctx.Err() != nil {
				return out, context.Cause(ctx)
			}
			c.Reason = err.Error()
			if len(c.Reason) > maxReason {
				c.Reason = c.Reason[:maxReason]
			}
		} else {
			c.Healthy = true
		}
		out = append(out, c)
	}
	return out, nil
}

func checkDisk(ctx context.Context, path string, c *agentv1.DiskCheck) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	c.SizeBytes = uint64(size)
	if size == 0 {
		return fmt.Errorf("the disk reports 0 bytes")
	}
	buf := make([]byte, chunk)
	for _, off := range sampleOffsets(size) {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := int(min(chunk, size-off))
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			return fmt.Errorf("read at %d: %w", off, err)
		}
		c.SampledBytes += uint64(n)
	}
	return nil
}
