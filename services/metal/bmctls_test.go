package metal_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// startSiteWith is startSite with the site agent's OnTask hook.
func (e *env) startSiteWith(t *testing.T, onTask func(context.Context, *agentv1.SiteTask)) {
	t.Helper()
	e.site = field(e.call(t, "sites/create", map[string]any{"tenantId": "root", "name": "fra1"}), "site", "id")
	e.pool = field(e.call(t, "pools/create", map[string]any{"tenantId": "root", "name": "metal", "class": "gpu"}), "pool", "id")
	tok := field(e.call(t, "sites/createToken", map[string]any{"tenantId": "root", "siteId": e.site}), "token")
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	s, err := dev.StartSimSite(ctx, dev.SimSiteConfig{Gateway: e.App.GatewayAddr(), RootCAs: e.roots, JoinserviceKey: e.pub,
		JoinserviceKeyID: e.keyID, CommandKey: e.CommandKey, Token: tok, Root: t.TempDir(), Hostname: "site-1",
		Logger: slog.New(slog.DiscardHandler), OnTask: onTask})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	e.sim = s
}

func (e *env) pinned(t *testing.T, id string) string {
	t.Helper()
	var sum string
	if err := e.db.QueryRow(t.Context(), `SELECT bmc_certificate_sha256 FROM machines WHERE id = $1`, id).Scan(&sum); err != nil {
		t.Fatal(err)
	}
	return sum
}

// TestBMCCertificateChangeAfterFirstInspectRefused: a machine enrolled
// without TLS options pins the certificate its BMC presented at the first
// inspect (trust on first use); when the BMC then presents another one (it
// was replaced, or someone answers in its place) before the ramdisk boot's
// bmc.boot, the site agent refuses the handshake — no request, so no
// credential, reaches it — and the machine fails at once saying the
// certificate changed, naming both digests.
func TestBMCCertificateChangeAfterFirstInspectRefused(t *testing.T) {
	t.Parallel()
	e := start(t, nil)
	var (
		target   atomic.Pointer[machine]
		once     sync.Once
		rotated  = make(chan string, 1)
		requests atomic.Int64
	)
	e.startSiteWith(t, func(_ context.Context, task *agentv1.SiteTask) {
		m := target.Load()
		if task.GetKind() != "bmc.boot" || m == nil {
			return
		}
		once.Do(func() {
			sum, err := m.BMC.Rotate()
			if err != nil {
				t.Error(err)
			}
			requests.Store(int64(m.BMC.BMC.Requests()))
			rotated <- sum
		})
	})
	m := e.newMachine(t, 1, nil)
	first := m.BMC.CertificateSHA256()
	target.Store(m)
	id, _ := e.enroll(t, m, "m1")
	e.waitState(t, id, "failed", 3*time.Minute)
	second := <-rotated
	var step, reason string
	if err := e.db.QueryRow(t.Context(), `SELECT failed_step, failed_reason FROM machines WHERE id = $1`, id).Scan(&step, &reason); err != nil {
		t.Fatal(err)
	}
	if step != "booting-ramdisk" || !strings.Contains(reason, "certificate changed") || !strings.Contains(reason, first) ||
		!strings.Contains(reason, second) {
		t.Fatalf("failed at %q: %q; want booting-ramdisk, the certificate changed from %s to %s", step, reason, first, second)
	}
	if got := e.pinned(t, id); got != first {
		t.Fatalf("pinned %q, want the first certificate %s", got, first)
	}
	if n := m.BMC.BMC.Requests(); int64(n) != requests.Load() {
		t.Fatalf("the BMC with the new certificate got %d requests", int64(n)-requests.Load())
	}
	// One attempt: a changed certificate is not retried.
	var boots int
	if err := e.db.QueryRow(t.Context(), `SELECT count(*) FROM site_tasks WHERE machine_id = $1 AND kind = 'bmc.boot'`, id).Scan(&boots); err != nil {
		t.Fatal(err)
	}
	if boots != 1 {
		t.Fatalf("%d bmc.boot tasks, want 1", boots)
	}
}

// TestBMCCertificatePinnedAtEnrollment: a machine enrolled with the wrong
// bmc.certificateSha256 fails its first inspect, its BMC never asked
// anything; one enrolled with its BMC's CA (bmc.caPem) or the right digest
// is inspected; a second record of an enrolled server (another BMC
// address, the same MAC) fails at inspecting, naming the machine that has
// the MAC.
func TestBMCCertificatePinnedAtEnrollment(t *testing.T) {
	t.Parallel()
	e := start(t, nil)
	e.startSite(t)
	wrong, withCA, right := e.newMachine(t, 1, nil), e.newMachine(t, 2, nil), e.newMachine(t, 3, nil)
	enroll := func(m *machine, name string, extra map[string]any) string {
		bmc := map[string]any{"address": m.BMC.URL, "username": "admin", "password": bmcPassword}
		for k, v := range extra {
			bmc[k] = v
		}
		out := e.call(t, "metal/enroll", map[string]any{"tenantId": "root", "siteId": e.site, "poolId": e.pool, "name": name, "bmc": bmc})
		return field(out, "machine", "id")
	}
	idWrong := enroll(wrong, "wrong", map[string]any{"certificateSha256": strings.Repeat("ab", 32)})
	idCA := enroll(withCA, "with-ca", map[string]any{"caPem": string(withCA.BMC.CAPEM)})
	idRight := enroll(right, "right", map[string]any{"certificateSha256": right.BMC.CertificateSHA256()})

	e.waitState(t, idWrong, "failed", 3*time.Minute)
	_, reason := e.machineState(t, idWrong)
	if !strings.Contains(reason, "certificate changed") || !strings.Contains(reason, wrong.BMC.CertificateSHA256()) {
		t.Fatalf("the wrongly pinned machine failed: %q", reason)
	}
	if n := wrong.BMC.BMC.Requests(); n != 0 {
		t.Fatalf("the BMC presenting another certificate got %d requests", n)
	}
	inspected := func(id string) bool {
		var n int
		if err := e.db.QueryRow(t.Context(), `SELECT cardinality(macs) FROM machines WHERE id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	poll.Until(t, 3*time.Minute, "the machines with a CA and the right digest inspected", func() bool {
		for _, id := range []string{idCA, idRight} {
			if st, reason := e.machineState(t, id); st == "failed" {
				t.Fatalf("machine %s failed: %s", id, reason)
			}
		}
		return inspected(idCA) && inspected(idRight)
	})
	if got := e.pinned(t, idCA); got != "" {
		t.Fatalf("a machine with a CA pinned %q", got)
	}

	// The same server again, behind another BMC address: its MAC is taken.
	twin, err := e.sim.AddMachine(dev.SimMachineConfig{Name: "twin", MAC: right.MAC, Username: "admin", Password: bmcPassword,
		OnError: func(err error) { t.Logf("twin: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	idTwin := enroll(&machine{twin}, "twin", nil)
	e.waitState(t, idTwin, "failed", 3*time.Minute)
	var step string
	if err := e.db.QueryRow(t.Context(), `SELECT failed_step, failed_reason FROM machines WHERE id = $1`, idTwin).Scan(&step, &reason); err != nil {
		t.Fatal(err)
	}
	if step != "inspecting" || !strings.Contains(reason, idRight) {
		t.Fatalf("the twin failed at %q: %q; want inspecting, naming %s", step, reason, idRight)
	}
}
