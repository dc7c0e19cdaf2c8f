package api

import (
	"errors"
	"os"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// TestRequestFieldNames holds every request of every method to the naming
// rule: no request names the resource it acts on by a bare "id" (it says
// node_id, pool_id, …); an "id" or any other deprecated field is the old
// name of a renamed field, listed in Renamed and accepted until
// RenamedUntil.
func TestRequestFieldNames(t *testing.T) {
	t.Parallel()
	types := requestTypes(t)
	listed := map[protoreflect.FullName]map[protoreflect.Name]protoreflect.Name{}
	for _, r := range Renamed {
		full := protoreflect.FullName(APIPackage).Append(r.Message)
		if listed[full] == nil {
			listed[full] = map[protoreflect.Name]protoreflect.Name{}
		}
		listed[full][r.Old] = r.New
	}
	for name, mt := range types {
		md := mt.Descriptor()
		for i := range md.Fields().Len() {
			fd := md.Fields().Get(i)
			to, isListed := listed[md.FullName()][fd.Name()]
			switch {
			case fd.Name() == "id" && !deprecated(fd):
				t.Errorf("%s.id: a request names its resource <resource>_id (node_id, pool_id, …), not id", name)
			case deprecated(fd) && !isListed:
				t.Errorf("%s.%s is deprecated but not in Renamed: add the field that replaced it", name, fd.Name())
			case isListed && !strings.HasSuffix(string(to), "_id"):
				t.Errorf("%s.%s is renamed to %s, which does not end in _id", name, fd.Name(), to)
			}
		}
	}
	// Every entry is a request of a served method.
	for full := range listed {
		if _, ok := types[string(full.Name())]; !ok {
			t.Errorf("Renamed lists %s, which no method takes", full)
		}
	}
}

// TestIndexRenamedRefusesBadEntries: an entry the protos contradict fails
// the index (and so the package's initialization), naming it.
func TestIndexRenamedRefusesBadEntries(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		entry RenamedField
		want  string
	}{
		{"no such message", RenamedField{"NoSuchRequest", "id", "node_id"}, "NoSuchRequest"},
		{"no such field", RenamedField{"NodesServiceGetRequest", "id", "nodeid"}, "no field"},
		{"old name not deprecated", RenamedField{"NodesServiceGetRequest", "tenant_id", "node_id"}, "not [deprecated = true]"},
		{"new name deprecated", RenamedField{"NodesServiceGetRequest", "id", "id"}, "is deprecated"},
		{"different types", RenamedField{"NodesServiceUpdateRequest", "id", "labels"}, "differ in type"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := indexRenamed([]RenamedField{tc.entry})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestNormalizeRenamed(t *testing.T) {
	t.Parallel()
	t.Run("the old name moves to the new one and is cleared", func(t *testing.T) {
		t.Parallel()
		req := &computev1.NodesServiceGetRequest{TenantId: "root", Id: "node_a"} //nolint:staticcheck // the deprecated field, on purpose
		used, err := normalizeRenamed(req)
		if err != nil || !slices.Equal(used, []string{"id"}) {
			t.Fatalf("used %v err %v", used, err)
		}
		if req.GetNodeId() != "node_a" || req.GetId() != "" { //nolint:staticcheck // the deprecated field, on purpose
			t.Fatalf("got nodeId %q id %q", req.GetNodeId(), req.GetId()) //nolint:staticcheck // the deprecated field, on purpose
		}
	})
	t.Run("the new name alone is left alone", func(t *testing.T) {
		t.Parallel()
		req := &computev1.PoolsServiceGetRequest{TenantId: "root", PoolId: "pool_a"}
		used, err := normalizeRenamed(req)
		if err != nil || len(used) != 0 || req.GetPoolId() != "pool_a" {
			t.Fatalf("used %v err %v req %v", used, err, req)
		}
	})
	t.Run("both names, the same value", func(t *testing.T) {
		t.Parallel()
		req := &computev1.WebhooksServiceTestRequest{TenantId: "root", WebhookId: "wh_a", Id: "wh_a"} //nolint:staticcheck // the deprecated field, on purpose
		used, err := normalizeRenamed(req)
		if err != nil || len(used) != 1 || req.GetWebhookId() != "wh_a" || req.GetId() != "" { //nolint:staticcheck // the deprecated field, on purpose
			t.Fatalf("used %v err %v req %v", used, err, req)
		}
	})
	t.Run("both names, different values, is INVALID_INPUT on the new one", func(t *testing.T) {
		t.Parallel()
		req := &computev1.ReservationsServiceReleaseRequest{TenantId: "root", ReservationId: "rsv_a", Id: "rsv_b"} //nolint:staticcheck // the deprecated field, on purpose
		_, err := normalizeRenamed(req)
		fe, ok := fault.As(err)
		if !ok || fe.Code != fault.InvalidInput || fe.Field != "reservationId" {
			t.Fatalf("got %v", err)
		}
		if !strings.Contains(fe.Message, "rsv_a") || !strings.Contains(fe.Message, "rsv_b") {
			t.Fatalf("the message should show both values: %s", fe.Message)
		}
	})
	t.Run("a request without renamed fields", func(t *testing.T) {
		t.Parallel()
		req := &computev1.CommandsServiceGetRequest{TenantId: "root", NodeId: "node_a", CommandId: "cmd_a"}
		before := proto.Clone(req)
		used, err := normalizeRenamed(req)
		if err != nil || len(used) != 0 || !proto.Equal(before, req) {
			t.Fatalf("used %v err %v req %v", used, err, req)
		}
	})
	t.Run("every entry of the table", func(t *testing.T) {
		t.Parallel()
		for full, rs := range renamedIndex {
			for _, r := range rs {
				mt := requestTypes(t)[string(full.Name())]
				m := mt.New()
				m.Set(r.old, protoreflect.ValueOfString("x_1"))
				if _, err := normalizeRenamed(m.Interface()); err != nil {
					t.Fatalf("%s: %v", full, err)
				}
				if m.Get(r.new).String() != "x_1" || m.Has(r.old) {
					t.Fatalf("%s: %s not moved to %s", full, r.old.Name(), r.new.Name())
				}
			}
		}
	})
}

func TestRenameErrField(t *testing.T) {
	t.Parallel()
	req := &computev1.ApiKeysServiceRevokeRequest{TenantId: "root", ApiKeyId: "k"}
	cause := fault.New(fault.NotFound, "id", "API key %q not found", "k")
	fe, ok := fault.As(renameErrField(req, cause))
	if !ok || fe.Code != fault.NotFound || fe.Field != "apiKeyId" || fe.Message != cause.Message {
		t.Fatalf("got %v", fe)
	}
	other := fault.New(fault.InvalidInput, "tenantId", "bad")
	if got := renameErrField(req, other); !errors.Is(got, other) || fault.CodeOf(got) != fault.InvalidInput {
		t.Fatalf("an error on another field changed: %v", got)
	}
	// A request without renamed fields keeps its errors' fields.
	if fe, _ := fault.As(renameErrField(&computev1.CommandsServiceGetRequest{}, cause)); fe.Field != "id" {
		t.Fatalf("got %v", fe)
	}
}

// TestRenamedFieldsDocumented: docs/api.md's "Deprecated request fields"
// table has a row for every method with a renamed field, naming the new
// field, and gives the release the old names go away in.
func TestRenamedFieldsDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/api.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(doc), "## Deprecated request fields\n")
	if !ok {
		t.Fatal("docs/api.md has no section Deprecated request fields")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	if !strings.Contains(section, RenamedUntil) {
		t.Errorf("the section does not say the old names go away in %s", RenamedUntil)
	}
	lowerFirst := func(s string) string { return strings.ToLower(s[:1]) + s[1:] }
	n := 0
	protoregistry.GlobalFiles.RangeFilesByPackage(APIPackage, func(fd protoreflect.FileDescriptor) bool {
		for i := range fd.Services().Len() {
			svc := fd.Services().Get(i)
			for j := range svc.Methods().Len() {
				m := svc.Methods().Get(j)
				for _, r := range renamedIndex[m.Input().FullName()] {
					n++
					name := "`" + lowerFirst(strings.TrimSuffix(string(svc.Name()), "Service")) + "." + lowerFirst(string(m.Name())) + "`"
					row := ""
					for l := range strings.Lines(section) {
						if strings.HasPrefix(l, "| ") && strings.Contains(l, name) {
							row = l
						}
					}
					if !strings.Contains(row, "`"+r.new.JSONName()+"`") || !strings.Contains(row, "`"+r.old.JSONName()+"`") {
						t.Errorf("docs/api.md: no row for %s naming %s instead of %s", name, r.new.JSONName(), r.old.JSONName())
					}
				}
			}
		}
		return true
	})
	if n != len(Renamed) {
		t.Errorf("%d renamed fields reached through methods, %d in Renamed", n, len(Renamed))
	}
}
