package site

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/bettercompute/bettercompute/agent/site/pxe"
	"github.com/bettercompute/bettercompute/agent/site/redfish"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/credseal"
)

// Site tasks.
//
// The control plane sends the lease holder SiteTasks (pkg/sitetasks on its
// side): bmc.inspect, bmc.power and bmc.boot run against the machine's BMC
// through agent/site/redfish, with credentials sealed to the session's key
// (proto/credseal, with the task and machine ids as additional data) that
// are opened only to connect, never logged and zeroed after use;
// pxe.arm and pxe.disarm change the boot server's pxe.Table. Every task is
// answered with a TaskResult naming its id and attempt.
//
// A task id runs at most once while the agent lives: the control plane
// sends a task again (a new attempt) when the session it went to ended, and
// the agent answers that from what it remembers — the result when the first
// run finished, or the first run's result, when it finishes, under the
// latest attempt. A restarted agent remembers nothing, so it runs the task
// again: the old process is gone.

// Task bounds.
const (
	// MaxConcurrentTasks bounds the tasks run at once; more wait.
	MaxConcurrentTasks = 8
	// rememberedTasks bounds the finished tasks remembered.
	rememberedTasks = 4096
	// maxTaskError bounds a TaskResult's error.
	maxTaskError = 4096
	// defaultTaskTimeout bounds a task whose not_after is missing or far.
	defaultTaskTimeout = 10 * time.Minute
)

// taskRun is one task id the agent has seen.
type taskRun struct {
	attempt int32
	result  *agentv1.TaskResult // set once finished
}

// tasks runs the site tasks of one Run, across its sessions.
type tasks struct {
	log     *slog.Logger
	table   *pxe.Table
	timeout time.Duration
	onTask  func(context.Context, *agentv1.SiteTask)
	sem     chan struct{}
	wg      sync.WaitGroup

	mu     sync.Mutex
	runs   map[string]*taskRun
	order  []string // finished ids, oldest first
	outbox []*agentv1.TaskResult
	wake   chan struct{} // cap 1: outbox has results
}

func newTasks(log *slog.Logger, table *pxe.Table, timeout time.Duration, onTask func(context.Context, *agentv1.SiteTask)) *tasks {
	return &tasks{log: log, table: table, timeout: timeout, onTask: onTask, sem: make(chan struct{}, MaxConcurrentTasks),
		runs: map[string]*taskRun{}, wake: make(chan struct{}, 1)}
}

// take returns the results waiting to be sent, and forgets them.
func (ts *tasks) take() []*agentv1.TaskResult {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	out := ts.outbox
	ts.outbox = nil
	return out
}

func (ts *tasks) queueLocked(r *agentv1.TaskResult) {
	ts.outbox = append(ts.outbox, r)
	select {
	case ts.wake <- struct{}{}:
	default:
	}
}

// handle starts t (opening its secrets with key) unless it has run or runs:
// then the result, now or when it finishes, answers t's attempt. ctx is
// Run's: a task outlives its session.
func (ts *tasks) handle(ctx context.Context, t *agentv1.SiteTask, key *ecdsa.PrivateKey) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if r, ok := ts.runs[t.GetId()]; ok {
		r.attempt = max(r.attempt, t.GetAttempt())
		if r.result != nil {
			again := proto.CloneOf(r.result)
			again.Attempt = r.attempt
			ts.queueLocked(again)
		}
		return
	}
	r := &taskRun{attempt: t.GetAttempt()}
	ts.runs[t.GetId()] = r
	ts.wg.Go(func() {
		select {
		case ts.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		defer func() { <-ts.sem }()
		res := ts.run(ctx, t, key)
		if ctx.Err() != nil {
			// Stopped: no result; the control plane sends it again to
			// whoever holds the lease next.
			ts.mu.Lock()
			delete(ts.runs, t.GetId())
			ts.mu.Unlock()
			return
		}
		res.Id = t.GetId()
		if len(res.Error) > maxTaskError {
			res.Error = res.Error[:maxTaskError]
		}
		ts.mu.Lock()
		defer ts.mu.Unlock()
		r.result = res
		out := proto.CloneOf(res)
		out.Attempt = r.attempt
		ts.queueLocked(out)
		ts.order = append(ts.order, t.GetId())
		if len(ts.order) > rememberedTasks {
			delete(ts.runs, ts.order[0])
			ts.order = ts.order[1:]
		}
	})
}

// wait waits for the running tasks (after Run's context ended).
func (ts *tasks) wait() { ts.wg.Wait() }

