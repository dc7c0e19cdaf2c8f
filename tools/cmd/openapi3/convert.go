package main

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/getkin/kin-openapi/openapi2"
	"github.com/getkin/kin-openapi/openapi2conv"
	"github.com/getkin/kin-openapi/openapi3"
)

// Declarations is what the generator is told rather than reads from the
// protos: api.json.
type Declarations struct {
	// Anonymous lists the gRPC full method names that need no credential
	// ("/bettercompute.compute.v1.SystemService/Version").
	Anonymous []string `json:"anonymous"`
	// Errors is the table of stable error codes, in pkg/fault's order.
	Errors []ErrorCode `json:"errors"`
}

// ErrorCode is one row of pkg/fault's Codes table.
type ErrorCode struct {
	Code      string `json:"code"`
	HTTP      int    `json:"http"`
	Retryable bool   `json:"retryable"`
	Meaning   string `json:"meaning"`
}

//go:embed api.json
var declared []byte

// Declared returns the declarations of api.json.
func Declared() (Declarations, error) {
	var d Declarations
	dec := json.NewDecoder(bytes.NewReader(declared))
	if err := dec.Decode(&d); err != nil {
		return d, fmt.Errorf("api.json: %w", err)
	}
	if len(d.Errors) == 0 {
		return d, errors.New("api.json: no error codes")
	}
	for _, e := range d.Errors {
		if e.Code == "" || e.Meaning == "" || http.StatusText(e.HTTP) == "" || e.HTTP < 400 {
			return d, fmt.Errorf("api.json: error code %+v: want a code, a meaning and an HTTP error status", e)
		}
	}
	return d, nil
}

// Names in components.
const (
	// SecurityScheme is the bearer scheme's name.
	SecurityScheme = "bearer"
	// ErrorSchema is the envelope's schema; ErrorCodeSchema its code enum.
	ErrorSchema     = "Error"
	ErrorCodeSchema = "ErrorCode"
	// ErrorResponse is the default response of every operation but the
	// server-streaming ones, whose errors are StreamErrorResponse.
	ErrorResponse       = "Error"
	StreamErrorResponse = "StreamError"
	// StreamErrorSchema is a server-streaming method's error body.
	StreamErrorSchema = "StreamError"
	// statusSchema is google.rpc.Status, what protoc-gen-openapiv2 says
	// errors are.
	statusSchema = "Status"
	anySchema    = "Any"
)

const schemaRef, responseRef = "#/components/schemas/", "#/components/responses/"

