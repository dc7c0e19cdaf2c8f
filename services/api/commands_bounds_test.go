package api_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Security review 13 #5: commands.run accepted logs.collect with 200,000
// sources, each of which made the daemon read its whole log. The API now
// refuses more than 16, a source named twice and an unknown one,
// INVALID_INPUT on payload.sources, before anything is queued.
func TestCommandsRunLogsCollectSourceAmplificationRefused(t *testing.T) {
	t.Parallel()
	h, acmeKey, _, node := commandNode(t)
	cmds := computev1.NewCommandsServiceClient(h.conn)
	run := func(sources ...string) error {
		src := make([]any, len(sources))
		for i, s := range sources {
			src[i] = s
		}
		_, err := cmds.Run(as(acmeKey), &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "logs.collect",
			Payload: payload(t, map[string]any{"sources": src, "maxBytes": 4096})})
		return err
	}
	seventeen := make([]string, 17)
	for i := range seventeen {
		seventeen[i] = "agent"
	}
	for name, sources := range map[string][]string{
		"17 sources":     seventeen,
		"200000 sources": strings.Fields(strings.Repeat("agent ", 200_000)),
		"duplicate":      {"agent", "agent"},
		"unknown":        {"agent", "/etc/shadow"},
		"alias twice":    {"agent", "bcd"},
	} {
		t.Run(name, func(t *testing.T) { wantCode(t, run(sources...), fault.InvalidInput, "payload.sources") })
	}
	if n := h.count(t, `SELECT count(*) FROM commands WHERE node_id = $1`, node); n != 0 {
		t.Fatalf("%d commands queued by refused requests", n)
	}
	// REST says the same.
	status, body := h.rest(t, acmeKey, "commands/run",
		`{"tenantId":"acme","nodeId":"`+node+`","kind":"logs.collect","payload":{"sources":["agent","agent"]}}`)
	wantREST(t, status, body, fault.InvalidInput, "payload.sources")
	if status != http.StatusBadRequest {
		t.Fatalf("status %d", status)
	}
	// Known sources, and none, are fine.
	if err := run("agent"); err != nil {
		t.Fatal(err)
	}
	if err := run("bcd", "kernel", "journal", "nvidia"); err != nil {
		t.Fatal(err)
	}
	if err := run(); err != nil {
		t.Fatal(err)
	}
}

// logs.collect's sources: an unknown one is INVALID_INPUT on
// payload.sources naming it; the journal's unit filter takes only systemd
// unit names (never an option or shell text), at most 16, and only with the
// journal source: INVALID_INPUT on payload.units. Nothing is queued.
func TestCommandsRunLogsCollectSourcesAndUnits(t *testing.T) {
	t.Parallel()
	h, acmeKey, _, node := commandNode(t)
	cmds := computev1.NewCommandsServiceClient(h.conn)
	run := func(p map[string]any) error {
		_, err := cmds.Run(as(acmeKey), &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "logs.collect", Payload: payload(t, p)})
		return err
	}
	err := run(map[string]any{"sources": []any{"kernel", "syslog"}})
	wantCode(t, err, fault.InvalidInput, "payload.sources")
	if !strings.Contains(err.Error(), `"syslog"`) {
		t.Fatalf("the error does not name the source: %v", err)
	}
	seventeen := make([]any, 17)
	for i := range seventeen {
		seventeen[i] = fmt.Sprintf("u%d.service", i)
	}
	for name, units := range map[string][]any{
		"an option":       {"--directory=/"},
		"shell text":      {"a.service; rm -rf /"},
		"a path":          {"../../etc/shadow"},
		"empty":           {""},
		"too long":        {strings.Repeat("u", 257)},
		"seventeen units": seventeen,
	} {
		t.Run(name, func(t *testing.T) {
			wantCode(t, run(map[string]any{"sources": []any{"journal"}, "units": units}), fault.InvalidInput, "payload.units")
		})
	}
	wantCode(t, run(map[string]any{"sources": []any{"kernel"}, "units": []any{"a.service"}}), fault.InvalidInput, "payload.units")
	if n := h.count(t, `SELECT count(*) FROM commands WHERE node_id = $1`, node); n != 0 {
		t.Fatalf("%d commands queued by refused requests", n)
	}
	if err := run(map[string]any{"sources": []any{"journal", "nvidia"}, "units": []any{"containerd.service", "nvidia-persistenced.service", "getty@tty1.service"}}); err != nil {
		t.Fatal(err)
	}
}
