package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// repoRoot is the repository root, from this package's directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// TestCommittedDocumentIsFresh: proto/openapi/compute.openapi.json is what
// this converter makes of the committed Swagger document with api.json, so
// an edit to either without make proto fails here as well as in
// proto-check.
func TestCommittedDocumentIsFresh(t *testing.T) {
	root := repoRoot(t)
	swagger, err := os.ReadFile(filepath.Join(root, "proto", "openapi", "compute.swagger.json"))
	if err != nil {
		t.Fatal(err)
	}
	committed, err := os.ReadFile(filepath.Join(root, "proto", "openapi", "compute.openapi.json"))
	if err != nil {
		t.Fatal(err)
	}
	d, err := Declared()
	if err != nil {
		t.Fatal(err)
	}
	got, err := Convert(swagger, d)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, committed) {
		t.Fatal("proto/openapi/compute.openapi.json is stale: run make proto")
	}
}

// small is a Swagger 2.0 document shaped like protoc-gen-openapiv2's: an
// anonymous method, one that needs a key, and a server-streaming one.
const small = `{
  "swagger": "2.0",
  "info": {"title": "t", "version": "v1"},
  "consumes": ["application/json"], "produces": ["application/json"],
  "paths": {
    "/api/compute/system/version": {"post": {"operationId": "SystemService_Version",
      "parameters": [{"name": "body", "in": "body", "required": true, "schema": {"$ref": "#/definitions/VersionRequest"}}],
      "responses": {"200": {"description": "ok", "schema": {"$ref": "#/definitions/VersionRequest"}},
                    "default": {"description": "err", "schema": {"$ref": "#/definitions/Status"}}}}},
    "/api/compute/nodes/get": {"post": {"operationId": "NodesService_Get",
      "parameters": [{"name": "body", "in": "body", "required": true, "schema": {"$ref": "#/definitions/Node"}}],
      "responses": {"200": {"description": "ok", "schema": {"$ref": "#/definitions/Node"}},
                    "default": {"description": "err", "schema": {"$ref": "#/definitions/Status"}}}}},
    "/api/compute/events/watch": {"post": {"operationId": "EventsService_Watch",
      "parameters": [{"name": "body", "in": "body", "required": true, "schema": {"$ref": "#/definitions/Node"}}],
      "responses": {"200": {"description": "ok", "schema": {"type": "object", "properties": {
                      "result": {"$ref": "#/definitions/Node"}, "error": {"$ref": "#/definitions/Status"}}}},
                    "default": {"description": "err", "schema": {"$ref": "#/definitions/Status"}}}}}
  },
  "definitions": {
    "VersionRequest": {"type": "object"},
    "Node": {"type": "object", "properties": {"id": {"type": "string"}, "spec": {"type": "object"}}},
    "Any": {"type": "object", "properties": {"@type": {"type": "string"}}, "additionalProperties": {}},
    "Status": {"type": "object", "properties": {"code": {"type": "integer", "format": "int32"},
      "message": {"type": "string"}, "details": {"type": "array", "items": {"$ref": "#/definitions/Any"}}}}
  }
}`

var smallDecl = Declarations{
	Anonymous: []string{"/bettercompute.compute.v1.SystemService/Version"},
	Errors: []ErrorCode{
		{Code: "INVALID_INPUT", HTTP: 400, Meaning: "bad"},
		{Code: "UNAUTHENTICATED", HTTP: 401, Meaning: "who"},
		{Code: "UNSUPPORTED", HTTP: 400, Meaning: "no"},
		{Code: "UNAVAILABLE", HTTP: 503, Retryable: true, Meaning: "later"},
	},
}

type op struct {
	Security  *[]map[string][]string     `json:"security"`
	Responses map[string]json.RawMessage `json:"responses"`
}

type doc3 struct {
	OpenAPI    string                    `json:"openapi"`
	Security   []map[string][]string     `json:"security"`
	Paths      map[string]map[string]op  `json:"paths"`
	Components map[string]map[string]any `json:"components"`
}

func convertSmall(t *testing.T, swagger string, d Declarations) (doc3, string) {
	t.Helper()
	out, err := Convert([]byte(swagger), d)
	if err != nil {
		t.Fatal(err)
	}
	var doc doc3
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatal(err)
	}
	return doc, string(out)
}

