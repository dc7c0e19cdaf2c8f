#!/usr/bin/env bash
# proto.sh — lint the .proto sources and regenerate the committed Go code and
# OpenAPI documents (Swagger 2.0 and OpenAPI 3) under proto/. Runs offline: local buf config, local plugins
# built from tools/go.mod (see build-tools.sh). Run from anywhere in the repo.
#
#   tools/scripts/proto.sh          lint + generate into proto/
#   tools/scripts/proto.sh DIR      lint + generate into DIR, a copy of proto/
#                                   (used by proto-check.sh)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-$root/proto}"

bin="$("$root/tools/scripts/build-tools.sh" buf protoc-gen-go protoc-gen-go-grpc protoc-gen-grpc-gateway protoc-gen-openapiv2)"
# buf finds the `local:` plugins of buf.gen.yaml on PATH: ours come first.
export PATH="$bin:$PATH"
# Keep buf's cache out of $HOME. Nothing is remote (no deps, local plugins),
# so buf needs no network.
export BUF_CACHE_DIR="${BUF_CACHE_DIR:-$root/tools/bin/.buf-cache}"
export BUF_BETA_SUPPRESS_WARNINGS=1

cd "$dir"
buf lint
buf generate
# The OpenAPI 3 document the API serves (and client generators read), made
# from the Swagger 2.0 one buf just wrote: tools/cmd/openapi3 adds the bearer
# scheme and the error envelope. Built from tools/go.mod, like the plugins.
openapi="$PWD/openapi"
(cd "$root/tools" && GOWORK=off go run ./cmd/openapi3 \
  -in "$openapi/compute.swagger.json" -out "$openapi/compute.openapi.json")
