#!/usr/bin/env bash
# proto-check.sh — fail when the generated files committed under proto/ are
# not exactly what tools/scripts/proto.sh produces from the current .proto
# sources, HTTP rules and buf config: changed, missing, or stale (left behind
# by a deleted .proto) generated files all fail, tracked or untracked. It
# regenerates into a temporary copy of proto/ and never touches the tree.
# Also runs buf lint (through proto.sh).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Copy proto/, drop every generated file (protoc-gen-go, -go-grpc,
# -grpc-gateway, -openapiv2, tools/cmd/openapi3) from the copy, and
# regenerate it from scratch.
cp -a "$root/proto" "$tmp/proto"
find "$tmp/proto" -type f \( -name '*.pb.go' -o -name '*.pb.gw.go' -o -path "$tmp/proto/openapi/*.swagger.json" -o -path "$tmp/proto/openapi/*.openapi.json" \) -delete
"$root/tools/scripts/proto.sh" "$tmp/proto"

# Everything else was copied as is, so any difference is a generated file.
if ! diff -ru "$root/proto" "$tmp/proto" >"$tmp/proto.diff"; then
  {
    echo "proto-check: FAIL: the generated files under proto/ are out of date."
    echo "Run tools/scripts/proto.sh (make proto) and commit the result."
    echo "Differences (proto/ = committed tree, regenerated/ = expected):"
    sed "s|$tmp/proto|regenerated|g; s|$root/proto|proto|g" "$tmp/proto.diff" | head -n 200
  } >&2
  exit 1
fi
echo "proto-check: OK: generated files under proto/ are up to date."