func refOf(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var r struct {
		Ref string `json:"$ref"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		t.Fatal(err)
	}
	return r.Ref
}

func TestConvert(t *testing.T) {
	doc, out := convertSmall(t, small, smallDecl)
	if doc.OpenAPI != "3.0.3" {
		t.Errorf("openapi = %q", doc.OpenAPI)
	}
	if len(doc.Security) != 1 || doc.Security[0]["bearer"] == nil {
		t.Errorf("global security = %v, want bearer", doc.Security)
	}
	bearer, _ := doc.Components["securitySchemes"]["bearer"].(map[string]any)
	if bearer["type"] != "http" || bearer["scheme"] != "bearer" {
		t.Errorf("bearer scheme = %v", bearer)
	}

	version := doc.Paths["/api/compute/system/version"]["post"]
	if version.Security == nil || len(*version.Security) != 0 {
		t.Errorf("system.version security = %v, want [] (anonymous)", version.Security)
	}
	get := doc.Paths["/api/compute/nodes/get"]["post"]
	if get.Security != nil {
		t.Errorf("nodes.get security = %v, want the global bearer", *get.Security)
	}
	want := map[string]string{
		"default": "#/components/responses/Error",
		"400":     "#/components/responses/BadRequest",
		"401":     "#/components/responses/Unauthorized",
		"503":     "#/components/responses/ServiceUnavailable",
	}
	for name, o := range map[string]op{"version": version, "get": get} {
		if len(o.Responses) != len(want)+1 { // + 200
			t.Errorf("%s responses %v, want 200 and %v", name, keys(o.Responses), want)
		}
		for st, ref := range want {
			if got := refOf(t, o.Responses[st]); got != ref {
				t.Errorf("%s %s response = %s, want %s", name, st, got, ref)
			}
		}
	}
	watch := doc.Paths["/api/compute/events/watch"]["post"]
	if got := refOf(t, watch.Responses["default"]); got != "#/components/responses/StreamError" || len(watch.Responses) != 2 {
		t.Errorf("events.watch responses %v (default %s), want 200 and the StreamError default", keys(watch.Responses), got)
	}

	// The envelope and the code enum, in the declared order, with statuses.
	code, _ := doc.Components["schemas"]["ErrorCode"].(map[string]any)
	if got, _ := json.Marshal(code["enum"]); string(got) != `["INVALID_INPUT","UNAUTHENTICATED","UNSUPPORTED","UNAVAILABLE"]` {
		t.Errorf("ErrorCode enum = %s", got)
	}
	if got, _ := json.Marshal(code["x-http-status"]); string(got) != `{"INVALID_INPUT":400,"UNAUTHENTICATED":401,"UNAVAILABLE":503,"UNSUPPORTED":400}` {
		t.Errorf("ErrorCode x-http-status = %s", got)
	}
	bad, _ := doc.Components["responses"]["BadRequest"].(map[string]any)
	if got, _ := json.Marshal(bad["x-error-codes"]); string(got) != `["INVALID_INPUT","UNSUPPORTED"]` {
		t.Errorf("BadRequest x-error-codes = %s", got)
	}
	env, _ := doc.Components["schemas"]["Error"].(map[string]any)
	if got, _ := json.Marshal(env["required"]); string(got) != `["code","message"]` {
		t.Errorf("Error required = %s", got)
	}

	// Status stays only as a stream's error; a Struct field is free-form; an
	// empty message stays closed.
	if _, ok := doc.Components["schemas"]["Status"]; !ok {
		t.Error("Status dropped although events.watch's stream refers to it")
	}
	node, _ := doc.Components["schemas"]["Node"].(map[string]any)
	spec := node["properties"].(map[string]any)["spec"].(map[string]any)
	if spec["additionalProperties"] != true {
		t.Errorf("Node.spec (a Struct) = %v, want additionalProperties: true", spec)
	}
	if vr, _ := doc.Components["schemas"]["VersionRequest"].(map[string]any); vr["additionalProperties"] != nil {
		t.Errorf("VersionRequest (empty message) = %v, want closed", vr)
	}
	if strings.Contains(out, "#/definitions/") {
		t.Error("a Swagger 2.0 reference survived the conversion")
	}
}

// TestConvertWithoutStreamsDropsStatus: with no server-streaming method,
// the stream error and google.rpc.Status (and Any) leave the document.
func TestConvertWithoutStreamsDropsStatus(t *testing.T) {
	var m map[string]any
	if err := json.Unmarshal([]byte(small), &m); err != nil {
		t.Fatal(err)
	}
	delete(m["paths"].(map[string]any), "/api/compute/events/watch")
	b, _ := json.Marshal(m)
	doc, _ := convertSmall(t, string(b), smallDecl)
	for _, s := range []string{"Status", "Any", "StreamError"} {
		if _, ok := doc.Components["schemas"][s]; ok {
			t.Errorf("schema %s kept with nothing referring to it", s)
		}
	}
	if _, ok := doc.Components["responses"]["StreamError"]; ok {
		t.Error("response StreamError kept with nothing referring to it")
	}
	if _, ok := doc.Components["schemas"]["Error"]; !ok {
		t.Error("the Error envelope was dropped")
	}
}

func TestConvertRefuses(t *testing.T) {
	unknown := smallDecl
	unknown.Anonymous = []string{"/bettercompute.compute.v1.SystemService/Nope"}
	if _, err := Convert([]byte(small), unknown); err == nil || !strings.Contains(err.Error(), "SystemService_Nope") {
		t.Errorf("an anonymous method with no operation: %v, want it named", err)
	}
	other := strings.Replace(small, `"default": {"description": "err", "schema": {"$ref": "#/definitions/Status"}}}}},
    "/api/compute/nodes/get"`, `"default": {"description": "err", "schema": {"$ref": "#/definitions/Node"}}}}},
    "/api/compute/nodes/get"`, 1)
	if other == small {
		t.Fatal("test document did not change")
	}
	if _, err := Convert([]byte(other), smallDecl); err == nil || !strings.Contains(err.Error(), "default response") {
		t.Errorf("a default response other than Status: %v, want refused", err)
	}
	if _, err := Convert([]byte(`{"openapi": "3.0.0"}`), smallDecl); err == nil {
		t.Error("converted a document that is not Swagger 2.0")
	}
}

// TestDeclared: api.json parses, names the anonymous methods by full gRPC
// name, and every code has an error status.
func TestDeclared(t *testing.T) {
	d, err := Declared()
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Anonymous) == 0 || len(d.Errors) == 0 {
		t.Fatalf("api.json declares %d anonymous methods and %d codes", len(d.Anonymous), len(d.Errors))
	}
	for _, m := range d.Anonymous {
		if _, err := operationID(m); err != nil || !strings.HasPrefix(m, "/bettercompute.compute.v1.") {
			t.Errorf("anonymous %q: %v", m, err)
		}
	}
}

func keys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// TestDeprecatedFieldsMarked: a property the protos mark deprecated (its
// description starts "Deprecated:", as the old names of renamed request
// fields do) is deprecated in the OpenAPI 3 document; its replacement is
// not. Checked on the committed document, which TestCommittedDocumentIsFresh
// ties to Convert.
func TestDeprecatedFieldsMarked(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(repoRoot(t), "proto", "openapi", "compute.openapi.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Components struct {
			Schemas map[string]struct {
				Properties map[string]struct {
					Description string `json:"description"`
					Deprecated  bool   `json:"deprecated"`
				} `json:"properties"`
			} `json:"schemas"`
		} `json:"components"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	props := doc.Components.Schemas["NodesServiceGetRequest"].Properties
	if !props["id"].Deprecated || props["nodeId"].Deprecated {
		t.Fatalf("NodesServiceGetRequest %+v: want id deprecated, nodeId not", props)
	}
	for name, s := range doc.Components.Schemas {
		for p, v := range s.Properties {
			if v.Deprecated != strings.HasPrefix(v.Description, "Deprecated:") {
				t.Errorf("%s.%s: deprecated %v, description %q", name, p, v.Deprecated, v.Description)
			}
		}
	}
}
