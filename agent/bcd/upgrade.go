package bcd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/agent/upgrade"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// TrialFDEnv names the file descriptor a build on trial writes "ok
// <version>\n" to once its session is open and it has reported (its first
// Observed): the daemon that started it reads the other end and checks the
// version is the manifest's (see runTrial).
const TrialFDEnv = "BCD_UPGRADE_TRIAL_FD"

// DefaultTrialTimeout is how long a new build has to open its session and
// report before it is stopped and rolled back.
const DefaultTrialTimeout = 30 * time.Second

// openInstaller reads the pinned release key (PEM PUBLIC KEY, Ed25519) and
// returns the installer under root; no key file, no installer (every
// release manifest is refused).
func openInstaller(root, keyFile string) (*upgrade.Installer, error) {
	if keyFile == "" {
		return nil, nil
	}
	b, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("release key: %w", err)
	}
	pub, err := agentrelease.ParsePublicKey(b)
	if err != nil {
		return nil, err
	}
	return upgrade.New(upgrade.Config{Root: root, Key: pub}), nil
}

// trialReporter returns what a build on trial calls after each report: the
// first writes "ok <version>\n" to the descriptor TrialFDEnv
// names and closes it. Outside a trial it is nil.
func trialReporter() func() {
	v := os.Getenv(TrialFDEnv)
	if v == "" {
		return nil
	}
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		return nil
	}
	syscall.CloseOnExec(fd)
	f := os.NewFile(uintptr(fd), "upgrade-trial")
	var once sync.Once
	return func() {
		once.Do(func() {
			_, _ = f.WriteString("ok " + version() + "\n")
			_ = f.Close()
		})
	}
}

// runTrial runs the staged build as a child, `node` with args, and waits
// for it to report through its trial pipe: nil once it has, else why not —
// it exited first, timeout passed, or ctx ended. The child is stopped
// either way (SIGTERM, then SIGKILL after 10 s): on success the daemon
// execs the build itself. The watchdog is this process, which the build on
// trial cannot take down with it.
func runTrial(ctx context.Context, st upgrade.Staged, args []string, timeout time.Duration, stderr io.Writer) error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer func() { _ = r.Close() }()
	cmd := exec.Command(st.Path, append([]string{"node"}, args...)...)
	cmd.Env = append(withoutEnv(os.Environ(), TrialFDEnv), TrialFDEnv+"=3")
	cmd.ExtraFiles = []*os.File{w}
	cmd.SysProcAttr = trialAttr()
	cmd.Stdout, cmd.Stderr = stderr, stderr
	err = cmd.Start()
	_ = w.Close()
	if err != nil {
		return fmt.Errorf("bcd %s did not start: %w", st.Manifest.Version, err)
	}
	reported := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(r, 256))
		reported <- string(b)
	}()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var result error
	done := false
	select {
	case line := <-reported:
		v, ok := strings.CutPrefix(line, "ok ")
		v = strings.TrimSuffix(v, "\n")
		switch {
		case ok && v != st.Manifest.Version:
			result = fmt.Errorf("the build of manifest %s reported version %q", st.Manifest.Version, v)
		case !ok:
			// The pipe closed without a report: the build exited (or
			// closed it); its exit status says more.
			select {
			case err := <-exited:
				done = true
				result = fmt.Errorf("bcd %s exited before opening its session and reporting: %s", st.Manifest.Version, exitText(err))
			case <-timer.C:
				result = fmt.Errorf("bcd %s closed its trial pipe without reporting", st.Manifest.Version)
			}
		}
	case err := <-exited:
		done = true
		result = fmt.Errorf("bcd %s exited before opening its session and reporting: %s", st.Manifest.Version, exitText(err))
	case <-timer.C:
		result = fmt.Errorf("bcd %s did not open its session and report within %s", st.Manifest.Version, timeout)
	case <-ctx.Done():
		result = ctx.Err()
	}
	if !done {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited: //nolint:errcheck // stopped on purpose: its exit status says nothing
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited //nolint:errcheck // killed on purpose: its exit status says nothing
		}
	}
	return result
}

func exitText(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

func withoutEnv(env []string, name string) []string {
	out := env[:0:0]
	for _, e := range env {
		if !strings.HasPrefix(e, name+"=") {
			out = append(out, e)
		}
	}
	return out
}

// execCurrent replaces this process with the build <root>/bin/current
// names, `node` with args, without the trial variable.
func execCurrent(inst *upgrade.Installer, args []string) error {
	path, err := filepath.Abs(inst.CurrentPath())
	if err != nil {
		return err
	}
	return syscall.Exec(path, append([]string{path, "node"}, args...), withoutEnv(os.Environ(), TrialFDEnv))
}

// runUpgrade is `bcd upgrade clear`: it clears the UpgradeFailed latch on
// this node (what nodes.clearUpgrade will send; not built yet), so the
// next release manifest is tried.
func runUpgrade(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "clear" {
		return usageError{errors.New("usage: bcd upgrade clear [--root DIR]")}
	}
	f := newFlags("upgrade clear", stderr)
	root := f.str("root", DefaultRoot, "state directory")
	if err := f.parse(args[1:]); err != nil {
		return err
	}
	store, err := state.Open(*root)
	if err != nil {
		return err
	}
	cleared, err := upgrade.New(upgrade.Config{Root: store.Root()}).Clear()
	if err != nil {
		return err
	}
	if cleared {
		fmt.Fprintln(stdout, "UpgradeFailed cleared: the next release manifest is tried")
	} else {
		fmt.Fprintln(stdout, "UpgradeFailed was not latched")
	}
	return nil
}
