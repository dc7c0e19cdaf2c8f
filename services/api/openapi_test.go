package api_test

import (
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/bettercompute/bettercompute/proto/openapi"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// oas3 is the part of the OpenAPI 3 document these tests read.
type oas3 struct {
	OpenAPI  string                `json:"openapi"`
	Security []map[string][]string `json:"security"`
	Paths    map[string]map[string]struct {
		OperationID string                     `json:"operationId"`
		Security    *[]map[string][]string     `json:"security"`
		Responses   map[string]json.RawMessage `json:"responses"`
	} `json:"paths"`
	Components struct {
		Schemas struct {
			Error struct {
				Required   []string                   `json:"required"`
				Properties map[string]json.RawMessage `json:"properties"`
			} `json:"Error"`
			ErrorCode struct {
				Enum       []string       `json:"enum"`
				HTTPStatus map[string]int `json:"x-http-status"`
				Retryable  []string       `json:"x-retryable"`
			} `json:"ErrorCode"`
		} `json:"schemas"`
		Responses       map[string]errorResponse `json:"responses"`
		SecuritySchemes map[string]struct {
			Type, Scheme, BearerFormat string
		} `json:"securitySchemes"`
	} `json:"components"`
}

type errorResponse struct {
	Codes   []string `json:"x-error-codes"`
	Content map[string]struct {
		Schema struct {
			Ref string `json:"$ref"`
		} `json:"schema"`
	} `json:"content"`
}

func loadOAS3(t *testing.T, raw []byte) oas3 {
	t.Helper()
	var doc oas3
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatalf("the OpenAPI 3 document is not JSON: %v", err)
	}
	return doc
}

