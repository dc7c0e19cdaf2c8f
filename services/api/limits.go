package api

import (
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/providers"
)

// The one table of how big a request's fields may be, checked in one place
// (checkLimits, before any handler runs) for every request of every method:
// every string field, at any depth — google.protobuf.Struct payloads
// included — has a maximum, and so has every list and map. A field over its
// maximum is INVALID_INPUT naming it. Handlers may check tighter bounds of
// their own (a label's 256 characters, a pool's description); nothing the
// network sends is unbounded.
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
	}
)

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
				if s, ok := k.Interface().(string); ok && len(s) > defaultMaxString {
					err = fault.New(fault.InvalidInput, p, "a key longer than %d characters", defaultMaxString)
					return false
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
