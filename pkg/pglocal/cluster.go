package pglocal

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The private cluster runs postgres as a child process rather than through
// `pg_ctl start`: pg_ctl detaches the postmaster (setsid), so a test binary or
// dev process that dies without calling Stop would leave it running forever.
// As a child it gets SIGQUIT (immediate shutdown) when its parent dies.

const (
	superuser = "postgres"
	logName   = "pglocal.log"
	confMark  = "# Added by pglocal."
)

// owner is the account a private cluster runs as: the postgres user when we
// are root (postgres refuses to run as root), else ourselves (nil cred).
type owner struct {
	uid, gid int
	cred     *syscall.Credential
}

func clusterOwner() (owner, error) {
	if os.Geteuid() != 0 {
		return owner{uid: os.Geteuid(), gid: os.Getegid()}, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return owner{}, fmt.Errorf("running as root, and postgres refuses root: need a postgres user: %w", err)
	}
	uid, err1 := strconv.Atoi(u.Uid)
	gid, err2 := strconv.Atoi(u.Gid)
	if err1 != nil || err2 != nil {
		return owner{}, fmt.Errorf("postgres user has uid %q gid %q", u.Uid, u.Gid)
	}
	return owner{uid: uid, gid: gid, cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}, nil
}

// sysProcAttr runs a cluster command as o, in its own process group (so a
// terminal's ^C reaches us, not postgres, and we stop it in order), and sends
// it sig when we die (0: nothing).
func (o owner) sysProcAttr(sig syscall.Signal) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: o.cred, Setpgid: true, Pdeathsig: sig}
}

// findBinDir returns the directory holding initdb and postgres.
func findBinDir(want string) (string, error) {
	has := func(dir string) bool {
		for _, b := range []string{"initdb", "postgres"} {
			if fi, err := os.Stat(filepath.Join(dir, b)); err != nil || fi.IsDir() {
				return false
			}
		}
		return true
	}
	if want != "" {
		if !has(want) {
			return "", fmt.Errorf("no initdb and postgres in %s", want)
		}
		return want, nil
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		// /usr/local/bin/initdb is often a link into the real bin directory,
		// where postgres lives too.
		if target, err := filepath.EvalSymlinks(p); err == nil && has(filepath.Dir(target)) {
			return filepath.Dir(target), nil
		}
		if has(filepath.Dir(p)) {
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	// Newest major version first.
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(a)), 64)
		vb, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(b)), 64)
		switch {
		case va > vb:
			return -1
		case va < vb:
			return 1
		}
		return 0
	})
	for _, d := range dirs {
		if has(d) {
			return d, nil
		}
	}
	return "", errors.New("initdb not found on PATH or in /usr/lib/postgresql/*/bin")
}

// startCluster starts (initialising it first if needed) a private cluster in
// opts.DataDir, or adopts one already running there.
func startCluster(ctx context.Context, opts Options) (*Server, error) {
	bin, err := findBinDir(opts.BinDir)
	if err != nil {
		return nil, err
	}
	own, err := clusterOwner()
	if err != nil {
		return nil, err
	}

	dataDir, tmpRoot := opts.DataDir, ""
	if dataDir == "" {
		tmpRoot, err = os.MkdirTemp("", "pglocal-")
		if err != nil {
			return nil, err
		}
		// MkdirTemp makes it 0700, which the postgres user cannot enter.
		if err := os.Chmod(tmpRoot, 0o755); err != nil {
			_ = os.RemoveAll(tmpRoot)
			return nil, err
		}
		dataDir = filepath.Join(tmpRoot, "data")
	}
	cleanup := func() {
		if tmpRoot != "" {
			_ = os.RemoveAll(tmpRoot)
		}
	}
	if dataDir, err = filepath.Abs(dataDir); err != nil {
		cleanup()
		return nil, err
	}

	s, err := runCluster(ctx, opts, bin, own, dataDir)
	if err != nil {
		cleanup()
		return nil, err
	}
	if s.stop != nil && tmpRoot != "" {
		stop := s.stop
		s.stop = func() error {
			err := stop()
			return errors.Join(err, os.RemoveAll(tmpRoot))
		}
	}
	return s, nil
}

func runCluster(ctx context.Context, opts Options, bin string, own owner, dataDir string) (*Server, error) {
	if err := prepareDataDir(dataDir, own); err != nil {
		return nil, err
	}
	fresh := !fileExists(filepath.Join(dataDir, "PG_VERSION"))
	if fresh {
		if err := initdb(ctx, opts, bin, own, dataDir); err != nil {
			return nil, err
		}
	} else if s, err := adoptRunning(ctx, opts, dataDir); s != nil || err != nil {
		return s, err
	}

	port, explicit := opts.Port, opts.Port != 0
	if !explicit {
		if p := recordedPort(dataDir); p != 0 && portFree(p) {
			port = p
		}
	}
	var lastErr error
	for range 3 {
		if port == 0 {
			var err error
			if port, err = freePort(); err != nil {
				return nil, err
			}
		}
		s, err := startPostgres(ctx, opts, bin, own, dataDir, port)
		if err == nil {
			if fresh {
				if err := recordPort(dataDir, port); err != nil {
					_ = s.Stop()
					return nil, err
				}
			}
			return s, nil
		}
		lastErr = err
		if explicit || !errors.Is(err, errPortTaken) {
			break
		}
		port = 0 // someone took it between our check and postgres's bind
	}
	return nil, lastErr
}

