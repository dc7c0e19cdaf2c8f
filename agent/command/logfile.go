package command

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
)

// DefaultLogFileBytes is the size at which LogFile rotates: the daemon
// keeps at most twice this on disk (the log and log.1).
const DefaultLogFileBytes = 4 << 20

// LogPath is where the daemon writes its own log under root.
func LogPath(root string) string { return filepath.Join(root, "logs", "agent.log") }

// LogFile is a size-bounded log file: when a write would take it past its
// limit, it is renamed to <path>.1 (replacing the previous one) and a new
// file is started. bcd node and the simulator write their log to it besides
// stderr, and logs.collect reads it.
type LogFile struct {
	path string
	max  int64

	mu   sync.Mutex
	f    *os.File
	size int64
}

// OpenLog opens (appending) or creates the log at path, creating its
// directory; maxBytes 0 means DefaultLogFileBytes.
func OpenLog(path string, maxBytes int64) (*LogFile, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultLogFileBytes
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("command: log: %w", err)
	}
	l := &LogFile{path: path, max: maxBytes}
	if err := l.open(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *LogFile) open() error {
	f, err := os.OpenFile(l.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("command: log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("command: log: %w", err)
	}
	l.f, l.size = f, st.Size()
	return nil
}

// Write appends p, rotating first when p would not fit.
func (l *LogFile) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return 0, os.ErrClosed
	}
	if l.size > 0 && l.size+int64(len(p)) > l.max {
		_ = l.f.Close()
		l.f = nil
		if err := os.Rename(l.path, l.path+".1"); err != nil {
			// Stay bounded: start the log over rather than grow it.
			_ = os.Truncate(l.path, 0)
		}
		if err := l.open(); err != nil {
			return 0, err
		}
	}
	n, err := l.f.Write(p)
	l.size += int64(n)
	return n, err
}

// Close closes the file; later writes fail.
func (l *LogFile) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// tailLogs returns the last limit bytes of the files at paths read as one
// stream (oldest first), starting at a whole line when it had to cut, and
// whether it cut. limit is one budget for all of them: the files are taken
// newest first, each read from its end through a reader bounded by what is
// left of the budget, so however many paths there are, it reads and holds at
// most limit bytes. A missing file is empty.
func tailLogs(paths []string, limit int) ([]byte, bool, error) {
	type piece struct {
		f   *os.File
		off int64
		n   int64
	}
	var pieces []piece // newest first
	defer func() {
		for _, p := range pieces {
			_ = p.f.Close()
		}
	}()
	left, total, cut := int64(limit), int64(0), false
	for i := len(paths) - 1; i >= 0; i-- {
		f, err := os.Open(paths[i])
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, false, fmt.Errorf("read log: %w", err)
		}
		st, err := f.Stat()
		if err != nil {
			_ = f.Close()
			return nil, false, fmt.Errorf("read log: %w", err)
		}
		size := st.Size()
		if size > left {
			cut = true
		}
		n := min(size, left)
		if n == 0 {
			_ = f.Close()
			continue
		}
		pieces = append(pieces, piece{f: f, off: size - n, n: n})
		left -= n
		total += n
	}
	buf := make([]byte, 0, total)
	for i := len(pieces) - 1; i >= 0; i-- {
		p := pieces[i]
		// A file that shrank since Stat (rotated) gives what it still has.
		n, err := io.ReadFull(io.NewSectionReader(p.f, p.off, p.n), buf[len(buf):len(buf)+int(p.n)])
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
			return nil, false, fmt.Errorf("read log: %w", err)
		}
		buf = buf[:len(buf)+n]
	}
	if cut {
		// Start at a whole line when one begins within the tail.
		if i := bytes.IndexByte(buf, '\n'); i >= 0 && i+1 < len(buf) {
			buf = buf[i+1:]
		}
	}
	return buf, cut, nil
}
