package api

import (
	"strings"
	"unicode"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/bettercompute/bettercompute/proto/agentrelease"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/providers"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// The one table of how big a request's fields may be, checked in one place
// (checkLimits, before any handler runs, before authentication and so
// before any lookup) for every request of every method: every string field,
// at any depth — google.protobuf.Struct payloads included — has a maximum,
// and so has every list and map. A field over its maximum is INVALID_INPUT
// naming it. Handlers may check tighter bounds of their own (a label's 256
// characters, a pool's description); nothing the network sends is
// unbounded.
//
// The same pass refuses control characters in every string — field, list
// element, map key and value (labels), Struct value: NUL, the other C0
// controls, DEL and the C1 controls (ESC, CR, LF, BEL: terminal and log
// injection; NUL: PostgreSQL refuses it in text). Only the multi-line text
// fields of textFields may hold tab, newline and carriage return, and no
// other control. Ids (fields named id, *_id, *_ids) have a shape: at most
// maxIDLength of letters, digits and '.', '_', '-', ':', '@'.
const (
	// defaultMaxString bounds a string field the table does not name.
	defaultMaxString = 1024
	// defaultMaxBytes bounds a bytes field.
	defaultMaxBytes = 64 << 10
	// defaultMaxList bounds a repeated field's elements.
	defaultMaxList = 10000
	// defaultMaxMap bounds a map field's entries.
	defaultMaxMap = 1000
	// maxDepth bounds message nesting (a Struct's nested values).
	maxDepth = 32
)

// maxStringByName overrides defaultMaxString for fields of a name, in any
// message; maxStringByField for one field of one message.
var (
	maxStringByName = map[protoreflect.Name]int{
		"page_token": 4096,
	}
	maxStringByField = map[protoreflect.FullName]int{
		"bettercompute.compute.v1.PoliciesServicePutRequest.body":          authz.MaxPolicyBytes,
		"bettercompute.compute.v1.WebhooksServiceCreateRequest.url":        2048,
		"bettercompute.compute.v1.WebhooksServiceUpdateRequest.url":        2048,
		"bettercompute.compute.v1.MetalServiceDeployRequest.cloud_init":    machines.MaxCloudInitBytes,
		"bettercompute.compute.v1.MachineImage.url":                        machines.MaxImageURLLen,
		"bettercompute.compute.v1.InstancesServiceCreateRequest.user_data": instances.MaxUserDataBytes,
		"bettercompute.compute.v1.InstancesServiceCreateRequest.ssh_keys":  instances.MaxSSHKeyLength,
		"bettercompute.compute.v1.ProviderSettings.endpoint":               providers.MaxEndpointLength,
		"bettercompute.compute.v1.ProviderSettings.token":                  providers.MaxTokenLength,
		"bettercompute.compute.v1.MachineBMC.ca_pem":                       sitetasks.MaxCAPEM,
		"bettercompute.compute.v1.PoolAgentSettings.release_manifest":      agentrelease.MaxManifestBytes,
	}
)

// textFields may hold tab, newline and carriage return (multi-line text);
// every other string field is one line of printable text.
var textFields = map[protoreflect.FullName]bool{
	"bettercompute.compute.v1.PoliciesServicePutRequest.body":          true,
	"bettercompute.compute.v1.MetalServiceDeployRequest.cloud_init":    true,
	"bettercompute.compute.v1.InstancesServiceCreateRequest.user_data": true,
	"bettercompute.compute.v1.MachineBMC.ca_pem":                       true,
	"bettercompute.compute.v1.PoolAgentSettings.release_manifest":      true,
}

// maxIDLength bounds an id field (a tenant id's 200 characters).
const maxIDLength = 200

// checkLimits walks req and refuses the first field over its maximum.
func checkLimits(req any) error {
	m, ok := req.(proto.Message)
	if !ok {
		return nil
	}
	return walkLimits(m.ProtoReflect(), "", 0)
}

func walkLimits(m protoreflect.Message, path string, depth int) error {
	if depth > maxDepth {
		return fault.New(fault.InvalidInput, path, "nested more than %d deep", maxDepth)
	}
	// Inside a google.protobuf.Struct (a command's payload, say) errors
	// name the field that holds it.
	wellKnown := m.Descriptor().FullName().Parent() == "google.protobuf"
	var err error
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		p := fd.JSONName()
		switch {
		case wellKnown:
			p = path
		case path != "":
			p = path + "." + p
		}
		switch {
		case fd.IsList():
			l := v.List()
			if l.Len() > defaultMaxList {
				err = fault.New(fault.InvalidInput, p, "at most %d elements, got %d", defaultMaxList, l.Len())
				return false
			}
			for i := range l.Len() {
				if err = checkValue(fd, l.Get(i), p, depth); err != nil {
					return false
				}
			}
		case fd.IsMap():
			mp := v.Map()
			if mp.Len() > defaultMaxMap {
				err = fault.New(fault.InvalidInput, p, "at most %d entries, got %d", defaultMaxMap, mp.Len())
				return false
			}
			mp.Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				if s, ok := k.Interface().(string); ok {
					if len(s) > defaultMaxString {
						err = fault.New(fault.InvalidInput, p, "a key longer than %d characters", defaultMaxString)
						return false
					}
					if err = checkText(s, false, p, "a key"); err != nil {
						return false
					}
				}
				vp := p
				if key, ok := k.Interface().(string); ok && wellKnown {
					vp = path + "." + key // a Struct's field by its name
					if path == "" {
						vp = key
					}
				}
				err = checkValue(fd.MapValue(), mv, vp, depth)
				return err == nil
			})
			if err != nil {
				return false
			}
		default:
			err = checkValue(fd, v, p, depth)
		}
		return err == nil
	})
	return err
}

