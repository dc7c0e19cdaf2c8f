// Package openapi embeds the OpenAPI v2 (Swagger) document of the Better
// Compute REST API, generated from the bettercompute.compute.v1 services by
// protoc-gen-openapiv2 (tools/scripts/proto.sh) and merged into one file,
// compute.swagger.json, so the API server can serve it as is.
package openapi

import _ "embed"

// FileName is the base name of the embedded document.
const FileName = "compute.swagger.json"

// ContentType is the media type to serve the document with.
const ContentType = "application/json"

//go:embed compute.swagger.json
var document []byte

// Document returns the merged OpenAPI v2 document as JSON. It returns a fresh
// copy on each call, so callers may keep or modify it.
func Document() []byte {
	return append([]byte(nil), document...)
}
