package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Request fields are named by one rule: a request names the resource it acts
// on by <resource>_id (node_id, pool_id, reservation_id, …; JSON nodeId,
// poolId, …), never by a bare id. The fields that were a bare id were
// renamed keeping their field number, so binary gRPC clients are unaffected;
// each message also keeps the old name as a new field marked
// [deprecated = true], so JSON clients that send "id" are accepted for one
// release (RenamedUntil).
//
// Renamed is the one table of those fields: the request message, the old
// (deprecated) field and the field that replaced it. Before every handler
// (and before the field limits) normalizeRenamed moves an old field's value
// into its new field and clears the old one, so handlers only ever read the
// new name; both set to different values is INVALID_INPUT naming the new
// field. Each use of an old name is counted in
// bc_api_deprecated_fields_total{method,field}, logged at debug, and answered
// with the metadata (REST: header) "Deprecation: true".
//
// The table is checked against the compiled descriptors when the package is
// initialized (see renamedIndex), and a test asserts that no request message
// of bettercompute.compute.v1 has a bare id that is not a deprecated entry
// here.
var Renamed = []RenamedField{
	{"ApiKeysServiceRevokeRequest", "id", "api_key_id"},
	{"IdentitiesServiceRevokeRequest", "id", "identity_id"},
	{"JoinTokensServiceRevokeRequest", "id", "join_token_id"},
	{"NodesServiceGetRequest", "id", "node_id"},
	{"NodesServiceGetSpecRequest", "id", "node_id"},
	{"NodesServiceRevokeRequest", "id", "node_id"},
	{"NodesServiceUpdateRequest", "id", "node_id"},
	{"PoolsServiceGetRequest", "id", "pool_id"},
	{"PoolsServiceUpdateRequest", "id", "pool_id"},
	{"ReservationsServiceGetRequest", "id", "reservation_id"},
	{"ReservationsServiceReleaseRequest", "id", "reservation_id"},
	{"TenantsServiceCreateRequest", "id", "child_tenant_id"},
	{"WebhooksServiceDeleteRequest", "id", "webhook_id"},
	{"WebhooksServiceGetRequest", "id", "webhook_id"},
	{"WebhooksServiceRotateSecretRequest", "id", "webhook_id"},
	{"WebhooksServiceTestRequest", "id", "webhook_id"},
	{"WebhooksServiceUpdateRequest", "id", "webhook_id"},
}

// RenamedUntil is the release that stops accepting the old names of
// [Renamed].
const RenamedUntil = "v0.2.0"

// DeprecationHeader is the response metadata (REST: header, "Deprecation:
// true") of a request that used a deprecated field name.
const DeprecationHeader = "deprecation"

// RenamedField is one renamed request field, by proto names: Message (in
// package bettercompute.compute.v1), the Old field (deprecated, still
// accepted) and the New one handlers read.
type RenamedField struct {
	Message  protoreflect.Name
	Old, New protoreflect.Name
}

// renamed is one entry of [Renamed] resolved to its descriptors.
type renamed struct {
	old, new protoreflect.FieldDescriptor
}

// renamedIndex is [Renamed] by message full name. Building it panics on an
// entry the compiled protos contradict (a missing message or field, an old
// field that is not deprecated, a new one that is, different kinds): a
// mistake in the table fails every test and every start, not one request.
var renamedIndex = func() map[protoreflect.FullName][]renamed {
	idx, err := indexRenamed(Renamed)
	if err != nil {
		panic(err)
	}
	return idx
}()

func indexRenamed(table []RenamedField) (map[protoreflect.FullName][]renamed, error) {
	idx := map[protoreflect.FullName][]renamed{}
	for _, r := range table {
		full := protoreflect.FullName(APIPackage).Append(r.Message)
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(full)
		if err != nil {
			return nil, fmt.Errorf("renamed field %s.%s: %w", full, r.Old, err)
		}
		md, ok := d.(protoreflect.MessageDescriptor)
		if !ok {
			return nil, fmt.Errorf("renamed field: %s is not a message", full)
		}
		old, nw := md.Fields().ByName(r.Old), md.Fields().ByName(r.New)
		switch {
		case old == nil || nw == nil:
			return nil, fmt.Errorf("renamed field: %s has no field %s or %s", full, r.Old, r.New)
		case !deprecated(old):
			return nil, fmt.Errorf("renamed field: %s.%s is not [deprecated = true]", full, r.Old)
		case deprecated(nw):
			return nil, fmt.Errorf("renamed field: %s.%s, the new name, is deprecated", full, r.New)
		case old.Kind() != nw.Kind() || old.Cardinality() != nw.Cardinality() || old.HasPresence() != nw.HasPresence():
			return nil, fmt.Errorf("renamed field: %s.%s and %s differ in type", full, r.Old, r.New)
		}
		idx[full] = append(idx[full], renamed{old: old, new: nw})
	}
	return idx, nil
}

