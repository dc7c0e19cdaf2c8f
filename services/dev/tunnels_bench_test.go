package dev_test

import (
	"io"
	"net"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/coder/websocket"
)

// BenchmarkTunnelOpenToFirstByte times, per tunnel, tunnels.open (REST),
// the WebSocket connect through API, gateway and node to a loopback echo
// server, and one byte there and back; it reports the p50 and p99. Each
// tunnel is closed (both sides half-close) before the next opens.
func BenchmarkTunnelOpenToFirstByte(b *testing.B) {
	env, _, node := tunnelEnv(b)
	target := "127.0.0.1:" + strconv.Itoa(echo(b))
	var took []time.Duration
	b.ResetTimer()
	for b.Loop() {
		start := time.Now()
		o := openTunnel(b, env, node, target, 0)
		c, err := dialTunnel(b, env, o.ConnectToken)
		if err != nil {
			b.Fatal(err)
		}
		if err := c.Write(b.Context(), websocket.MessageBinary, []byte{'x'}); err != nil {
			b.Fatal(err)
		}
		if _, p, err := c.Read(b.Context()); err != nil || string(p) != "x" {
			b.Fatalf("first byte %q %v", p, err)
		}
		took = append(took, time.Since(start))
		_ = c.Write(b.Context(), websocket.MessageBinary, nil)
		if _, err := readUntilClosed(b.Context(), c); websocket.CloseStatus(err) != websocket.StatusNormalClosure {
			b.Fatalf("close: %v", err)
		}
	}
	b.StopTimer()
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(took[len(took)*99/100].Microseconds())/1000, "p99-ms")
}

// BenchmarkTunnelThroughput sends 32 KiB messages through one tunnel
// (WebSocket to the API, the gateway, the node's Tunnel stream, the node's
// TCP connection) to a loopback server that discards them: b.SetBytes
// makes the MB/s one tunnel's throughput, caller to target.
func BenchmarkTunnelThroughput(b *testing.B) {
	env, _, node := tunnelEnv(b)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				n, _ := io.Copy(io.Discard, c)
				_, _ = c.Write([]byte(strconv.FormatInt(n, 10)))
				_ = c.Close()
			}()
		}
	}()
	o := openTunnel(b, env, node, ln.Addr().String(), 0)
	c, err := dialTunnel(b, env, o.ConnectToken)
	if err != nil {
		b.Fatal(err)
	}
	msg := make([]byte, 32<<10)
	b.SetBytes(int64(len(msg)))
	b.ResetTimer()
	n := 0
	for b.Loop() {
		if err := c.Write(b.Context(), websocket.MessageBinary, msg); err != nil {
			b.Fatal(err)
		}
		n++
	}
	if err := c.Write(b.Context(), websocket.MessageBinary, nil); err != nil {
		b.Fatal(err)
	}
	got, err := readUntilClosed(b.Context(), c)
	b.StopTimer()
	if string(got) != strconv.Itoa(n*len(msg)) || websocket.CloseStatus(err) != websocket.StatusNormalClosure {
		b.Fatalf("the target counted %q bytes, want %d (%v)", got, n*len(msg), err)
	}
}
