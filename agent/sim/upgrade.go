package sim

import (
	"fmt"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/upgrade"
)

// Simulated agent upgrades (Config.ReleaseKey).
//
// What is real: every daemon has bcd's release installer (agent/upgrade)
// under its own state directory, pinning Config.ReleaseKey, so its agent
// section admits a release manifest exactly as bcd does (the signature,
// the expiry, the platform, the counter against the highest installed,
// the UpgradeFailed latch), downloads the build it names, checks its size
// and SHA-256 and stages it A/B; agent.upgrade and nodes.clearUpgrade work
// on it as on bcd.
//
// What is SIMULATED: the handover. A simulated node is a goroutine of this
// process, not a process of its own, so it cannot run the staged build as
// a child on trial nor exec it. Instead the daemon stops its session, and
// the simulated trial "passes": the installer activates the staged slot
// (records its counter, swaps bin/current) and the daemon starts again,
// with the same boot id as an exec keeps, reporting the manifest's version
// in its Hello — what the new build would report. The staged build never
// runs. With Config.FailUpgrade saying so, the trial "fails" instead: the
// installer rolls back and latches UpgradeFailed, and the daemon starts
// again with its old version, as bcd's rollback does. A daemon started
// later reports the version its installer last activated (a service
// running <root>/bin/current).

// agent wires daemon i's agent section and agent.upgrade: nothing without
// a release key. f.mu is held.
func (f *Fleet) agent(i int) converge.Agent {
	d := f.ds[i]
	if d.installer == nil {
		return converge.Agent{}
	}
	return converge.Agent{Installer: d.installer, Handover: func(st upgrade.Staged) {
		// The handover must not block the converging goroutine: it
		// restarts this daemon.
		f.bgMu.Lock()
		defer f.bgMu.Unlock()
		if !f.stopped {
			f.bg.Go(func() { f.handover(i, st) })
		}
	}}
}

// handover is daemon i's simulated handover to st's build (see above).
func (f *Fleet) handover(i int, st upgrade.Staged) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.runCtx.Err() != nil {
		return
	}
	d := f.ds[i]
	d.cancel()
	<-d.done
	to := st.Manifest.Version
	err := d.installer.BeginTrial(st)
	if err == nil && f.cfg.FailUpgrade != nil && f.cfg.FailUpgrade(i, to) {
		err = fmt.Errorf("simulated: bcd %s did not report within the trial", to)
	}
	if err == nil {
		err = d.installer.Activate(st)
	}
	if err == nil {
		f.cfg.Logger.Info("simulated upgrade: the new build reported (simulated trial and exec)", "node", d.nodeID, "from", d.version, "to", to)
		d.version = to
	} else {
		f.cfg.Logger.Warn("simulated upgrade failed: rolled back, UpgradeFailed latched", "node", d.nodeID, "version", to, "err", err)
		if ferr := d.installer.Fail(st, err.Error()); ferr != nil {
			f.cfg.Logger.Error("simulated upgrade: latching UpgradeFailed", "node", d.nodeID, "err", ferr)
		}
	}
	f.run(i)
}

// installedVersion is the version daemon i's installer last activated, or
// "" (none, or no installer).
func (d *daemon) installedVersion() string {
	if d.installer == nil {
		return ""
	}
	s, err := d.installer.State()
	if err != nil {
		return ""
	}
	return s.Version
}

// Version returns the bcd version simulated daemon i reports in its Hello.
func (f *Fleet) Version(i int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ds[i].version
}
