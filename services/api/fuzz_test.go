package api

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// fuzzMarshaler is the REST gateway's marshaler (see [Server.Gateway]).
var fuzzMarshaler = RESTMarshaler()

// requestTypes are the input messages of every compute.v1 method, by name.
func requestTypes(tb testing.TB) map[string]protoreflect.MessageType {
	tb.Helper()
	_ = computev1.File_bettercompute_compute_v1_pools_proto // registered
	out := map[string]protoreflect.MessageType{}
	protoregistry.GlobalFiles.RangeFilesByPackage("bettercompute.compute.v1", func(fd protoreflect.FileDescriptor) bool {
		for i := range fd.Services().Len() {
			ms := fd.Services().Get(i).Methods()
			for j := range ms.Len() {
				in := ms.Get(j).Input()
				mt, err := protoregistry.GlobalTypes.FindMessageByName(in.FullName())
				if err != nil {
					tb.Fatalf("%s: %v", in.FullName(), err)
				}
				out[string(in.Name())] = mt
			}
		}
		return true
	})
	if len(out) < 20 {
		tb.Fatalf("found only %d request types", len(out))
	}
	return out
}

// decodeBody decodes a REST body the way the generated gateway handlers do
// (an empty body is an empty request).
func decodeBody(body []byte, m proto.Message) error {
	err := fuzzMarshaler.NewDecoder(bytes.NewReader(body)).Decode(m)
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// FuzzRequestBody decodes REST bodies into each compute.v1 request, with
// the server's JSON options: no panic; a body that does not decode is an
// error; one that does encodes (as the server writes JSON) and decodes back
// to the same message.
func FuzzRequestBody(f *testing.F) {
	types := requestTypes(f)
	for _, s := range [][2]string{
		{"PoolsServiceCreateRequest", `{"tenantId":"root","class":"gpu","name":"gpus","idempotencyKey":"k1"}`},
		{"PoolsServiceCreateRequest", `{"tenantId":"root","class":"vps-host","name":"gpus","labels":{"a":"b"}}`},
		{"PoolsServiceCreateRequest", `{"tenantId":"root","unknownField":1}`},
		{"PoolsServiceCreateRequest", `{"tenantId":"root"} trailing`},
		{"PoolsServiceCreateRequest", `{"tenantId":"root","class":"gpu","name":"p"}{"junk"`},
		{"PoolsServiceCreateRequest", "{\"tenantId\":\"root\"}\n\t "},
		{"PoolsServiceCreateRequest", `{"tenantId":"root","name":"\u0000","labels":{"a\u001b":"b\r\n"}}`},
		{"NodesServiceGetRequest", `{"tenantId":"root","nodeId":"\u0000"}`},
		{"AuditServiceVerifyRequest", `{"tenantId":"root"}`},
		{"CommandsServiceRunRequest", `{"tenantId":"acme","nodeId":"n1","kind":"logs.collect","payload":{"sources":["agent","agent"]}}`},
		{"CommandsServiceRunRequest", `{"tenantId":"acme","nodeId":"n1","kind":"inventory.refresh","payload":{"sections":["gpus"]},"notAfter":"2030-01-01T00:00:00Z"}`},
		{"CommandsServiceRunRequest", `{"payload":[1,2,{"a":null}],"notAfter":"not a time"}`},
		{"WebhooksServiceCreateRequest", `{"tenantId":"root","url":"https://example.com/hook","eventTypes":["pool.*","webhook.test"],"idempotencyKey":"w1"}`},
		{"WebhooksServiceUpdateRequest", `{"tenantId":"root","webhookId":"wh_1","enabled":false,"description":"paused"}`},
		{"WebhooksServiceUpdateRequest", `{"tenantId":"root","id":"wh_1","webhookId":"wh_2"}`},
		{"WebhooksServiceListDeliveriesRequest", `{"tenantId":"root","webhookId":"wh_1","state":"succeeded"}`},
		{"WebhooksServiceRedeliverRequest", `{"tenantId":"root","deliveryId":"nope"}`},
		{"NodesServiceUpdateRequest", `{"tenantId":"root","nodeId":"n1","labels":{"zone":"a"}}`},
		{"NodesServiceUpdateRequest", `{"tenantId":"root","id":"n1","labels":{"zone":"a"}}`},
		{"TenantsServiceCreateRequest", `{"name":"acme","parentId":"root"}`},
		{"TenantsServiceListRequest", `{"pageSize":-1,"pageToken":"\u0000"}`},
		{"TenantsServiceListRequest", ``},
		{"TenantsServiceListRequest", `null`},
		{"TenantsServiceListRequest", `{"pageSize":1e3}`},
		{"TenantsServiceListRequest", `{"pageSize":"12"}`},
		{"TenantsServiceListRequest", `{"pageSize":4294967296}`},
	} {
		if _, ok := types[s[0]]; !ok {
			f.Fatalf("no request type %s", s[0])
		}
		f.Add(s[0], []byte(s[1]))
	}
	names := make([]string, 0, len(types))
	for n := range types {
		names = append(names, n)
	}
	slices.Sort(names)
	f.Fuzz(func(t *testing.T, name string, body []byte) {
		mt, ok := types[name]
		if !ok {
			mt = types[names[len(name)%len(names)]]
		}
		m := mt.New().Interface()
		if err := decodeBody(body, m); err != nil {
			if err.Error() == "" {
				t.Fatal("an empty decode error")
			}
			return
		}
		js, err := fuzzMarshaler.Marshal(m)
		if err != nil {
			t.Fatalf("%s: a decoded request does not encode: %v", name, err)
		}
		m2 := mt.New().Interface()
		if err := decodeBody(js, m2); err != nil {
			t.Fatalf("%s: the server's own JSON %s does not decode: %v", name, js, err)
		}
		a, err1 := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		b, err2 := proto.MarshalOptions{Deterministic: true}.Marshal(m2)
		if err1 != nil || err2 != nil || !bytes.Equal(a, b) {
			t.Fatalf("%s: %s decodes to %v, its JSON %s to %v", name, body, m, js, m2)
		}
	})
}

// FuzzValidLabels checks the API's label and name validation: no panic, a
// refusal is INVALID_INPUT, and an accepted label key or name has the
// documented shape.
func FuzzValidLabels(f *testing.F) {
	for _, s := range [][2]string{{"zone", "a"}, {"example.com/gpu-model", "h100"}, {"", ""}, {"-a", "b"}, {"a/", "b"},
		{strings.Repeat("k", 63), strings.Repeat("v", 256)}, {strings.Repeat("k", 64), "v"}, {"k", strings.Repeat("v", 257)}, {"é", "\xff"}} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, k, v string) {
		for _, err := range []error{validLabels(map[string]string{k: v}), validName("name", k)} {
			if err != nil {
				if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput {
					t.Fatalf("%q=%q: %v, want INVALID_INPUT", k, v, err)
				}
			}
		}
		shaped := func(s string, upper bool, extra string, maxLen int) bool {
			if s == "" || len(s) > maxLen {
				return false
			}
			for i, r := range s {
				alnum := r < 0x80 && (r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || upper && r >= 'A' && r <= 'Z')
				if !alnum && (i == 0 || i == len(s)-1 || !strings.ContainsRune(extra, r)) {
					return false
				}
			}
			return true
		}
		if validLabels(map[string]string{k: v}) == nil && (!shaped(k, true, "._/-", 63) || len(v) > 256) {
			t.Fatalf("label %q=%q accepted", k, v)
		}
		if validName("name", k) == nil && !shaped(k, false, "-", 64) {
			t.Fatalf("name %q accepted", k)
		}
	})
}
