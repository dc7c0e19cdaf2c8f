// Command openapi3 turns the Swagger 2.0 document that protoc-gen-openapiv2
// generates from the bettercompute.compute.v1 protos
// (proto/openapi/compute.swagger.json) into the OpenAPI 3.0 document the API
// serves at /api/compute/openapi.json (proto/openapi/compute.openapi.json),
// which current client generators accept (openapi-typescript 7 refuses
// Swagger 2.0).
//
// The conversion is kin-openapi's openapi2conv; then it says what the
// protos cannot:
//
//   - the bearer security scheme (an API key, bck_<id>.<secret>), required
//     globally and lifted from the anonymous methods (system.version,
//     system.health);
//   - the real error envelope {"code","message","field"} with the stable
//     codes as an enum and the REST status of each, as every operation's
//     default response and one response per status, in place of
//     google.rpc.Status (kept only as the in-band error of a streamed
//     response, which is what grpc-gateway writes there).
//
// The anonymous methods and the code table are declared in api.json (tools/
// imports nothing from services/ or pkg/); services/api's tests fail when
// they drift from services/api/methods.go or pkg/fault. tools/scripts/proto.sh
// runs this after buf generate:
//
//	openapi3 -in proto/openapi/compute.swagger.json -out proto/openapi/compute.openapi.json
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	in := flag.String("in", "proto/openapi/compute.swagger.json", "the Swagger 2.0 document to convert")
	out := flag.String("out", "proto/openapi/compute.openapi.json", "where to write the OpenAPI 3 document")
	flag.Parse()
	if err := run(*in, *out); err != nil {
		fmt.Fprintln(os.Stderr, "openapi3:", err)
		os.Exit(1)
	}
}

func run(in, out string) error {
	src, err := os.ReadFile(in)
	if err != nil {
		return err
	}
	decl, err := Declared()
	if err != nil {
		return err
	}
	doc, err := Convert(src, decl)
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	return os.WriteFile(out, doc, 0o644) //nolint:gosec // a committed, world-readable source file
}