// ref returns the component name a {"$ref": "#/components/responses/X"}
// names.
func ref(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var r struct {
		Ref string `json:"$ref"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		t.Fatal(err)
	}
	name, ok := strings.CutPrefix(r.Ref, "#/components/responses/")
	if !ok {
		t.Fatalf("response %s is not a reference to components.responses", raw)
	}
	return name
}

// full is the gRPC full method name of an operationId: "NodesService_Get"
// → "/bettercompute.compute.v1.NodesService/Get".
func full(operationID string) string {
	svc, method, _ := strings.Cut(operationID, "_")
	return "/" + api.APIPackage + "." + svc + "/" + method
}

// serverStreaming says whether a full method name is a server-streaming RPC.
func serverStreaming(t *testing.T, fullMethod string) bool {
	t.Helper()
	name := protoreflect.FullName(strings.ReplaceAll(strings.TrimPrefix(fullMethod, "/"), "/", "."))
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
	if err != nil {
		t.Fatalf("%s: %v", fullMethod, err)
	}
	md, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		t.Fatalf("%s is no method", fullMethod)
	}
	return md.IsStreamingServer()
}

// clientStreaming reports whether fullMethod takes a stream of requests
// (TunnelsService.Connect): gRPC only, with no REST operation (its
// WebSocket form is served by the API itself).
func clientStreaming(t *testing.T, fullMethod string) bool {
	t.Helper()
	name := protoreflect.FullName(strings.ReplaceAll(strings.TrimPrefix(fullMethod, "/"), "/", "."))
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
	if err != nil {
		t.Fatalf("%s: %v", fullMethod, err)
	}
	return d.(protoreflect.MethodDescriptor).IsStreamingClient()
}

// TestOpenAPIDocumentMatchesTheServer checks the generated OpenAPI 3
// document (tools/cmd/openapi3, declarations in tools/cmd/openapi3/api.json)
// against this package and pkg/fault: the anonymous methods of the registry
// and only they need no bearer token, the error code enum is fault.Codes in
// order with each code's HTTP status, every operation answers the envelope
// for each of those statuses and by default, and the envelope's schema is
// api.Envelope. When it fails, fix api.json and run make proto.
func TestOpenAPIDocumentMatchesTheServer(t *testing.T) {
	doc := loadOAS3(t, openapi.V3Document())
	if !strings.HasPrefix(doc.OpenAPI, "3.") {
		t.Fatalf("openapi = %q", doc.OpenAPI)
	}
	if b := doc.Components.SecuritySchemes["bearer"]; b.Type != "http" || b.Scheme != "bearer" || !strings.HasPrefix(b.BearerFormat, "bck_") {
		t.Errorf("securitySchemes.bearer = %+v, want HTTP bearer with API keys", b)
	}
	if !reflect.DeepEqual(doc.Security, []map[string][]string{{"bearer": {}}}) {
		t.Errorf("global security = %v, want the bearer scheme", doc.Security)
	}

	// The code enum and statuses are pkg/fault's.
	var codes []string
	for _, c := range fault.Codes {
		codes = append(codes, string(c.Code))
		if got := doc.Components.Schemas.ErrorCode.HTTPStatus[string(c.Code)]; got != c.HTTP {
			t.Errorf("ErrorCode x-http-status[%s] = %d, fault says %d", c.Code, got, c.HTTP)
		}
		if got := slices.Contains(doc.Components.Schemas.ErrorCode.Retryable, string(c.Code)); got != c.Retryable {
			t.Errorf("ErrorCode x-retryable has %s: %v, fault says retryable %v", c.Code, got, c.Retryable)
		}
	}
	if !slices.Equal(doc.Components.Schemas.ErrorCode.Enum, codes) {
		t.Errorf("ErrorCode enum = %v, fault.Codes = %v", doc.Components.Schemas.ErrorCode.Enum, codes)
	}

	// The envelope's schema is api.Envelope: its JSON names, required unless
	// omitempty.
	var props, required []string
	et := reflect.TypeFor[api.Envelope]()
	for i := range et.NumField() {
		name, opts, _ := strings.Cut(et.Field(i).Tag.Get("json"), ",")
		props = append(props, name)
		if !strings.Contains(opts, "omitempty") {
			required = append(required, name)
		}
	}
	var docProps []string
	for p := range doc.Components.Schemas.Error.Properties {
		docProps = append(docProps, p)
	}
	slices.Sort(props)
	slices.Sort(docProps)
	if !slices.Equal(docProps, props) || !slices.Equal(doc.Components.Schemas.Error.Required, required) {
		t.Errorf("Error schema: properties %v required %v; api.Envelope: %v required %v",
			docProps, doc.Components.Schemas.Error.Required, props, required)
	}

	// Every operation is a registered method; the anonymous ones, and only
	// they, lift the bearer requirement; each answers the envelope.
	ops := map[string]bool{}
	for path, item := range doc.Paths {
		for method, op := range item {
			ops[op.OperationID] = true
			m, found := api.Methods()[full(op.OperationID)]
			if !found {
				t.Errorf("%s %s (%s) is no method of the registry", method, path, op.OperationID)
				continue
			}
			switch {
			case m.Anonymous && (op.Security == nil || len(*op.Security) != 0):
				t.Errorf("%s is anonymous but its security is %v, want []", op.OperationID, op.Security)
			case !m.Anonymous && op.Security != nil:
				t.Errorf("%s needs a credential but sets its own security %v", op.OperationID, *op.Security)
			}
			if serverStreaming(t, full(op.OperationID)) {
				// grpc-gateway writes a stream's errors itself, as
				// {"error": google.rpc.Status}.
				if d, ok := op.Responses["default"]; !ok || ref(t, d) != "StreamError" {
					t.Errorf("%s streams: default response %s, want StreamError", op.OperationID, d)
				}
				continue
			}
			if d, ok := op.Responses["default"]; !ok || ref(t, d) != "Error" {
				t.Errorf("%s: default response %s, want the Error envelope", op.OperationID, d)
			}
			for _, c := range fault.Codes {
				raw, ok := op.Responses[strconv.Itoa(c.HTTP)]
				if !ok {
					t.Errorf("%s: no %d response for %s", op.OperationID, c.HTTP, c.Code)
					continue
				}
				r := doc.Components.Responses[ref(t, raw)]
				if !slices.Contains(r.Codes, string(c.Code)) || r.Content["application/json"].Schema.Ref != "#/components/schemas/Error" {
					t.Errorf("%s: %d response %+v does not say %s with the envelope", op.OperationID, c.HTTP, r, c.Code)
				}
			}
		}
	}
	for m := range api.Methods() {
		svc, method, _ := strings.Cut(strings.TrimPrefix(m, "/"+api.APIPackage+"."), "/")
		if !ops[svc+"_"+method] && !clientStreaming(t, m) {
			t.Errorf("%s has no operation in the document", m)
		}
	}
}

// TestOpenAPIServed: the API serves the OpenAPI 3 document at
// /api/compute/openapi.json and, for one release, the Swagger 2.0 one at
// /api/compute/swagger.json, marked deprecated; and what the server answers
// is what the document says — anonymous methods need no token, errors are
// the envelope with the status its code is documented with, and the
// streamed events.watch's are the StreamError the document says.
func TestOpenAPIServed(t *testing.T) {
	h := setup(t, api.Tuning{})
	get := func(path string) (int, http.Header, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, h.base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, resp.Header, b
	}

	code, hdr, body := get(api.OpenAPIPath)
	if code != http.StatusOK || hdr.Get("Content-Type") != "application/json" || string(body) != string(openapi.V3Document()) {
		t.Fatalf("GET %s: %d %s %.100s, want the OpenAPI 3 document", api.OpenAPIPath, code, hdr.Get("Content-Type"), body)
	}
	doc := loadOAS3(t, body)
	code, hdr, body = get(api.SwaggerPath)
	var v2 struct {
		Swagger string `json:"swagger"`
	}
	if code != http.StatusOK || json.Unmarshal(body, &v2) != nil || v2.Swagger != "2.0" || hdr.Get("Deprecation") == "" {
		t.Fatalf("GET %s: %d %v %.100s, want the deprecated Swagger 2.0 document", api.SwaggerPath, code, hdr, body)
	}

	// The status each code is documented with, from nodes.get's responses.
	statusOf := map[string]int{}
	for st, raw := range doc.Paths["/api/compute/nodes/get"]["post"].Responses {
		n, err := strconv.Atoi(st)
		if err != nil || n < 400 {
			continue
		}
		for _, c := range doc.Components.Responses[ref(t, raw)].Codes {
			statusOf[c] = n
		}
	}
	// conforms checks an error body against the Error schema and the code's
	// documented status.
	conforms := func(what string, status int, body map[string]any, want fault.Code) {
		t.Helper()
		for k := range body {
			if _, ok := doc.Components.Schemas.Error.Properties[k]; !ok {
				t.Errorf("%s: body has %q, which the Error schema lacks: %v", what, k, body)
			}
		}
		for _, k := range doc.Components.Schemas.Error.Required {
			if _, ok := body[k].(string); !ok {
				t.Errorf("%s: body lacks required %q: %v", what, k, body)
			}
		}
		code, _ := body["code"].(string)
		if code != string(want) || !slices.Contains(doc.Components.Schemas.ErrorCode.Enum, code) {
			t.Errorf("%s: code %q, want %s from the enum", what, code, want)
		}
		if statusOf[code] != status {
			t.Errorf("%s: HTTP %d, the document says %s is %d", what, status, code, statusOf[code])
		}
	}

	if st, b := h.rest(t, "", "system/version", `{}`); st != http.StatusOK {
		t.Errorf("system.version without a token (documented security: []): %d %v", st, b)
	}
	st, b := h.rest(t, "", "nodes/get", `{"tenantId":"root","nodeId":"n1"}`)
	conforms("nodes.get without a token", st, b, fault.Unauthenticated)
	st, b = h.rest(t, h.root, "nodes/get", `{"tenantId":"root","nodeId":"no-such-node"}`)
	conforms("nodes.get of a missing node", st, b, fault.NotFound)
	st, b = h.rest(t, h.root, "nodes/get", `{"tenantId":"root","bogus":1}`)
	conforms("nodes.get with an unknown field", st, b, fault.InvalidInput)
	if b["field"] != "bogus" {
		t.Errorf("unknown field: field = %v, want bogus", b["field"])
	}
	// A stream's error is grpc-gateway's {"error": google.rpc.Status}, as the
	// document's StreamError says, with the code in its ErrorInfo.
	st, b = h.rest(t, "", "events/watch", `{"tenantId":"root"}`)
	var se struct {
		Error struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
			Details []struct {
				Type   string `json:"@type"`
				Reason string `json:"reason"`
				Domain string `json:"domain"`
			} `json:"details"`
		} `json:"error"`
	}
	raw, _ := json.Marshal(b)
	if err := json.Unmarshal(raw, &se); err != nil || st != http.StatusUnauthorized || se.Error.Message == "" ||
		len(se.Error.Details) != 1 || se.Error.Details[0].Reason != string(fault.Unauthenticated) || se.Error.Details[0].Domain != fault.ErrorDomain {
		t.Errorf("events.watch without a token: %d %s, want 401 and StreamError with reason UNAUTHENTICATED", st, raw)
	}
}
