package commands

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Lane is a daemon's concurrency lane: a command takes one of its lane's
// credits while it runs; with none left the daemon rejects it BUSY.
type Lane string

// The lanes and their credits (DESIGN §6).
const (
	LaneDiag      Lane = "diag"
	LaneDefault   Lane = "default"
	LaneExclusive Lane = "exclusive"
)

// Credits is how many commands of a lane a daemon runs at once.
var Credits = map[Lane]int{LaneDiag: 1, LaneDefault: 4, LaneExclusive: 1}

// Kind is a registered command kind and the rules for delivering it.
type Kind struct {
	// Name, e.g. "inventory.refresh".
	Name string
	// Field is the CommandBody oneof field carrying the kind's payload, e.g.
	// "inventory_refresh".
	Field protoreflect.Name
	// API: commands.run accepts it (the spec's allowlist).
	API bool
	// RetrySafe: running it twice does no harm, so a lost journal sends it
	// again instead of failing it journal-lost.
	RetrySafe bool
	// SelfTerminating: the daemon never reports success; the command
	// succeeds when the node reconnects with a new boot id.
	SelfTerminating bool
	// Destructive: signed with the command-signing key at dispatch; the
	// daemon rejects it BAD_SIGNATURE unless the signature verifies.
	Destructive bool
	// Lane the daemon runs it in.
	Lane Lane
	// Timeout is how long it may run once accepted: an in-flight command
	// past not_after + Timeout fails with reason "timeout".
	Timeout time.Duration
	// Doc is one line for the kinds reference.
	Doc string
}

// Message returns the kind's payload message type (a new empty message).
func (k Kind) Message() protoreflect.Message {
	body := (&agentv1.CommandBody{}).ProtoReflect()
	return body.NewField(body.Descriptor().Fields().ByName(k.Field)).Message()
}

// Registry holds the kinds this process knows.
type Registry struct {
	mu    sync.RWMutex
	kinds map[string]Kind
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{kinds: map[string]Kind{}} }

var kindName = regexp.MustCompile(`^[a-z][a-z0-9-]*(\.[a-z][a-z0-9-]*)+$`)

// Register adds k. The name must be dotted lower case and new, the field a
// message field of CommandBody's oneof, the lane known and the timeout
// positive.
func (r *Registry) Register(k Kind) error {
	if !kindName.MatchString(k.Name) {
		return fmt.Errorf("command kind %q: want dotted lower-case words", k.Name)
	}
	fd := (&agentv1.CommandBody{}).ProtoReflect().Descriptor().Fields().ByName(k.Field)
	if fd == nil || fd.ContainingOneof() == nil || fd.Message() == nil {
		return fmt.Errorf("command kind %s: %q is not a payload field of CommandBody", k.Name, k.Field)
	}
	if _, ok := Credits[k.Lane]; !ok {
		return fmt.Errorf("command kind %s: unknown lane %q", k.Name, k.Lane)
	}
	if k.Timeout <= 0 {
		return fmt.Errorf("command kind %s: timeout must be positive", k.Name)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.kinds[k.Name]; dup {
		return fmt.Errorf("command kind %s registered twice", k.Name)
	}
	r.kinds[k.Name] = k
	return nil
}

// MustRegister is Register that panics, for init-time registration.
func (r *Registry) MustRegister(k Kind) {
	if err := r.Register(k); err != nil {
		panic(err)
	}
}

// Lookup returns the kind named name.
func (r *Registry) Lookup(name string) (Kind, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	k, ok := r.kinds[name]
	return k, ok
}

// Kinds returns every kind, by name.
func (r *Registry) Kinds() []Kind {
	r.mu.RLock()
	defer r.mu.RUnlock()
	ks := make([]Kind, 0, len(r.kinds))
	for _, k := range r.kinds {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b Kind) int { return strings.Compare(a.Name, b.Name) })
	return ks
}

// DefaultTimeout applies to a kind this process does not know (a module's
// kind registered elsewhere) when the sweeper times commands out.
const DefaultTimeout = 15 * time.Minute

// timeout is the kind's timeout, or DefaultTimeout.
func (r *Registry) timeout(name string) time.Duration {
	if k, ok := r.Lookup(name); ok {
		return k.Timeout
	}
	return DefaultTimeout
}

// Builtin returns a registry with the server's kinds (DESIGN §6). gpu.reset
// and agent.upgrade have no payload message in the wire contract yet, so
// they are not registered.
func Builtin() *Registry {
	r := NewRegistry()
	r.MustRegister(Kind{Name: "diag.nvml", Field: "diag_nvml", API: true, RetrySafe: true, Lane: LaneDiag, Timeout: 10 * time.Minute,
		Doc: "Runs NVML health checks and a short check per GPU."})
	r.MustRegister(Kind{Name: "inventory.refresh", Field: "inventory_refresh", API: true, RetrySafe: true, Lane: LaneDefault, Timeout: 2 * time.Minute,
		Doc: "Re-collects inventory sections and reports them on the session."})
	r.MustRegister(Kind{Name: "logs.collect", Field: "logs_collect", API: true, RetrySafe: true, Lane: LaneDefault, Timeout: 10 * time.Minute,
		Doc: "Collects the daemon's logs, bounded in size (1 MiB by default, 4 MiB at most)."})
	r.MustRegister(Kind{Name: "node.reboot", Field: "node_reboot", API: true, SelfTerminating: true, Destructive: true, Lane: LaneExclusive, Timeout: 15 * time.Minute,
		Doc: "Reboots the node; succeeds when the node reconnects with a new boot id."})
	return r
}