// checkValue checks one value of field fd (an element, for lists and maps).
func checkValue(fd protoreflect.FieldDescriptor, v protoreflect.Value, path string, depth int) error {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if limit := maxString(fd); len(v.String()) > limit {
			return fault.New(fault.InvalidInput, path, "at most %d characters, got %d", limit, len(v.String()))
		}
		if err := checkText(v.String(), textFields[fd.FullName()], path, "the value"); err != nil {
			return err
		}
		if isID(fd) && !validID(v.String()) {
			return fault.New(fault.InvalidInput, path, "%q is not an id (at most %d letters, digits, '.', '_', '-', ':', '@')", v.String(), maxIDLength)
		}
	case protoreflect.BytesKind:
		if len(v.Bytes()) > defaultMaxBytes {
			return fault.New(fault.InvalidInput, path, "at most %d bytes, got %d", defaultMaxBytes, len(v.Bytes()))
		}
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return walkLimits(v.Message(), path, depth+1)
	}
	return nil
}

func maxString(fd protoreflect.FieldDescriptor) int {
	if n, ok := maxStringByField[fd.FullName()]; ok {
		return n
	}
	if n, ok := maxStringByName[fd.Name()]; ok {
		return n
	}
	return defaultMaxString
}

// checkText refuses a control character in s: any (C0, DEL, C1), or any
// but tab, newline and carriage return when multiline.
func checkText(s string, multiline bool, path, what string) error {
	for i, r := range s {
		if !unicode.IsControl(r) || (multiline && (r == '\t' || r == '\n' || r == '\r')) {
			continue
		}
		return fault.New(fault.InvalidInput, path, "%s holds a control character (%U at byte %d); only printable text is accepted", what, r, i)
	}
	return nil
}

// isID reports whether fd holds ids: a field named id or ending in _id or
// _ids, outside google.protobuf's messages (a Struct's keys are free).
func isID(fd protoreflect.FieldDescriptor) bool {
	if fd.ContainingMessage() != nil && fd.ContainingMessage().FullName().Parent() == "google.protobuf" {
		return false
	}
	n := string(fd.Name())
	return n == "id" || strings.HasSuffix(n, "_id") || strings.HasSuffix(n, "_ids")
}

// validID reports whether s has an id's shape (empty is for the handler:
// required or not).
func validID(s string) bool {
	if len(s) > maxIDLength {
		return false
	}
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == '-', r == ':', r == '@':
		default:
			return false
		}
	}
	return true
}
