package session_test

import (
	"bytes"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/bettercompute/bettercompute/agent/command"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// echoServer accepts on loopback, echoes, and counts connections.
func echoServer(t *testing.T) (port int, accepted *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	accepted = &atomic.Int64{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			go func() {
				_, _ = io.Copy(c, c)
				_ = c.(*net.TCPConn).CloseWrite()
				_ = c.Close()
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port, accepted
}

func TestTunnel_AllowlistEnforcedOnTheNode(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	allowed, _ := echoServer(t)
	denied, deniedAccepts := echoServer(t)
	p := uint32(allowed)
	f.cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
		Tunnels: &agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32", PortMin: p}}},
	}})
	f.start(t)
	recv(t, f.cp.Hellos, "Hello")
	for o := recv(t, f.cp.Observed, "Observed"); o.GetObservedGeneration() < 1; o = recv(t, f.cp.Observed, "Observed") {
	}

	// A forged open to a target outside the allowlist: the node refuses
	// it and never connects.
	if n := f.cp.SendOpenTunnel(&agentv1.OpenTunnel{TunnelId: "tun_bad", Target: "127.0.0.1:" + strconv.Itoa(denied)}); n != 1 {
		t.Fatalf("sent on %d sessions", n)
	}
	ts := recv(t, f.cp.Tunnels, "the refused tunnel's stream")
	first, err := ts.Recv()
	if err != nil || first.GetTunnelId() != "tun_bad" || !strings.Contains(first.GetError(), "not in the node's tunnels allowlist") {
		t.Fatalf("refusal %v, %v", first, err)
	}
	close(ts.Done)

	// An allowed target: bytes go both ways, half-close included.
	f.cp.SendOpenTunnel(&agentv1.OpenTunnel{TunnelId: "tun_ok", Target: "127.0.0.1:" + strconv.Itoa(allowed)})
	ts = recv(t, f.cp.Tunnels, "the tunnel's stream")
	if first, err := ts.Recv(); err != nil || first.GetTunnelId() != "tun_ok" || first.GetError() != "" {
		t.Fatalf("open %v, %v", first, err)
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 8192) // 128 KiB: several frames
	go func() {
		for i := 0; i < len(payload); i += 30000 {
			_ = ts.Send(&agentv1.TunnelResponse{Data: payload[i:min(i+30000, len(payload))]})
		}
		_ = ts.Send(&agentv1.TunnelResponse{CloseWrite: true})
	}()
	var got []byte
	for {
		fr, err := ts.Recv()
		if err != nil {
			t.Fatalf("recv after %d bytes: %v", len(got), err)
		}
		got = append(got, fr.GetData()...)
		if fr.GetCloseWrite() {
			break
		}
	}
	close(ts.Done)
	if !bytes.Equal(got, payload) {
		t.Errorf("echoed %d bytes, want %d equal", len(got), len(payload))
	}
	// A frame over the maximum ends the tunnel.
	f.cp.SendOpenTunnel(&agentv1.OpenTunnel{TunnelId: "tun_big", Target: "127.0.0.1:" + strconv.Itoa(allowed)})
	ts = recv(t, f.cp.Tunnels, "the third tunnel's stream")
	if _, err := ts.Recv(); err != nil {
		t.Fatal(err)
	}
	_ = ts.Send(&agentv1.TunnelResponse{Data: make([]byte, 40000)})
	for {
		if _, err := ts.Recv(); err != nil {
			break // the node ended the stream
		}
	}
	close(ts.Done)
	if deniedAccepts.Load() != 0 {
		t.Errorf("the node connected to the denied target %d times", deniedAccepts.Load())
	}
}

// noRamdisk is a command.Ramdisk that is never asked anything: its
// presence makes the daemon bcd ramdisk.
type noRamdisk struct{ command.Ramdisk }

// bcd ramdisk refuses every tunnel, even one its allowlist would allow
// and a gateway forwards anyway.
func TestTunnel_RamdiskOpensNone(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	allowed, accepts := echoServer(t)
	f.cfg.Ramdisk = noRamdisk{}
	f.cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
		Tunnels: &agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32", PortMin: uint32(allowed)}}},
	}})
	f.start(t)
	recv(t, f.cp.Hellos, "Hello")
	for o := recv(t, f.cp.Observed, "Observed"); o.GetObservedGeneration() < 1; o = recv(t, f.cp.Observed, "Observed") {
	}
	f.cp.SendOpenTunnel(&agentv1.OpenTunnel{TunnelId: "tun_rd", Target: "127.0.0.1:" + strconv.Itoa(allowed)})
	ts := recv(t, f.cp.Tunnels, "the ramdisk's tunnel stream")
	first, err := ts.Recv()
	if err != nil || !strings.Contains(first.GetError(), "ramdisk") {
		t.Fatalf("ramdisk tunnel: %v, %v", first, err)
	}
	close(ts.Done)
	if accepts.Load() != 0 {
		t.Errorf("the ramdisk connected to the target")
	}
}
