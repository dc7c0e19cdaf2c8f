package pxe

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
)

// bootFiles serves the iPXE binaries (TFTP and UEFI HTTP boot) from one
// directory, read-only: only the configured names, only regular files,
// nothing outside the directory (os.Root refuses .. and symlinks out).
type bootFiles struct {
	dir     string
	allowed map[string]bool
	log     *slog.Logger
}

// maxFileName bounds a requested file name.
const maxFileName = 255

// open returns the named boot file; name may carry one leading slash.
func (b *bootFiles) open(name string) (*os.File, os.FileInfo, error) {
	if len(name) > maxFileName {
		return nil, nil, fmt.Errorf("file name: %d bytes, at most %d", len(name), maxFileName)
	}
	clean := strings.TrimPrefix(name, "/")
	if !b.allowed[clean] {
		return nil, nil, fmt.Errorf("%q: not served", name)
	}
	f, err := os.OpenInRoot(b.dir, clean)
	if err != nil {
		return nil, nil, fmt.Errorf("%q: %w", clean, err)
	}
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, nil, fmt.Errorf("%q: not a regular file", clean)
	}
	return f, fi, nil
}

// tftpRead is the TFTP read handler.
func (b *bootFiles) tftpRead(name string, rf io.ReaderFrom) error {
	f, fi, err := b.open(name)
	if err != nil {
		b.log.Warn("tftp: refused", "file", name, "reason", err)
		return err
	}
	defer f.Close()
	if ot, ok := rf.(interface{ SetSize(int64) }); ok {
		ot.SetSize(fi.Size())
	}
	n, err := rf.ReadFrom(f)
	if err != nil {
		b.log.Warn("tftp: transfer failed", "file", name, "sent", n, "error", err)
		return err
	}
	b.log.Info("tftp: sent", "file", name, "bytes", n)
	return nil
}
