package site

import (
	"bytes"
	"crypto/ecdsa"
	"encoding/json"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/credseal"
)

const testPassword = "s3cret-bmc-password-99"

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type taskEnv struct {
	ts   *tasks
	tbl  *pxe.Table
	bmc  *fakebmc.Server
	logs *syncBuf
}

func setupTasks(t *testing.T) (*taskEnv, func() *agentv1.TaskResult) {
	t.Helper()
	e := &taskEnv{tbl: pxe.NewTable(), logs: &syncBuf{}}
	logger := slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	b, err := fakebmc.New(fakebmc.Config{Username: "admin", Password: testPassword, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	if e.bmc, err = fakebmc.StartTLS(b, "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.bmc.Close() })
	e.ts = newTasks(logger, e.tbl, time.Minute, nil)
	t.Cleanup(e.ts.wait)
	next := func() *agentv1.TaskResult {
		t.Helper()
		for {
			select {
			case <-e.ts.wake:
				if rs := e.ts.take(); len(rs) > 0 {
					// Requeue all but the first.
					if len(rs) > 1 {
						e.ts.mu.Lock()
						e.ts.outbox = append(rs[1:], e.ts.outbox...)
						e.ts.mu.Unlock()
						select {
						case e.ts.wake <- struct{}{}:
						default:
						}
					}
					return rs[0]
				}
			case <-time.After(30 * time.Second):
				t.Fatal("no task result")
			}
		}
	}
	return e, next
}

func (e *taskEnv) sealCreds(t *testing.T, jwk, id, machine string) string {
	t.Helper()
	b, _ := json.Marshal(credseal.BMCCredentials{Username: "admin", Password: testPassword})
	s, err := credseal.Seal(jwk, b, credseal.TaskAAD(id, machine)...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func key(t *testing.T) (*ecdsa.PrivateKey, string) {
	t.Helper()
	k, err := credseal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	j, err := credseal.PublicJWK(k)
	if err != nil {
		t.Fatal(err)
	}
	return k, j
}

func TestTasksRunAgainstTheBMCOnce(t *testing.T) {
	t.Parallel()
	e, next := setupTasks(t)
	ctx := t.Context()
	k, jwk := key(t)
	bmc := func(id string) *agentv1.Bmc {
		return &agentv1.Bmc{Address: e.bmc.URL, CaPem: string(e.bmc.CAPEM), SealedCredentials: e.sealCreds(t, jwk, id, "mach_1")}
	}

	inspect := &agentv1.SiteTask{Id: "stk_1", Kind: "bmc.inspect", MachineId: "mach_1", Attempt: 1,
		Body: &agentv1.SiteTask_BmcInspect{BmcInspect: &agentv1.BmcInspect{Bmc: bmc("stk_1")}}}
	e.ts.handle(ctx, inspect, k)
	r := next()
	if !r.GetOk() || r.GetId() != "stk_1" || r.GetAttempt() != 1 || r.GetInventory().GetSerialNumber() != e.bmc.BMC.Machine().SerialNumber ||
		len(r.GetInventory().GetNics()) != 2 {
		t.Fatalf("inspect: %v", r)
	}

	cycle := &agentv1.SiteTask{Id: "stk_2", Kind: "bmc.power", MachineId: "mach_1", Attempt: 1,
		Body: &agentv1.SiteTask_BmcPower{BmcPower: &agentv1.BmcPower{Bmc: bmc("stk_2"), Action: "cycle"}}}
	e.ts.handle(ctx, cycle, k)
	if r := next(); !r.GetOk() || r.GetPower().GetState() != "On" {
		t.Fatalf("cycle: %v", r)
	}
	// Sent again (a new attempt, after a lost session): answered from
	// memory, the BMC reset once.
	again := &agentv1.SiteTask{Id: "stk_2", Kind: "bmc.power", MachineId: "mach_1", Attempt: 2, Body: cycle.Body}
	e.ts.handle(ctx, again, k)
	if r := next(); !r.GetOk() || r.GetAttempt() != 2 {
		t.Fatalf("the second attempt: %v", r)
	}
	resets := 0
	for _, a := range e.bmc.BMC.Actions() {
		if a.Kind == "Reset" {
			resets++
		}
	}
	if resets != 1 {
		t.Fatalf("%d resets, want 1", resets)
	}

	t.Run("credentials sealed to another key or task do not open", func(t *testing.T) {
		_, other := key(t)
		for _, sealed := range []string{e.sealCreds(t, other, "stk_3", "mach_1"), e.sealCreds(t, jwk, "stk_other", "mach_1")} {
			e.ts.handle(ctx, &agentv1.SiteTask{Id: "stk_3" + sealed[len(sealed)-4:], Kind: "bmc.inspect", MachineId: "mach_1", Attempt: 1,
				Body: &agentv1.SiteTask_BmcInspect{BmcInspect: &agentv1.BmcInspect{Bmc: &agentv1.Bmc{Address: e.bmc.URL, SealedCredentials: sealed}}}}, k)
			if r := next(); r.GetOk() || !strings.Contains(r.GetError(), "open the BMC credentials") {
				t.Fatalf("got %v", r)
			}
		}
	})

	t.Run("a wrong password fails without saying it", func(t *testing.T) {
		b, _ := json.Marshal(credseal.BMCCredentials{Username: "admin", Password: "wrong-" + testPassword})
		sealed, _ := credseal.Seal(jwk, b, credseal.TaskAAD("stk_4", "mach_1")...)
		e.ts.handle(ctx, &agentv1.SiteTask{Id: "stk_4", Kind: "bmc.inspect", MachineId: "mach_1", Attempt: 1,
			Body: &agentv1.SiteTask_BmcInspect{BmcInspect: &agentv1.BmcInspect{Bmc: &agentv1.Bmc{Address: e.bmc.URL, CaPem: string(e.bmc.CAPEM), SealedCredentials: sealed}}}}, k)
		if r := next(); r.GetOk() || strings.Contains(r.GetError(), testPassword) || r.GetError() == "" {
			t.Fatalf("got %v", r)
		}
	})

	if logs := e.logs.String(); strings.Contains(logs, testPassword) || !strings.Contains(logs, "running site task") {
		t.Fatalf("the logs hold the password, or nothing:\n%s", logs)
	}
}

func TestPXETasksChangeTheTable(t *testing.T) {
	t.Parallel()
	e, next := setupTasks(t)
	ctx := t.Context()
	k, jwk := key(t)
	tok, err := credseal.Seal(jwk, []byte("one-time-token"), credseal.TaskAAD("stk_a", "mach_1")...)
	if err != nil {
		t.Fatal(err)
	}
	img := &agentv1.BootImage{Url: "https://images.example/vmlinuz", Sha256: strings.Repeat("0f", 32)}
	e.ts.handle(ctx, &agentv1.SiteTask{Id: "stk_a", Kind: "pxe.arm", MachineId: "mach_1", Attempt: 1, Body: &agentv1.SiteTask_PxeArm{
		PxeArm: &agentv1.PxeArm{Macs: []string{"02:00:00:00:00:0A"}, Decision: "ramdisk", Kernel: img, Initrd: img, SealedBootToken: tok}}}, k)
	if r := next(); !r.GetOk() {
		t.Fatalf("arm: %v", r)
	}
	mac, _ := net.ParseMAC("02:00:00:00:00:0a")
	if d, ok := e.tbl.Lookup(ctx, mac); !ok || d.Action != pxe.BootRamdisk || d.Initrd.URL != img.Url {
		t.Fatalf("the table: %+v %v", d, ok)
	}
	if got, err := e.tbl.TakeBootToken(ctx, mac); err != nil || got != "one-time-token" {
		t.Fatalf("token %q %v", got, err)
	}
	e.ts.handle(ctx, &agentv1.SiteTask{Id: "stk_b", Kind: "pxe.arm", MachineId: "mach_1", Attempt: 1, Body: &agentv1.SiteTask_PxeArm{
		PxeArm: &agentv1.PxeArm{Macs: []string{"02:00:00:00:00:0a"}, Decision: "local"}}}, k)
	if r := next(); !r.GetOk() {
		t.Fatalf("arm local: %v", r)
	}
	if d, _ := e.tbl.Lookup(ctx, mac); d.Action != pxe.BootLocal {
		t.Fatalf("the table: %+v", d)
	}
	e.ts.handle(ctx, &agentv1.SiteTask{Id: "stk_c", Kind: "pxe.disarm", MachineId: "mach_1", Attempt: 1, Body: &agentv1.SiteTask_PxeDisarm{
		PxeDisarm: &agentv1.PxeDisarm{Macs: []string{"02:00:00:00:00:0a"}}}}, k)
	if r := next(); !r.GetOk() {
		t.Fatalf("disarm: %v", r)
	}
	if _, ok := e.tbl.Lookup(ctx, mac); ok {
		t.Fatal("the disarmed MAC is still answered")
	}
	e.ts.handle(ctx, &agentv1.SiteTask{Id: "stk_d", Kind: "pxe.arm", MachineId: "mach_1", Attempt: 1, Body: &agentv1.SiteTask_PxeArm{
		PxeArm: &agentv1.PxeArm{Macs: []string{"not-a-mac"}, Decision: "local"}}}, k)
	if r := next(); r.GetOk() || !strings.Contains(r.GetError(), "not-a-mac") {
		t.Fatalf("a bad MAC: %v", r)
	}

	off := newTasks(slog.New(slog.DiscardHandler), nil, time.Minute, nil)
	off.handle(ctx, &agentv1.SiteTask{Id: "stk_e", Kind: "pxe.disarm", Attempt: 1, Body: &agentv1.SiteTask_PxeDisarm{
		PxeDisarm: &agentv1.PxeDisarm{Macs: []string{"02:00:00:00:00:0a"}}}}, k)
	<-off.wake
	if rs := off.take(); len(rs) != 1 || rs[0].GetOk() || !strings.Contains(rs[0].GetError(), "PXE is off") {
		t.Fatalf("with PXE off: %v", rs)
	}
	off.wait()
}
