//go:build !linux

package ramdisk

import (
	"errors"
	"os"
)

// discard is Linux-only: elsewhere disk.wipe falls back to zeros.
func discard(*os.File, int64, bool) error { return errors.New("discard is supported on Linux only") }

func dropCache(*os.File) {}