// run executes one task and returns its result (Id and Attempt unset).
func (ts *tasks) run(ctx context.Context, t *agentv1.SiteTask, key *ecdsa.PrivateKey) *agentv1.TaskResult {
	deadline := time.Now().Add(ts.timeout)
	if na := t.GetNotAfter(); na != nil && na.AsTime().Before(deadline) {
		deadline = na.AsTime()
	}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	log := ts.log.With("task", t.GetId(), "kind", t.GetKind(), "machine", t.GetMachineId(), "attempt", t.GetAttempt())
	if ts.onTask != nil {
		ts.onTask(ctx, t)
		if ctx.Err() != nil {
			return &agentv1.TaskResult{Error: "stopped before it ran"}
		}
	}
	log.InfoContext(ctx, "running site task")
	var cert string // the BMC's certificate, as it presented it
	res, err := ts.exec(ctx, t, key, &cert)
	if err != nil {
		log.WarnContext(ctx, "site task failed", "err", err)
		return &agentv1.TaskResult{Error: err.Error(), BmcCertificateSha256: cert}
	}
	log.InfoContext(ctx, "site task done")
	res.Ok = true
	res.BmcCertificateSha256 = cert
	return res
}

func (ts *tasks) exec(ctx context.Context, t *agentv1.SiteTask, key *ecdsa.PrivateKey, cert *string) (*agentv1.TaskResult, error) {
	switch b := t.GetBody().(type) {
	case *agentv1.SiteTask_BmcInspect:
		var inv *redfish.Inventory
		err := ts.withBMC(ctx, t, b.BmcInspect.GetBmc(), key, cert, func(c *redfish.Client) error {
			var err error
			inv, err = c.Inventory(ctx)
			return err
		})
		if err != nil {
			return nil, err
		}
		return &agentv1.TaskResult{Result: &agentv1.TaskResult_Inventory{Inventory: inventoryOf(inv)}}, nil
	case *agentv1.SiteTask_BmcPower:
		action, err := redfish.ParsePowerAction(b.BmcPower.GetAction())
		if err != nil {
			return nil, err
		}
		return ts.power(ctx, t, b.BmcPower.GetBmc(), key, cert, func(c *redfish.Client) error { return c.Power(ctx, action) })
	case *agentv1.SiteTask_BmcBoot:
		target := redfish.BootTarget(b.BmcBoot.GetTarget())
		if target != redfish.BootPXE && target != redfish.BootDisk {
			return nil, fmt.Errorf("boot target %q: want pxe or disk", b.BmcBoot.GetTarget())
		}
		return ts.power(ctx, t, b.BmcBoot.GetBmc(), key, cert, func(c *redfish.Client) error { return c.BootOnce(ctx, target) })
	case *agentv1.SiteTask_PxeArm:
		return &agentv1.TaskResult{}, ts.arm(t, b.PxeArm, key)
	case *agentv1.SiteTask_PxeDisarm:
		if ts.table == nil {
			return nil, errPXEOff
		}
		macs, err := parseMACs(b.PxeDisarm.GetMacs())
		if err != nil {
			return nil, err
		}
		for _, m := range macs {
			ts.table.Delete(m)
		}
		return &agentv1.TaskResult{}, nil
	}
	return nil, fmt.Errorf("unsupported site task kind %q", t.GetKind())
}