// prepareDataDir makes dataDir exist, owned by own and mode 0700, with every
// parent directory searchable by own.
func prepareDataDir(dataDir string, own owner) error {
	parent := filepath.Dir(dataDir)
	// Parents we create are made 0755 whatever the umask.
	var created []string
	for d := parent; !fileExists(d); d = filepath.Dir(d) {
		created = append(created, d)
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	for _, d := range created {
		if err := os.Chmod(d, 0o755); err != nil {
			return err
		}
	}
	if own.cred != nil {
		for d := parent; ; d = filepath.Dir(d) {
			if !searchable(d, own) {
				return fmt.Errorf("the postgres user (uid %d) cannot enter %s, a parent of the data directory %s: make it searchable (chmod o+x) or use another directory", own.uid, d, dataDir)
			}
			if d == filepath.Dir(d) {
				break
			}
		}
	}

	fi, err := os.Stat(dataDir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.Mkdir(dataDir, 0o700); err != nil {
			return err
		}
		if own.cred != nil {
			if err := os.Chown(dataDir, own.uid, own.gid); err != nil {
				return err
			}
		}
		return nil
	case err != nil:
		return err
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory", dataDir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && own.cred != nil && int(st.Uid) != own.uid {
		// Root made or copied it; hand the whole tree to postgres.
		err := filepath.WalkDir(dataDir, func(p string, _ fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			return os.Lchown(p, own.uid, own.gid)
		})
		if err != nil {
			return fmt.Errorf("chown %s to postgres: %w", dataDir, err)
		}
	}
	// postgres refuses a data directory others can read.
	if fi.Mode().Perm()&0o077 != 0 && fi.Mode().Perm() != 0o750 {
		return os.Chmod(dataDir, 0o700)
	}
	return nil
}

// searchable reports whether own may enter directory d.
func searchable(d string, own owner) bool {
	fi, err := os.Stat(d)
	if err != nil {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return true
	}
	perm := fi.Mode().Perm()
	switch {
	case int(st.Uid) == own.uid:
		return perm&0o100 != 0
	case int(st.Gid) == own.gid:
		return perm&0o010 != 0
	}
	return perm&0o001 != 0
}

func initdb(ctx context.Context, opts Options, bin string, own owner, dataDir string) error {
	args := []string{
		"-D", dataDir,
		"-U", superuser,
		"--auth=trust",
		"--encoding=UTF8",
		"--locale=C",
	}
	if opts.Fast {
		args = append(args, "--no-sync")
	}
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), args...)
	cmd.Dir = "/" // our working directory may be closed to the postgres user
	cmd.SysProcAttr = own.sysProcAttr(syscall.SIGKILL)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("initdb %s: %w: %s", dataDir, err, lastLines(out, 10))
	}
	opts.Logger.InfoContext(ctx, "initialised postgres cluster", "dir", dataDir)
	return nil
}

var portLine = regexp.MustCompile(`(?m)^\s*port\s*=\s*(\d+)`)

