package nodespec

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Node is what a contributor knows of the node it contributes to.
type Node struct {
	ID       string
	TenantID string
	PoolID   string
	State    string
	Labels   map[string]string
}

// ContributeFunc returns a module's part of node's desired state: a NodeSpec
// with only the sections (for site, the fields) the module owns set; nil
// contributes nothing. It reads through q, the controller's transaction.
type ContributeFunc func(ctx context.Context, q reconcile.Querier, node Node) (*agentv1.NodeSpec, error)

// BatchContributeFunc is a [ContributeFunc] for many nodes at once, for a
// module whose part reads the same rows for many nodes (a pool's settings)
// or can read every node's in one statement: it returns one part per node,
// in order (nil contributes nothing).
type BatchContributeFunc func(ctx context.Context, q reconcile.Querier, nodes []Node) ([]*agentv1.NodeSpec, error)

// Part is one module's contribution.
type Part struct {
	Module string
	Spec   *agentv1.NodeSpec
}

// ConflictError is two modules setting the same site field to different
// values.
type ConflictError struct {
	// Field is the field's path, e.g. "site.ntp_servers".
	Field string
	// First set it first; Second then set it differently.
	First, Second string
}

func (e *ConflictError) Error() string {
	return fmt.Sprintf("conflicting desired state: modules %q and %q both set %s to different values", e.First, e.Second, e.Field)
}

// Registry holds the contributors, in registration order.
type Registry struct {
	names []string
	fns   []BatchContributeFunc
}

var moduleName = regexp.MustCompile(`^[a-z][a-z0-9.-]*$`)

// Register adds module's contributor after those already registered. Call
// it before the controller runs.
func (r *Registry) Register(module string, fn ContributeFunc) error {
	if fn == nil {
		return fmt.Errorf("nodespec: bad contributor %q", module)
	}
	return r.RegisterBatch(module, func(ctx context.Context, q reconcile.Querier, nodes []Node) ([]*agentv1.NodeSpec, error) {
		out := make([]*agentv1.NodeSpec, len(nodes))
		for i, n := range nodes {
			var err error
			if out[i], err = fn(ctx, q, n); err != nil {
				return nil, err
			}
		}
		return out, nil
	})
}

// RegisterBatch adds module's batch contributor after those already
// registered. Call it before the controller runs.
func (r *Registry) RegisterBatch(module string, fn BatchContributeFunc) error {
	if !moduleName.MatchString(module) || fn == nil {
		return fmt.Errorf("nodespec: bad contributor %q", module)
	}
	for _, n := range r.names {
		if n == module {
			return fmt.Errorf("nodespec: contributor %q registered twice", module)
		}
	}
	r.names = append(r.names, module)
	r.fns = append(r.fns, fn)
	return nil
}

// Modules returns the registered modules, in order.
func (r *Registry) Modules() []string { return append([]string(nil), r.names...) }

// Compute asks every contributor for its part of node's spec and merges
// them ([Merge]). A merge conflict is a *[ConflictError].
func (r *Registry) Compute(ctx context.Context, q reconcile.Querier, node Node) (*agentv1.NodeSpec, error) {
	out, err := r.ComputeBatch(ctx, q, []Node{node})
	if err != nil {
		return nil, err
	}
	return out[0].Spec, out[0].Err
}

// Computed is one node's outcome of [Registry.ComputeBatch].
type Computed struct {
	Spec *agentv1.NodeSpec
	// Err is the node's merge conflict (a *[ConflictError]), if any.
	Err error
}

// ComputeBatch is [Registry.Compute] for many nodes: every contributor is
// asked once for all of them. A contributor's error fails the batch; a
// merge conflict is the node's own (Computed.Err).
func (r *Registry) ComputeBatch(ctx context.Context, q reconcile.Querier, nodes []Node) ([]Computed, error) {
	parts := make([][]Part, len(nodes))
	for i, fn := range r.fns {
		specs, err := fn(ctx, q, nodes)
		if err != nil {
			return nil, fmt.Errorf("contributor %s: %w", r.names[i], err)
		}
		if len(specs) != len(nodes) {
			return nil, fmt.Errorf("contributor %s: %d parts for %d nodes", r.names[i], len(specs), len(nodes))
		}
		for j, spec := range specs {
			parts[j] = append(parts[j], Part{Module: r.names[i], Spec: spec})
		}
	}
	out := make([]Computed, len(nodes))
	for j := range nodes {
		out[j].Spec, out[j].Err = Merge(parts[j])
	}
	return out, nil
}

// Merge merges parts in order: a section a later part sets replaces the
// earlier one whole, except site, whose fields merge one by one. A site
// field set by two parts to different values is a *[ConflictError] naming
// the field and both modules; the same value twice is not a conflict.
func Merge(parts []Part) (*agentv1.NodeSpec, error) {
	out := &agentv1.NodeSpec{}
	dst := out.ProtoReflect()
	siteFD := dst.Descriptor().Fields().ByName("site")
	var site *agentv1.SiteSettings
	owner := map[protoreflect.Name]string{}
	for _, p := range parts {
		if p.Spec == nil {
			continue
		}
		var err error
		p.Spec.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			if fd != siteFD {
				dst.Set(fd, protoreflect.ValueOfMessage(proto.Clone(v.Message().Interface()).ProtoReflect()))
				return true
			}
			if site == nil {
				site = &agentv1.SiteSettings{}
			}
			err = mergeSite(site, v.Message(), p.Module, owner)
			return err == nil
		})
		if err != nil {
			return nil, err
		}
	}
	if site != nil {
		out.Site = site
	}
	return out, nil
}

// mergeSite sets every field src sets on dst, recording module as its owner;
// a field another module already set differently is a conflict.
func mergeSite(dst *agentv1.SiteSettings, src protoreflect.Message, module string, owner map[protoreflect.Name]string) error {
	d := dst.ProtoReflect()
	var err error
	src.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if d.Has(fd) && !equalValue(fd, d.Get(fd), v) {
			err = &ConflictError{Field: "site." + string(fd.Name()), First: owner[fd.Name()], Second: module}
			return false
		}
		if !d.Has(fd) {
			owner[fd.Name()] = module
		}
		if fd.Message() != nil {
			v = protoreflect.ValueOfMessage(proto.Clone(v.Message().Interface()).ProtoReflect())
		}
		d.Set(fd, v)
		return true
	})
	return err
}

func equalValue(fd protoreflect.FieldDescriptor, a, b protoreflect.Value) bool {
	if fd.Message() != nil {
		return proto.Equal(a.Message().Interface(), b.Message().Interface())
	}
	return a.Equal(b)
}

// Canonical returns spec's canonical JSON: its proto3 JSON (protojson, JSON
// names, unpopulated fields omitted) re-encoded through encoding/json, which
// sorts object keys and drops the whitespace protojson deliberately varies.
// Equal specs give equal bytes, across processes and releases of protojson;
// it is what nodes.spec stores and what decides whether the generation moves.
func Canonical(spec *agentv1.NodeSpec) ([]byte, error) {
	b, err := protojson.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("encode spec: %w", err)
	}
	return CanonicalJSON(b)
}

// CanonicalJSON re-encodes a JSON document with sorted keys and no
// whitespace, keeping numbers as written: the canonical form of a spec read
// back from nodes.spec (jsonb reorders keys and adds spaces).
func CanonicalJSON(b []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("canonical JSON: %w", err)
	}
	if dec.More() {
		return nil, errors.New("canonical JSON: trailing data")
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("canonical JSON: %w", err)
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}
