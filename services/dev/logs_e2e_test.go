package dev_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestLogsCollectSourcesEndToEnd: logs.collect through commands.run to a
// real (simulated) daemon: its own log, its kernel ring buffer and the
// driver's lines from it (a kmsg fixture under the node's root), and the
// journal, which this node lacks (no journalctl): that source says "not
// available" and the rest are collected, all within one maxBytes. An
// unknown source is INVALID_INPUT naming it, and never reaches the node.
func TestLogsCollectSourcesEndToEnd(t *testing.T) {
	t.Parallel()
	env, db := commandEnv(t, "")
	defer env.Stop(context.Background())
	fleet := simFleet(t, env, db, "logs", 1, nil)
	node := fleet.Nodes()[0]
	kmsg := "6,1,1000000,-;usb 1-1: new device\n SUBSYSTEM=usb\n4,2,2500000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus\n6,3,3000000,-;eth0: link up\n"
	if err := os.WriteFile(filepath.Join(fleet.Root(0), "kmsg"), []byte(kmsg), 0o600); err != nil {
		t.Fatal(err)
	}

	status, raw := post(t, env, "commands/run", runReq(node, "logs.collect", map[string]any{"sources": []any{"kernel", "dmesg"}}, "logs-unknown"))
	var e struct{ Code, Field, Message string }
	_ = json.Unmarshal(raw, &e)
	if status != http.StatusBadRequest || e.Code != "INVALID_INPUT" || e.Field != "payload.sources" || !strings.Contains(e.Message, `"dmesg"`) {
		t.Fatalf("unknown source: %d %s", status, raw)
	}

	const budget = 4096
	c := runCmd(t, env, node, "logs.collect", map[string]any{"sources": []any{"bcd", "kernel", "journal", "nvidia"},
		"units": []any{"containerd.service"}, "maxBytes": budget}, "logs-sources")
	got := wantFinal(t, env, node, c.ID, "succeeded", "")
	data, err := base64.StdEncoding.DecodeString(fmt.Sprint(got.Result["data"]))
	if err != nil || len(data) > budget {
		t.Fatalf("data: %d bytes of a %d budget, %v", len(data), budget, err)
	}
	raw, _ = json.Marshal(got.Result["sources"])
	var sources []struct {
		Name, Offset, Length, Unavailable string
		Truncated                         bool
	}
	if err := json.Unmarshal(raw, &sources); err != nil || len(sources) != 4 {
		t.Fatalf("sources %s: %v", raw, err)
	}
	parts := map[string]string{}
	for _, s := range sources {
		off, _ := strconv.Atoi(orZero(s.Offset))
		n, _ := strconv.Atoi(orZero(s.Length))
		if off+n > len(data) {
			t.Fatalf("source %s at %d+%d past %d bytes", s.Name, off, n, len(data))
		}
		parts[s.Name] = string(data[off : off+n])
		if s.Name == "journal" {
			if !strings.HasPrefix(s.Unavailable, "not available: ") || n != 0 {
				t.Fatalf("journal without journalctl: %+v", s)
			}
		} else if s.Unavailable != "" {
			t.Fatalf("source %s unavailable: %s", s.Name, s.Unavailable)
		}
	}
	if parts["kernel"] != "[    1.000000] usb 1-1: new device\n[    2.500000] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus\n[    3.000000] eth0: link up\n" {
		t.Fatalf("kernel %q", parts["kernel"])
	}
	if parts["nvidia"] != "[    2.500000] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus\n" {
		t.Fatalf("nvidia %q", parts["nvidia"])
	}
	if !strings.Contains(parts["bcd"], "session established") {
		t.Fatalf("bcd %q", parts["bcd"])
	}
}

// orZero is "0" for an empty proto3 JSON number (a zero uint64 is omitted).
func orZero(s string) string {
	if s == "" {
		return "0"
	}
	return s
}