// power runs fn and answers the power state after.
func (ts *tasks) power(ctx context.Context, t *agentv1.SiteTask, bmc *agentv1.Bmc, key *ecdsa.PrivateKey, cert *string,
	fn func(*redfish.Client) error) (*agentv1.TaskResult, error) {
	var st redfish.PowerState
	err := ts.withBMC(ctx, t, bmc, key, cert, func(c *redfish.Client) error {
		if err := fn(c); err != nil {
			return err
		}
		var err error
		st, err = c.PowerState(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &agentv1.TaskResult{Result: &agentv1.TaskResult_Power{Power: &agentv1.PowerState{State: string(st)}}}, nil
}

var errPXEOff = errors.New("PXE is off on this site agent (bcd site run without --boot-ip)")

// withBMC opens the sealed credentials, connects, runs fn and logs out;
// *cert is the SHA-256 of the certificate the BMC presented last.
func (ts *tasks) withBMC(ctx context.Context, t *agentv1.SiteTask, bmc *agentv1.Bmc, key *ecdsa.PrivateKey, cert *string,
	fn func(*redfish.Client) error) error {
	if bmc == nil {
		return errors.New("no BMC in the task")
	}
	plain, err := credseal.Open(key, bmc.GetSealedCredentials(), credseal.TaskAAD(t.GetId(), t.GetMachineId())...)
	if err != nil {
		return fmt.Errorf("open the BMC credentials: %w", err)
	}
	var creds credseal.BMCCredentials
	err = json.Unmarshal(plain, &creds)
	clear(plain)
	if err != nil {
		return errors.New("open the BMC credentials: not the JSON {username, password}")
	}
	cfg := redfish.Config{Endpoint: bmc.GetAddress(), Username: creds.Username, Password: creds.Password,
		CAPEM: []byte(bmc.GetCaPem()), Insecure: bmc.GetInsecure(), CertificateSHA256: bmc.GetCertificateSha256(),
		TrustOnFirstUse: bmc.GetTrustOnFirstUse(), Logger: ts.log}
	// A handshake may finish on the transport's goroutine after this
	// returns: it writes seen, never *cert.
	var (
		mu   sync.Mutex
		seen string
	)
	cfg.OnCertificate = func(sum string) {
		mu.Lock()
		seen = sum
		mu.Unlock()
	}
	defer func() {
		mu.Lock()
		*cert = seen
		mu.Unlock()
	}()
	creds = credseal.BMCCredentials{}
	c, err := redfish.Connect(ctx, cfg)
	cfg.Password = ""
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	return fn(c)
}

// arm sets the machine's MACs' decision (and boot token) in the table.
func (ts *tasks) arm(t *agentv1.SiteTask, a *agentv1.PxeArm, key *ecdsa.PrivateKey) error {
	if ts.table == nil {
		return errPXEOff
	}
	macs, err := parseMACs(a.GetMacs())
	if err != nil {
		return err
	}
	var d pxe.Decision
	var token string
	switch a.GetDecision() {
	case "local":
		d.Action = pxe.BootLocal
	case "ramdisk":
		d = pxe.Decision{Action: pxe.BootRamdisk, Kernel: imageOf(a.GetKernel()), Initrd: imageOf(a.GetInitrd()), Args: a.GetArgs()}
		plain, err := credseal.Open(key, a.GetSealedBootToken(), credseal.TaskAAD(t.GetId(), t.GetMachineId())...)
		if err != nil {
			return fmt.Errorf("open the boot token: %w", err)
		}
		token = string(plain)
		clear(plain)
	default:
		return fmt.Errorf("decision %q: want ramdisk or local", a.GetDecision())
	}
	if err := d.Validate(); err != nil {
		return fmt.Errorf("pxe decision: %w", err)
	}
	for _, m := range macs {
		if err := ts.table.Set(m, d); err != nil {
			return err
		}
		if token != "" {
			if err := ts.table.SetBootToken(m, token); err != nil {
				return err
			}
		}
	}
	return nil
}

func imageOf(i *agentv1.BootImage) pxe.Image {
	return pxe.Image{URL: i.GetUrl(), SHA256: i.GetSha256()}
}

func parseMACs(in []string) ([]net.HardwareAddr, error) {
	if len(in) == 0 || len(in) > 64 {
		return nil, fmt.Errorf("macs: want 1 to 64, got %d", len(in))
	}
	out := make([]net.HardwareAddr, 0, len(in))
	for _, s := range in {
		m, err := net.ParseMAC(s)
		if err != nil || len(m) != 6 {
			return nil, fmt.Errorf("mac %q: not an Ethernet address", s)
		}
		out = append(out, m)
	}
	return out, nil
}

func inventoryOf(inv *redfish.Inventory) *agentv1.BmcInventory {
	out := &agentv1.BmcInventory{Manufacturer: inv.Manufacturer, Model: inv.Model, SerialNumber: inv.SerialNumber, Uuid: inv.UUID,
		PowerState: string(inv.PowerState), CpuCount: int32(inv.CPUCount), CpuModel: inv.CPUModel, CpuCores: int32(inv.CPUCores),
		MemoryMib: inv.MemoryMiB}
	for _, n := range inv.NICs {
		out.Nics = append(out.Nics, &agentv1.BmcNic{Id: n.ID, Mac: n.MAC, SpeedMbps: int32(n.SpeedMbps)})
	}
	for _, d := range inv.Disks {
		out.Disks = append(out.Disks, &agentv1.BmcDisk{Id: d.ID, Model: d.Model, SerialNumber: d.SerialNumber,
			CapacityBytes: d.CapacityBytes, MediaType: d.MediaType})
	}
	return out
}
