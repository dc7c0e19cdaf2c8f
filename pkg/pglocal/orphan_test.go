package pglocal_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/pglocal"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// orphanDirEnv, when set, makes TestClusterDiesWithItsParent the child: it
// starts a cluster in that directory and exits without stopping it.
const orphanDirEnv = "PGLOCAL_ORPHAN_DIR"

func TestClusterDiesWithItsParent(t *testing.T) {
	if dir := os.Getenv(orphanDirEnv); dir != "" {
		s, err := pglocal.Resolve(t.Context(), clusterOptions(dir))
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(2)
		}
		fmt.Println("url:", s.URL)
		os.Exit(0) // no Stop, as if killed
	}
	t.Parallel()

	dir := dataDir(t)
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestClusterDiesWithItsParent$")
	cmd.Env = append(os.Environ(), orphanDirEnv+"="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	_, url, ok := strings.Cut(string(out), "url: ")
	if !ok {
		t.Fatalf("child printed no url:\n%s", out)
	}
	url, _, _ = strings.Cut(url, "\n")

	// The cluster must go away on its own; poll, with a deadline.
	poll.UntilNil(t, 30*time.Second, "postgres to go away with the process that started it", func() error {
		_, qerr := query(t, url, "SELECT 1::text")
		pid, alive := postmaster(dir)
		if qerr != nil && !alive {
			return nil
		}
		return fmt.Errorf("postgres (pid %d) is alive %v (query error: %v)", pid, alive, qerr)
	})
}

// postmaster reports the pid in dir's postmaster.pid and whether it runs.
func postmaster(dir string) (int, bool) {
	b, err := os.ReadFile(filepath.Join(dir, "postmaster.pid"))
	if err != nil {
		return 0, false // removed on shutdown
	}
	first, _, _ := bytes.Cut(b, []byte("\n"))
	pid, _ := strconv.Atoi(string(first))
	if pid <= 0 {
		return 0, false
	}
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return pid, false
	}
	// A zombie waiting for a reaper has exited too.
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return pid, false
	}
	_, rest, _ := bytes.Cut(stat, []byte(") "))
	return pid, !bytes.HasPrefix(rest, []byte("Z"))
}