// Convert converts a Swagger 2.0 document made by protoc-gen-openapiv2 to
// OpenAPI 3.0, adds the bearer scheme and the error envelope, validates the
// result and returns it as indented JSON.
func Convert(swagger []byte, d Declarations) ([]byte, error) {
	var doc2 openapi2.T
	if err := json.Unmarshal(swagger, &doc2); err != nil {
		return nil, fmt.Errorf("not a Swagger 2.0 document: %w", err)
	}
	if doc2.Swagger != "2.0" {
		return nil, fmt.Errorf("swagger = %q, want 2.0", doc2.Swagger)
	}
	doc, err := openapi2conv.ToV3(&doc2)
	if err != nil {
		return nil, fmt.Errorf("convert: %w", err)
	}
	addSecurity(doc)
	freeFormStructs(doc)
	deprecatedFields(doc)
	if err := addErrors(doc, d.Errors); err != nil {
		return nil, err
	}
	if err := patchOperations(doc, d); err != nil {
		return nil, err
	}
	if err := dropUnused(doc); err != nil {
		return nil, err
	}
	if err := doc.Validate(context.Background()); err != nil {
		return nil, fmt.Errorf("the converted document is not valid OpenAPI 3: %w", err)
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func addSecurity(doc *openapi3.T) {
	if doc.Components.SecuritySchemes == nil {
		doc.Components.SecuritySchemes = openapi3.SecuritySchemes{}
	}
	doc.Components.SecuritySchemes[SecurityScheme] = &openapi3.SecuritySchemeRef{Value: &openapi3.SecurityScheme{
		Type:         "http",
		Scheme:       "bearer",
		BearerFormat: "bck_<id>.<secret>",
		Description: "An API key: `Authorization: Bearer bck_<id>.<secret>` (gRPC metadata `authorization`). " +
			"apiKeys.create mints one and shows its secret once; `better-compute bootstrap` mints the first. " +
			"Every method needs one except those whose security is empty (system.version, system.health).",
	}}
	doc.Security = openapi3.SecurityRequirements{openapi3.NewSecurityRequirement().Authenticate(SecurityScheme)}
	doc.Info.Description = strings.TrimSpace(doc.Info.Description + "\n\n" +
		"Authenticate with an API key as a bearer token (`Authorization: Bearer bck_<id>.<secret>`). " +
		"Every error is the envelope `{\"code\",\"message\",\"field\"}` (schema " + ErrorSchema + "): `code` is one of " +
		"the stable codes of " + ErrorCodeSchema + ", each answered with one HTTP status; `field` names the request's " +
		"JSON field at fault, when one is.")
}

// freeFormStructs marks the google.protobuf.Struct fields free-form.
// protoc-gen-openapiv2 writes a Struct field as an inline {"type":
// "object"} with no properties, which generators read as an object that may
// have none (openapi-typescript: Record<string, never>), so a client could
// neither send a command payload nor read an event's data. Component schemas
// with no properties are empty messages (VersionRequest) and stay closed.
func freeFormStructs(doc *openapi3.T) {
	var walk func(s *openapi3.SchemaRef)
	walk = func(s *openapi3.SchemaRef) {
		if s == nil || s.Ref != "" || s.Value == nil {
			return
		}
		v := s.Value
		if v.Type.Is(openapi3.TypeObject) && len(v.Properties) == 0 &&
			v.AdditionalProperties.Has == nil && v.AdditionalProperties.Schema == nil {
			v.AdditionalProperties.Has = ptr(true)
		}
		for _, p := range v.Properties {
			walk(p)
		}
		walk(v.Items)
	}
	for _, s := range doc.Components.Schemas {
		if s.Value == nil {
			continue
		}
		for _, p := range s.Value.Properties {
			walk(p)
		}
		walk(s.Value.Items)
	}
}

// deprecatedFields marks deprecated the properties whose description says
// "Deprecated: …": the old names of renamed request fields, which the
// protos mark [deprecated = true] and say so in their comment. Swagger 2.0
// has no deprecated schemas, so protoc-gen-openapiv2 keeps only the
// comment; OpenAPI 3 has them, and generators turn them into @deprecated.
func deprecatedFields(doc *openapi3.T) {
	for _, s := range doc.Components.Schemas {
		if s.Value == nil {
			continue
		}
		for _, p := range s.Value.Properties {
			if p.Ref == "" && p.Value != nil && strings.HasPrefix(p.Value.Description, "Deprecated:") {
				p.Value.Deprecated = true
			}
		}
	}
}

// statuses returns the distinct HTTP statuses of the codes, in order, and
// the codes of each.
func statuses(codes []ErrorCode) ([]int, map[int][]ErrorCode) {
	by := map[int][]ErrorCode{}
	var order []int
	for _, c := range codes {
		if _, ok := by[c.HTTP]; !ok {
			order = append(order, c.HTTP)
		}
		by[c.HTTP] = append(by[c.HTTP], c)
	}
	slices.Sort(order)
	return order, by
}

// responseName is the components.responses name of an HTTP status:
// 404 → "NotFound".
func responseName(status int) string {
	return strings.ReplaceAll(http.StatusText(status), " ", "")
}

func addErrors(doc *openapi3.T, codes []ErrorCode) error {
	status := doc.Components.Schemas[statusSchema]
	if status == nil || status.Value == nil {
		return fmt.Errorf("no %s schema (google.rpc.Status) from protoc-gen-openapiv2; update the converter", statusSchema)
	}
	status.Value.Description = "google.rpc.Status: code is the gRPC code; details hold an ErrorInfo of domain " +
		"api.bettercompute whose reason is the stable code (" + ErrorCodeSchema + ") and whose metadata.field is the field."
	var enum []any
	var meanings []string
	httpOf := map[string]int{}
	var retryable []string
	var table strings.Builder
	table.WriteString("The stable error code: clients switch on it; a value never changes once released.\n\n" +
		"| code | HTTP status | retryable | meaning |\n|---|---|---|---|\n")
	for _, c := range codes {
		enum = append(enum, c.Code)
		meanings = append(meanings, c.Meaning)
		httpOf[c.Code] = c.HTTP
		if c.Retryable {
			retryable = append(retryable, c.Code)
		}
		fmt.Fprintf(&table, "| %s | %d | %s | %s |\n", c.Code, c.HTTP, yesNo(c.Retryable), c.Meaning)
	}
	codeSchema := openapi3.NewStringSchema().WithEnum(enum...)
	codeSchema.Description = strings.TrimSpace(table.String())
	codeSchema.Extensions = map[string]any{
		"x-enum-descriptions": meanings,
		"x-http-status":       httpOf,
		"x-retryable":         retryable,
	}
	envelope := openapi3.NewObjectSchema()
	envelope.Description = "The error envelope: the body of every error response (gRPC: the status, with an " +
		"ErrorInfo detail of domain api.bettercompute whose reason is the code and whose metadata carries the field)."
	envelope.Required = []string{"code", "message"}
	envelope.Properties = openapi3.Schemas{
		"code": openapi3.NewSchemaRef(schemaRef+ErrorCodeSchema, codeSchema),
		"message": openapi3.NewSchemaRef("", &openapi3.Schema{
			Type: &openapi3.Types{openapi3.TypeString}, Description: "What went wrong, for a person.",
		}),
		"field": openapi3.NewSchemaRef("", &openapi3.Schema{
			Type:        &openapi3.Types{openapi3.TypeString},
			Description: "The request's JSON field (lowerCamel, dotted for nested fields) at fault, when one input is; absent otherwise.",
		}),
	}
	doc.Components.Schemas[ErrorCodeSchema] = openapi3.NewSchemaRef("", codeSchema)
	doc.Components.Schemas[ErrorSchema] = openapi3.NewSchemaRef("", envelope)

	if doc.Components.Responses == nil {
		doc.Components.Responses = openapi3.ResponseBodies{}
	}
	body := func(desc string, codes []string) *openapi3.ResponseRef {
		r := openapi3.NewResponse().WithDescription(desc).
			WithContent(openapi3.NewContentWithJSONSchemaRef(openapi3.NewSchemaRef(schemaRef+ErrorSchema, envelope)))
		if codes != nil {
			r.Extensions = map[string]any{"x-error-codes": codes}
		}
		return &openapi3.ResponseRef{Value: r}
	}
	doc.Components.Responses[ErrorResponse] = body("An error: the envelope, with the HTTP status of its code (see "+ErrorCodeSchema+").", nil)

	streamErr := openapi3.NewObjectSchema()
	streamErr.Description = "The error of a server-streaming method (events.watch over POST), before or after its " +
		"first result: grpc-gateway's {\"error\": google.rpc.Status}, whose details hold an ErrorInfo of domain " +
		"api.bettercompute with the code as its reason and the field in its metadata; the HTTP status is " +
		"grpc-gateway's for the gRPC code. The Server-Sent Events form (GET /api/compute/events/watch) answers " +
		"the envelope instead."
	streamErr.Required = []string{"error"}
	streamErr.Properties = openapi3.Schemas{"error": openapi3.NewSchemaRef(schemaRef+statusSchema, status.Value)}
	doc.Components.Schemas[StreamErrorSchema] = openapi3.NewSchemaRef("", streamErr)
	doc.Components.Responses[StreamErrorResponse] = &openapi3.ResponseRef{Value: openapi3.NewResponse().
		WithDescription("An error of a stream: {\"error\": google.rpc.Status} (see " + StreamErrorSchema + ").").
		WithContent(openapi3.NewContentWithJSONSchemaRef(openapi3.NewSchemaRef(schemaRef+StreamErrorSchema, streamErr)))}
	order, by := statuses(codes)
	for _, st := range order {
		var names, parts []string
		for _, c := range by[st] {
			names = append(names, c.Code)
			parts = append(parts, c.Code+" ("+c.Meaning+")")
		}
		doc.Components.Responses[responseName(st)] = body(http.StatusText(st)+": "+strings.Join(parts, "; ")+".", names)
	}
	return nil
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// operationID is grpc-gateway's operationId of a gRPC full method name:
// "/bettercompute.compute.v1.SystemService/Version" → "SystemService_Version".
func operationID(fullMethod string) (string, error) {
	svc, method, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	if !ok || method == "" {
		return "", fmt.Errorf("anonymous method %q: want /package.Service/Method", fullMethod)
	}
	if i := strings.LastIndex(svc, "."); i >= 0 {
		svc = svc[i+1:]
	}
	return svc + "_" + method, nil
}

func patchOperations(doc *openapi3.T, d Declarations) error {
	anonymous := map[string]bool{}
	for _, m := range d.Anonymous {
		id, err := operationID(m)
		if err != nil {
			return err
		}
		anonymous[id] = false
	}
	order, _ := statuses(d.Errors)
	for _, path := range doc.Paths.InMatchingOrder() {
		for method, op := range doc.Paths.Value(path).Operations() {
			where := method + " " + path
			if op.OperationID == "" {
				return fmt.Errorf("%s has no operationId", where)
			}
			if _, ok := anonymous[op.OperationID]; ok {
				op.Security = openapi3.NewSecurityRequirements() // []: no credential
				anonymous[op.OperationID] = true
			}
			if !refersTo(op.Responses.Default(), schemaRef+statusSchema) {
				return fmt.Errorf("%s: want protoc-gen-openapiv2's default response (%s), found another; update the converter", where, statusSchema)
			}
			if stream := streamResult(op); stream != nil {
				// grpc-gateway answers a server-streaming method's errors,
				// before or after the first result, with {"error":
				// google.rpc.Status} and the status grpc-gateway maps the
				// gRPC code to, not with the envelope.
				stream.Description = ptr("A stream of newline-delimited JSON objects, each {\"result\": …}; an error " +
					"after the first ends the stream as {\"error\": …} (see " + StreamErrorSchema + ").")
				op.Responses.Set("default", componentResponse(doc, StreamErrorResponse))
				continue
			}
			op.Responses.Set("default", componentResponse(doc, ErrorResponse))
			for _, st := range order {
				op.Responses.Set(fmt.Sprint(st), componentResponse(doc, responseName(st)))
			}
		}
	}
	var missing []string
	for id, found := range anonymous {
		if !found {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return fmt.Errorf("anonymous methods in api.json match no operation: %s", strings.Join(missing, ", "))
	}
	return nil
}

// refersTo says whether a response's JSON body is a reference to ref.
func refersTo(r *openapi3.ResponseRef, ref string) bool {
	if r == nil || r.Value == nil {
		return false
	}
	mt := r.Value.Content.Get("application/json")
	return mt != nil && mt.Schema != nil && mt.Schema.Ref == ref
}

// componentResponse is a reference to a response of components, resolved.
func componentResponse(doc *openapi3.T, name string) *openapi3.ResponseRef {
	return &openapi3.ResponseRef{Ref: responseRef + name, Value: doc.Components.Responses[name].Value}
}

// streamResult returns the 200 response of a server-streaming operation
// (protoc-gen-openapiv2 describes its chunks as {"result", "error":
// Status}), nil for any other.
func streamResult(op *openapi3.Operation) *openapi3.Response {
	ok := op.Responses.Status(http.StatusOK)
	if ok == nil || ok.Value == nil {
		return nil
	}
	mt := ok.Value.Content.Get("application/json")
	if mt == nil || mt.Schema == nil || mt.Schema.Value == nil {
		return nil
	}
	if e := mt.Schema.Value.Properties["error"]; e != nil && e.Ref == schemaRef+statusSchema && mt.Schema.Value.Properties["result"] != nil {
		return ok.Value
	}
	return nil
}

func ptr[T any](v T) *T { return &v }

// dropUnused removes the stream error and google.rpc.Status when nothing
// refers to them any more (no server-streaming method), in order: each
// refers to the next.
func dropUnused(doc *openapi3.T) error {
	steps := []struct {
		ref    string
		remove func() func()
	}{
		{responseRef + StreamErrorResponse, func() func() {
			kept := doc.Components.Responses[StreamErrorResponse]
			delete(doc.Components.Responses, StreamErrorResponse)
			return func() { doc.Components.Responses[StreamErrorResponse] = kept }
		}},
		{schemaRef + StreamErrorSchema, removeSchema(doc, StreamErrorSchema)},
		{schemaRef + statusSchema, removeSchema(doc, statusSchema)},
		{schemaRef + anySchema, removeSchema(doc, anySchema)},
	}
	for _, step := range steps {
		restore := step.remove()
		b, err := json.Marshal(doc)
		if err != nil {
			return err
		}
		if bytes.Contains(b, []byte(`"`+step.ref+`"`)) {
			restore() // still used
		}
	}
	return nil
}

func removeSchema(doc *openapi3.T, name string) func() func() {
	return func() func() {
		kept := doc.Components.Schemas[name]
		delete(doc.Components.Schemas, name)
		return func() { doc.Components.Schemas[name] = kept }
	}
}
