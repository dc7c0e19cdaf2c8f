// Package tools pins the developer tools of Better Compute.
//
// The module's go.mod lists them with `tool` directives: buf and the protoc
// plugins (protoc-gen-go, protoc-gen-go-grpc, protoc-gen-grpc-gateway,
// protoc-gen-openapiv2) used by tools/scripts/proto.sh, and golangci-lint used
// by tools/scripts/lint.sh. The scripts build them into tools/bin (ignored by
// git) with GOWORK=off, so the versions are exactly the ones pinned here and
// only the Go module proxy is needed. Later the module also holds the fleet
// simulator and the load and chaos drivers.
package tools