// deprecated reports whether fd is marked [deprecated = true].
func deprecated(fd protoreflect.FieldDescriptor) bool {
	o, ok := fd.Options().(*descriptorpb.FieldOptions)
	return ok && o.GetDeprecated()
}

// normalizeRenamed moves the value of every deprecated field of req (see
// [Renamed]) into the field that replaced it and clears the old one. It
// returns the old fields' JSON names that were set; both names set to
// different values is INVALID_INPUT naming the new field.
func normalizeRenamed(req any) ([]string, error) {
	pm, ok := req.(proto.Message)
	if !ok {
		return nil, nil
	}
	m := pm.ProtoReflect()
	var used []string
	for _, r := range renamedIndex[m.Descriptor().FullName()] {
		if !m.Has(r.old) {
			continue
		}
		ov := m.Get(r.old)
		if m.Has(r.new) && !m.Get(r.new).Equal(ov) {
			return nil, fault.New(fault.InvalidInput, r.new.JSONName(),
				"%s %q and the deprecated %s %q differ: send %s only", r.new.JSONName(), m.Get(r.new).String(), r.old.JSONName(), ov.String(), r.new.JSONName())
		}
		m.Set(r.new, ov)
		m.Clear(r.old)
		used = append(used, r.old.JSONName())
	}
	return used, nil
}

// deprecations counts, logs and answers the use of deprecated field names.
type deprecations struct {
	logger *slog.Logger
	total  *prometheus.CounterVec
}

func newDeprecations(logger *slog.Logger, reg prometheus.Registerer) (*deprecations, error) {
	d := &deprecations{logger: logger, total: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "bc_api_deprecated_fields_total",
		Help: "Requests that named a field by its deprecated name, by method and the old field's JSON name; those names stop being accepted in " + RenamedUntil + ".",
	}, []string{"method", "field"})}
	if reg == nil {
		return d, nil
	}
	if err := reg.Register(d.total); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("api metrics: %w", err)
		}
		d.total = are.ExistingCollector.(*prometheus.CounterVec)
	}
	return d, nil
}

// unary is the interceptor of renamed fields, before every other check
// (authentication, the field limits) and every handler: it moves deprecated
// field names to their new ones, counts and logs their use and marks the
// response deprecated; an error the handler (or a store under it) returns
// naming the old field, say NOT_FOUND on "id", names the new one.
func (d *deprecations) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	used, err := normalizeRenamed(req)
	if err != nil {
		return nil, err
	}
	if len(used) > 0 {
		for _, f := range used {
			d.total.WithLabelValues(info.FullMethod, f).Inc()
		}
		d.logger.DebugContext(ctx, "deprecated request field", "method", info.FullMethod, "fields", used, "until", RenamedUntil)
		_ = grpc.SetHeader(ctx, metadata.Pairs(DeprecationHeader, "true"))
	}
	resp, err := handler(ctx, req)
	if err != nil {
		err = renameErrField(req, err)
	}
	return resp, err
}

// renameErrField makes an error that names a renamed field of req by its
// old name (stores say "id") name the new one.
func renameErrField(req any, err error) error {
	pm, ok := req.(proto.Message)
	if !ok {
		return err
	}
	fe, ok := fault.As(err)
	if !ok {
		return err
	}
	for _, r := range renamedIndex[pm.ProtoReflect().Descriptor().FullName()] {
		if fe.Field == r.old.JSONName() {
			return &fault.Error{Code: fe.Code, Field: r.new.JSONName(), Message: fe.Message, Err: err}
		}
	}
	return err
}
