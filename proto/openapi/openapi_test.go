package openapi

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	// Registers the bettercompute.compute.v1 descriptors.
	_ "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
)

type swaggerDoc struct {
	Swagger string                     `json:"swagger"`
	Paths   map[string]json.RawMessage `json:"paths"`
}

func parse(t *testing.T) swaggerDoc {
	t.Helper()
	var doc swaggerDoc
	if err := json.Unmarshal(Document(), &doc); err != nil {
		t.Fatalf("embedded %s is not JSON: %v", FileName, err)
	}
	return doc
}

func TestDocument(t *testing.T) {
	doc := parse(t)
	if doc.Swagger != "2.0" {
		t.Errorf("swagger = %q, want 2.0", doc.Swagger)
	}
	d := Document()
	d[0] = 'x'
	if Document()[0] == 'x' {
		t.Error("Document returned shared memory")
	}
}

// TestV3Document: the OpenAPI 3 document is converted from this Swagger
// document (tools/cmd/openapi3), so it has the same paths.
func TestV3Document(t *testing.T) {
	var v3 struct {
		OpenAPI string                     `json:"openapi"`
		Paths   map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(V3Document(), &v3); err != nil {
		t.Fatalf("embedded %s is not JSON: %v", V3FileName, err)
	}
	if !strings.HasPrefix(v3.OpenAPI, "3.") {
		t.Errorf("openapi = %q, want 3.x", v3.OpenAPI)
	}
	v2 := parse(t)
	if len(v3.Paths) != len(v2.Paths) {
		t.Errorf("%s has %d paths, %s %d: run make proto", V3FileName, len(v3.Paths), FileName, len(v2.Paths))
	}
	for p := range v2.Paths {
		if _, ok := v3.Paths[p]; !ok {
			t.Errorf("%s missing from %s: run make proto", p, V3FileName)
		}
	}
	d := V3Document()
	d[0] = 'x'
	if V3Document()[0] == 'x' {
		t.Error("V3Document returned shared memory")
	}
}

func lowerFirst(s string) string {
	r, n := utf8.DecodeRuneInString(s)
	return string(unicode.ToLower(r)) + s[n:]
}

// TestEveryMethodHasRoute checks that every RPC of every
// bettercompute.compute.v1 service has its rule in http.yaml, following the
// convention POST /api/compute/{group}/{method}, where group is the service
// name without "Service" and both are lowerCamelCase (JoinTokensService.Create
// is /api/compute/joinTokens/create). grpc-gateway silently skips an RPC
// without a rule, so this is where a forgotten rule shows.
func TestEveryMethodHasRoute(t *testing.T) {
	doc := parse(t)
	want := map[string]bool{}
	protoregistry.GlobalFiles.RangeFilesByPackage("bettercompute.compute.v1", func(fd protoreflect.FileDescriptor) bool {
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			group := lowerFirst(strings.TrimSuffix(string(sd.Name()), "Service"))
			for j := 0; j < sd.Methods().Len(); j++ {
				md := sd.Methods().Get(j)
				if md.IsStreamingClient() {
					continue // grpc-gateway maps server streaming (as newline-delimited JSON) only
				}
				want["/api/compute/"+group+"/"+lowerFirst(string(md.Name()))] = true
			}
		}
		return true
	})
	if len(want) == 0 {
		t.Fatal("no bettercompute.compute.v1 methods registered")
	}
	for p := range want {
		raw, ok := doc.Paths[p]
		if !ok {
			t.Errorf("%s missing from %s: add its rule to proto/bettercompute/compute/v1/http.yaml", p, FileName)
			continue
		}
		var item map[string]json.RawMessage
		if err := json.Unmarshal(raw, &item); err != nil {
			t.Fatal(err)
		}
		if _, ok := item["post"]; !ok || len(item) != 1 {
			t.Errorf("%s: want POST only, got %v", p, keys(item))
		}
	}
	for p := range doc.Paths {
		if !want[p] {
			t.Errorf("%s in %s matches no RPC by the naming convention", p, FileName)
		}
	}
}

func keys(m map[string]json.RawMessage) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}
