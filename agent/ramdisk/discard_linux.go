package ramdisk

import (
	"os"
	"syscall"
	"unsafe"
)

const (
	// fallocFlPunchHole|fallocFlKeepSize: deallocate a range of a file,
	// which then reads as zeros, without changing its size.
	fallocFlKeepSize  = 0x01
	fallocFlPunchHole = 0x02
	// blkDiscard is BLKDISCARD, _IO(0x12, 119): discard a byte range of a
	// block device.
	blkDiscard = 0x1277
	// blkFlsBuf is BLKFLSBUF, _IO(0x12, 97): drop a block device's
	// buffer cache, so a read back reaches the drive.
	blkFlsBuf = 0x1261
)

// discard deallocates size bytes of f from offset 0: BLKDISCARD on a block
// device, a punched hole in a file.
func discard(f *os.File, size int64, block bool) error {
	if size == 0 {
		return nil
	}
	if block {
		rng := [2]uint64{0, uint64(size)}
		if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), blkDiscard, uintptr(unsafe.Pointer(&rng))); errno != 0 {
			return errno
		}
		return nil
	}
	if err := syscall.Fallocate(int(f.Fd()), fallocFlPunchHole|fallocFlKeepSize, 0, size); err != nil {
		return err
	}
	return f.Sync()
}

// dropCache drops a block device's buffer cache (best effort); a file's
// page cache is its content, so there is nothing to drop.
func dropCache(f *os.File) {
	if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeDevice != 0 {
		_, _, _ = syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), blkFlsBuf, 0)
	}
}