// recordPort notes port in the cluster's postgresql.conf, together with the
// listen settings, so that a restarted dev cluster keeps its URL.
func recordPort(dataDir string, port int) error {
	f, err := os.OpenFile(filepath.Join(dataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(f, "\n%s\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\nport = %d\n", confMark, port)
	return errors.Join(err, f.Close())
}

// recordedPort returns the last port set in the cluster's postgresql.conf,
// or 0.
func recordedPort(dataDir string) int {
	b, err := os.ReadFile(filepath.Join(dataDir, "postgresql.conf"))
	if err != nil {
		return 0
	}
	m := portLine.FindAllSubmatch(b, -1)
	if len(m) == 0 {
		return 0
	}
	p, _ := strconv.Atoi(string(m[len(m)-1][1]))
	return p
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func portFree(p int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// adoptRunning handles a postmaster.pid left in dataDir. A file whose process
// is gone, or is no postgres (its pid reused, say after a container restart),
// is stale and removed. A live postmaster is adopted when it answers: the
// returned server's Stop leaves it running, since someone else started it.
// (nil, nil) means no postmaster runs there.
func adoptRunning(ctx context.Context, opts Options, dataDir string) (*Server, error) {
	pidFile := filepath.Join(dataDir, "postmaster.pid")
	b, err := os.ReadFile(pidFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	lines := strings.Split(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(lines[0]))
	if pid <= 0 || !isPostgres(pid) {
		if err := os.Remove(pidFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove stale %s: %w", pidFile, err)
		}
		opts.Logger.InfoContext(ctx, "removed stale postmaster.pid", "dir", dataDir, "pid", pid)
		return nil, nil
	}
	// Lines: pid, data dir, start time, port, socket dir, listen address, ...
	var port int
	if len(lines) > 3 {
		port, _ = strconv.Atoi(strings.TrimSpace(lines[3]))
	}
	u := clusterURL(port)
	if port == 0 {
		return nil, fmt.Errorf("postgres (pid %d) is running on %s but its postmaster.pid names no port", pid, dataDir)
	}
	if err := probe(ctx, u, opts.ProbeTimeout); err != nil {
		return nil, fmt.Errorf("postgres (pid %d) is running on %s but does not answer on port %d: %w", pid, dataDir, port, err)
	}
	opts.Logger.InfoContext(ctx, "using running postgres cluster", "dir", dataDir, "pid", pid, "port", port)
	return &Server{URL: u, Source: SourceCluster, DataDir: dataDir}, nil
}

// isPostgres reports whether pid is a live postgres process.
func isPostgres(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		// No /proc: trust that a live pid is the postmaster, as postgres does.
		return !errors.Is(err, fs.ErrNotExist)
	}
	argv0, _, _ := bytes.Cut(cmdline, []byte{0})
	base := filepath.Base(string(argv0))
	return strings.Contains(base, "postgres") || strings.Contains(base, "postmaster")
}

func clusterURL(port int) string {
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", superuser, port)
}

var errPortTaken = errors.New("port taken")

// startPostgres runs postgres on dataDir and waits until it accepts
// connections.
func startPostgres(ctx context.Context, opts Options, bin string, own owner, dataDir string, port int) (*Server, error) {
	logPath := filepath.Join(dataDir, logName)
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logFile.Close() // the child keeps its own descriptor
	if own.cred != nil {
		_ = logFile.Chown(own.uid, own.gid)
	}
	logStart, _ := logFile.Seek(0, 2)

	args := []string{
		"-D", dataDir,
		"-p", strconv.Itoa(port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=",
		"-c", "max_connections=200",
	}
	if opts.Fast {
		args = append(args, "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	}
	// Not CommandContext: the server outlives ctx, which only bounds starting.
	cmd := exec.Command(filepath.Join(bin, "postgres"), args...)
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = own.sysProcAttr(syscall.SIGQUIT)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()

	u := clusterURL(port)
	stop := func() error { return stopPostgres(cmd, exited) }
	ready := func() error {
		ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
		defer cancel()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			err := probe(ctx, u, opts.ProbeTimeout)
			if err == nil {
				return nil
			}
			select {
			case <-exited:
				log := readFrom(logPath, logStart)
				if strings.Contains(log, "could not bind") || strings.Contains(log, "already in use") {
					return fmt.Errorf("%w: postgres on port %d: %s", errPortTaken, port, lastLines([]byte(log), 5))
				}
				return fmt.Errorf("postgres exited (%s): %s", cmd.ProcessState, lastLines([]byte(log), 10))
			case <-ctx.Done():
				return fmt.Errorf("postgres not ready on port %d: %w (log: %s)", port, err, logPath)
			case <-tick.C:
			}
		}
	}
	if err := ready(); err != nil {
		_ = stop()
		return nil, err
	}
	opts.Logger.InfoContext(ctx, "started postgres cluster", "dir", dataDir, "port", port, "pid", cmd.Process.Pid)
	return &Server{
		URL:     u,
		Source:  SourceCluster,
		DataDir: dataDir,
		stop: func() error {
			err := stop()
			opts.Logger.Info("stopped postgres cluster", "dir", dataDir, "port", port)
			return err
		},
	}, nil
}

// stopPostgres asks for a fast shutdown (SIGINT: abort transactions,
// checkpoint, exit), then an immediate one, then kills.
func stopPostgres(cmd *exec.Cmd, exited <-chan struct{}) error {
	for _, step := range []struct {
		sig  syscall.Signal
		wait time.Duration
	}{
		{syscall.SIGINT, 60 * time.Second},
		{syscall.SIGQUIT, 10 * time.Second},
		{syscall.SIGKILL, 10 * time.Second},
	} {
		if err := cmd.Process.Signal(step.sig); err != nil {
			if errors.Is(err, os.ErrProcessDone) {
				<-exited
				return nil
			}
			return fmt.Errorf("signal postgres: %w", err)
		}
		select {
		case <-exited:
			return nil
		case <-time.After(step.wait):
		}
	}
	return fmt.Errorf("postgres (pid %d) did not exit", cmd.Process.Pid)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func readFrom(path string, off int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(off, 0); err != nil {
		return ""
	}
	var b strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		b.WriteString(sc.Text())
		b.WriteByte('\n')
	}
	return b.String()
}

// lastLines returns the last n non-empty lines of out, joined by " | ".
func lastLines(out []byte, n int) string {
	var lines []string
	for l := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
