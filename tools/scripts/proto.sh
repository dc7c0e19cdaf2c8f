#!/usr/bin/env bash
# proto.sh — lint the .proto sources and regenerate the committed Go code and
# OpenAPI document under proto/. Runs offline: local buf config, local plugins
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
