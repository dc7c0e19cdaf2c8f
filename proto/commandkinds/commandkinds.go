// Package commandkinds is the one declaration of the command kinds that the
// control plane and the node daemon share: each kind's name, payload field,
// lane, and whether it is destructive, self-terminating or for the ramdisk.
// They are declared as the (command_kind) option on each payload message of
// CommandBody's oneof (bettercompute/agent/v1/commands.proto) and the lanes'
// credits as the (credits) option on the Lane enum (kinds.proto); this
// package reads them from the compiled descriptors. The control plane's
// registry (pkg/commands) and bcd's executor (agent/command) both build
// their tables from it, so a property changes in one place for both.
package commandkinds

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Kind is one command kind as both sides know it.
type Kind struct {
	// Name, e.g. "inventory.refresh".
	Name string
	// Field is the CommandBody oneof field carrying the kind's payload, e.g.
	// "inventory_refresh".
	Field protoreflect.Name
	// Lane the daemon runs it in, e.g. "default" (see [LaneName]).
	Lane string
	// Destructive: signed with the command-signing key when it is queued;
	// the daemon rejects it BAD_SIGNATURE unless the signature verifies.
	Destructive bool
	// SelfTerminating: the daemon never reports success; the command
	// succeeds when the node reconnects with a new boot id.
	SelfTerminating bool
	// Ramdisk: also sent to a node in its ramdisk (bcd ramdisk).
	Ramdisk bool
	// RamdiskOnly: sent only to a node in its ramdisk; only bcd ramdisk
	// runs it.
	RamdiskOnly bool
}

// table is the declarations, read once.
type table struct {
	kinds   []Kind // by name
	byName  map[string]Kind
	byField map[protoreflect.Name]Kind
	credits map[string]int
}

var load = sync.OnceValue(func() *table {
	t, err := read((&agentv1.CommandBody{}).ProtoReflect().Descriptor(), agentv1.Lane(0).Descriptor())
	if err != nil {
		panic(err)
	}
	return t
})

var kindName = regexp.MustCompile(`^[a-z][a-z0-9-]*(\.[a-z][a-z0-9-]*)+$`)

// read collects the kinds declared on body's oneof payload messages and the
// credits declared on lanes' values: every payload message must declare a
// kind with a well-formed, unique name and a lane that has credits.
func read(body protoreflect.MessageDescriptor, lanes protoreflect.EnumDescriptor) (*table, error) {
	t := &table{byName: map[string]Kind{}, byField: map[protoreflect.Name]Kind{}, credits: map[string]int{}}
	values := lanes.Values()
	for i := range values.Len() {
		v := values.Get(i)
		if v.Number() == 0 {
			continue
		}
		opts, _ := v.Options().(*descriptorpb.EnumValueOptions)
		n := proto.GetExtension(opts, agentv1.E_Credits).(int32)
		if n <= 0 {
			return nil, fmt.Errorf("lane %s: (credits) must be positive, got %d", v.Name(), n)
		}
		t.credits[laneName(v)] = int(n)
	}
	fields := body.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if fd.ContainingOneof() == nil || fd.Message() == nil {
			continue
		}
		opts, _ := fd.Message().Options().(*descriptorpb.MessageOptions)
		o := proto.GetExtension(opts, agentv1.E_CommandKind).(*agentv1.KindOptions)
		if o == nil {
			return nil, fmt.Errorf("%s (CommandBody.%s) declares no (command_kind)", fd.Message().FullName(), fd.Name())
		}
		lane := lanes.Values().ByNumber(protoreflect.EnumNumber(o.GetLane()))
		k := Kind{
			Name: o.GetName(), Field: fd.Name(),
			Destructive: o.GetDestructive(), SelfTerminating: o.GetSelfTerminating(),
			Ramdisk: o.GetRamdisk(), RamdiskOnly: o.GetRamdiskOnly(),
		}
		switch {
		case !kindName.MatchString(k.Name):
			return nil, fmt.Errorf("%s: kind name %q: want dotted lower-case words", fd.Message().FullName(), k.Name)
		case lane == nil || t.credits[laneName(lane)] == 0:
			return nil, fmt.Errorf("kind %s: lane %v has no credits", k.Name, o.GetLane())
		case k.Ramdisk && k.RamdiskOnly:
			return nil, fmt.Errorf("kind %s: ramdisk and ramdisk_only both set (ramdisk_only implies ramdisk)", k.Name)
		}
		if _, dup := t.byName[k.Name]; dup {
			return nil, fmt.Errorf("kind %s declared twice", k.Name)
		}
		k.Lane = laneName(lane)
		t.byName[k.Name] = k
		t.byField[k.Field] = k
	}
	t.kinds = slices.SortedFunc(maps.Values(t.byName), func(a, b Kind) int { return strings.Compare(a.Name, b.Name) })
	return t, nil
}

func laneName(v protoreflect.EnumValueDescriptor) string {
	return strings.ToLower(strings.TrimPrefix(string(v.Name()), "LANE_"))
}

// LaneName is a lane's name: the value's name without "LANE_", in lower
// case ("diag", "default", "exclusive").
func LaneName(l agentv1.Lane) string {
	v := l.Descriptor().Values().ByNumber(l.Number())
	if v == nil {
		return ""
	}
	return laneName(v)
}

// All returns every declared kind, by name.
func All() []Kind { return slices.Clone(load().kinds) }

// Lookup returns the kind named name.
func Lookup(name string) (Kind, bool) {
	k, ok := load().byName[name]
	return k, ok
}

// Of returns the kind whose payload body holds; false when it holds none.
func Of(body *agentv1.CommandBody) (Kind, bool) {
	m := body.ProtoReflect()
	fd := m.WhichOneof(m.Descriptor().Oneofs().ByName("kind"))
	if fd == nil {
		return Kind{}, false
	}
	k, ok := load().byField[fd.Name()]
	return k, ok
}

// Credits returns each lane's credits: how many commands of the lane a
// daemon runs at once.
func Credits() map[string]int { return maps.Clone(load().credits) }
