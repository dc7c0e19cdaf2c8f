package converge

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/bettercompute/bettercompute/agent/engines"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/runtimespec"
)

// RuntimeFile is the runtime handler's record under the state root: what
// Docker's daemon.json keys held before bcd set them (engines.Record).
const RuntimeFile = "runtime.json"

// Runtime says where the runtime section's engine configuration and CDI
// directories go.
type Runtime struct {
	// Root is the system root the engines' files (package engines) and the
	// section's CDI directories are under: "/" on a real node (bcd node
	// --site-root); "" means the state root (a simulated node, tests).
	Root string
	// Runner runs the engines' tools for the loaded check and nvidia-ctk
	// for min_container_toolkit_version; nil finds none (every engine "not
	// checked", a minimum version fails "nvidia-ctk not found").
	Runner engines.Runner
	// NvidiaCTK is the nvidia-ctk binary; empty looks it up by name.
	NvidiaCTK string
}

// runtimeHandler wires the engines the runtime section names to its CDI
// directories (package engines) and reverts those it no longer names; the
// devices handler writes the spec into the directories. Its status reason
// has the directories and one entry per engine configured or reverted,
// with what the running engine says ("loaded", "not loaded: …", "not
// checked: …"). An invalid section is FAILED_TERMINAL naming the field and
// changes nothing; an nvidia-ctk older than min_container_toolkit_version,
// or none, makes it FAILED (retried) with the engines still configured.
type runtimeHandler struct {
	cfg engines.Config
}

func (*runtimeHandler) Section() string { return "runtime" }

func (h *runtimeHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	r := d.GetRuntime()
	if bad := runtimespec.Validate(r); len(bad) > 0 {
		parts := make([]string, len(bad))
		for i, b := range bad {
			parts[i] = b.String()
		}
		return Plan{Terminal: "invalid runtime section: " + strings.Join(parts, "; ")}, nil
	}
	var rec engines.Record
	b, err := cur.ReadFile(RuntimeFile)
	if err != nil {
		return Plan{}, err
	}
	if b != nil {
		if err := json.Unmarshal(b, &rec); err != nil {
			return Plan{}, fmt.Errorf("%s: %w", RuntimeFile, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*engines.CheckTimeout)
	defer cancel()
	set := !empty(r)
	dirs := runtimespec.Dirs(r)
	res, err := engines.Plan(ctx, h.cfg, r.GetEngines(), dirs, rec, set)
	if err != nil {
		return Plan{}, err
	}
	var p Plan
	for _, f := range res.Files {
		a, err := fileAction(Current{Root: h.cfg.Root}, f.Path, f.Data)
		if err != nil {
			return Plan{}, err
		}
		for i := range a {
			a[i].Root = h.cfg.Root
		}
		p.Actions = append(p.Actions, a...)
	}
	var recData []byte
	if res.Record != (engines.Record{}) {
		recData = marshal(res.Record)
	}
	a, err := fileAction(cur, RuntimeFile, recData)
	if err != nil {
		return Plan{}, err
	}
	p.Actions = append(p.Actions, a...)
	var parts []string
	if set {
		parts = append(parts, "CDI spec directories "+strings.Join(dirs, ", "))
		if len(r.GetEngines()) == 0 {
			parts = append(parts, "no engine named")
		}
	}
	for _, e := range res.Engines {
		parts = append(parts, e.String())
	}
	var failed []string
	if res.Failure != "" {
		failed = append(failed, res.Failure)
	}
	if least := r.GetMinContainerToolkitVersion(); least != "" {
		have, why := engines.Toolkit(ctx, h.cfg, least)
		switch {
		case why != "":
			failed = append(failed, why)
		default:
			parts = append(parts, fmt.Sprintf("nvidia-ctk %s (min_container_toolkit_version %s)", have, least))
		}
	}
	p.Summary = strings.Join(parts, "; ")
	if len(failed) > 0 {
		p.Failure = strings.Join(failed, "; ") + "; " + p.Summary
	}
	return p, nil
}

func (h *runtimeHandler) Apply(_ context.Context, cur Current, p Plan) error {
	return applyFiles(cur, p.Actions)
}
