package converge

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"
)

// TunnelsFile is the tunnels handler's applied allowlist.
const TunnelsFile = "tunnels.json"

// tunnelsHandler keeps the tunnels section's allowlist: written to
// TunnelsFile (removed when the section is empty) and held in memory for
// the session, which checks every OpenTunnel against it
// (tunnelspec.Allows). An invalid section is FAILED_TERMINAL and allows
// nothing: the applied allowlist becomes empty rather than staying what it
// was.
type tunnelsHandler struct {
	cur atomic.Pointer[agentv1.TunnelSettings]
}

func (*tunnelsHandler) Section() string { return "tunnels" }

func (h *tunnelsHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	sec := d.GetTunnels()
	var terminal string
	if bad := tunnelspec.Validate(sec); len(bad) > 0 {
		terminal = "invalid tunnels section (nothing is allowed): " + strings.Join(bad, "; ")
		sec = nil
	}
	if empty(sec) {
		sec = nil
	}
	var data []byte
	if sec != nil {
		b, err := protojson.MarshalOptions{Multiline: true}.Marshal(sec)
		if err != nil {
			return Plan{}, err
		}
		data = append(b, '\n')
	}
	acts, err := fileAction(cur, TunnelsFile, data)
	if err != nil {
		return Plan{}, err
	}
	// The in-memory copy follows the section even when the file already
	// matches (a restart loads it in load).
	if !proto.Equal(h.cur.Load(), sec) {
		acts = append(acts, Action{Path: TunnelsFile, Data: data, Remove: data == nil})
	}
	return Plan{Actions: dedupe(acts), Terminal: terminal}, nil
}

func (h *tunnelsHandler) Apply(_ context.Context, cur Current, p Plan) error {
	if err := applyFiles(cur, p.Actions); err != nil {
		return err
	}
	return h.load(cur.Root)
}

// load reads TunnelsFile (absent: nothing allowed).
func (h *tunnelsHandler) load(root string) error {
	b, err := Current{Root: root}.ReadFile(TunnelsFile)
	if err != nil {
		return fmt.Errorf("converge: %w", err)
	}
	s := &agentv1.TunnelSettings{}
	if b != nil {
		if err := protojson.Unmarshal(b, s); err != nil {
			return fmt.Errorf("converge: %s: %w", TunnelsFile, err)
		}
	}
	if empty(s) {
		s = nil
	}
	h.cur.Store(s)
	return nil
}

// dedupe keeps the first action per path.
func dedupe(acts []Action) []Action {
	seen := map[string]bool{}
	out := acts[:0]
	for _, a := range acts {
		if !seen[a.Path] {
			seen[a.Path] = true
			out = append(out, a)
		}
	}
	return out
}

// Tunnels is the applied tunnels allowlist (nil: nothing is allowed).
func (c *Converger) Tunnels() *agentv1.TunnelSettings { return c.tunnels.cur.Load() }

// AllowsTunnel returns nil when the applied allowlist allows target, and
// otherwise why not.
func (c *Converger) AllowsTunnel(target string) error {
	return tunnelspec.Allows(c.Tunnels(), target)
}
