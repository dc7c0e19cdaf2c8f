#!/usr/bin/env bash
# build-tools.sh [TOOL...] — build the pinned developer tools into tools/bin.
#
# The versions come from the `tool` directives in tools/go.mod. The tools are
# built with GOWORK=off, so they use exactly tools/go.mod's build list, whatever
# the rest of the workspace requires, and need only the Go module proxy (or a
# warm module cache). A tool is rebuilt only when tools/go.mod, tools/go.sum or
# the Go version changed since it was last built. With no arguments every tool
# is built. Prints the bin directory on stdout; progress goes to stderr.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tools="$root/tools"
bin="$tools/bin"

# Tool name -> package, as pinned in tools/go.mod.
declare -A pkgs=(
  [buf]=github.com/bufbuild/buf/cmd/buf
  [protoc-gen-go]=google.golang.org/protobuf/cmd/protoc-gen-go
  [protoc-gen-go-grpc]=google.golang.org/grpc/cmd/protoc-gen-go-grpc
  [protoc-gen-grpc-gateway]=github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-grpc-gateway
  [protoc-gen-openapiv2]=github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-openapiv2
  [golangci-lint]=github.com/golangci/golangci-lint/v2/cmd/golangci-lint
)

if [[ $# -eq 0 ]]; then
  set -- "${!pkgs[@]}"
fi

stamp="$(cat "$tools/go.mod" "$tools/go.sum" <(go env GOVERSION) | sha256sum | cut -d' ' -f1)"

mkdir -p "$bin"
want=()
for name in "$@"; do
  pkg="${pkgs[$name]:-}"
  if [[ -z "$pkg" ]]; then
    echo "build-tools.sh: unknown tool '$name' (known: ${!pkgs[*]})" >&2
    exit 2
  fi
  if [[ -x "$bin/$name" && "$(cat "$bin/.$name.stamp" 2>/dev/null)" == "$stamp" ]]; then
    continue
  fi
  want+=("$name")
done

if [[ ${#want[@]} -gt 0 ]]; then
  echo "build-tools.sh: building ${want[*]} into tools/bin" >&2
  list=()
  for name in "${want[@]}"; do
    list+=("${pkgs[$name]}")
  done
  (cd "$tools" && GOWORK=off go build -o "$bin/" "${list[@]}")
  for name in "${want[@]}"; do
    echo "$stamp" > "$bin/.$name.stamp"
  done
fi

echo "$bin"
