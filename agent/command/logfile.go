package command

import (
	"fmt"
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
