// Package openapi embeds the OpenAPI documents of the Better Compute REST
// API, generated from the bettercompute.compute.v1 services by
// tools/scripts/proto.sh:
//
//   - compute.swagger.json, OpenAPI v2 (Swagger 2.0), made by
//     protoc-gen-openapiv2 and merged into one file ([Document]; the CLI's
//     method catalog reads it);
//   - compute.openapi.json, OpenAPI 3.0, converted from it by
//     tools/cmd/openapi3 with the bearer security scheme and the real error
//     envelope ([V3Document]; what the API serves and client generators
//     read).
package openapi

import _ "embed"

// FileName is the base name of the embedded Swagger 2.0 document.
const FileName = "compute.swagger.json"

// V3FileName is the base name of the embedded OpenAPI 3 document.
const V3FileName = "compute.openapi.json"

// ContentType is the media type to serve the documents with.
const ContentType = "application/json"

//go:embed compute.swagger.json
var document []byte

//go:embed compute.openapi.json
var v3Document []byte

// Document returns the merged OpenAPI v2 (Swagger 2.0) document as JSON. It
// returns a fresh copy on each call, so callers may keep or modify it.
func Document() []byte {
	return append([]byte(nil), document...)
}

// V3Document returns the OpenAPI 3 document as JSON, a fresh copy on each
// call.
func V3Document() []byte {
	return append([]byte(nil), v3Document...)
}
