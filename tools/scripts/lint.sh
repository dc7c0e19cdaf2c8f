#!/usr/bin/env bash
# lint.sh [MODULE...] — lint every Go module of the workspace (default: the
# modules listed in go.work: proto pkg services agent tools deploy/kubernetes):
#   1. gofmt -l must list no file;
#   2. go vet ./... in each module;
#   3. golangci-lint run ./... in each module, with the repo's .golangci.yml
#      (golangci-lint is built from tools/go.mod, see build-tools.sh);
#   4. with services: depguard-planted.sh, that the roles-are-leaves rules
#      fire on planted imports.
# Runs every step on every module and fails at the end if any step failed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

if [[ $# -gt 0 ]]; then
  modules=("$@")
else
  mapfile -t modules < <(go work edit -json | sed -n 's/^.*"DiskPath": "\.\/\([^"]*\)".*$/\1/p')
  if [[ ${#modules[@]} -eq 0 ]]; then
    modules=(proto pkg services agent tools deploy/kubernetes)
  fi
fi

bin="$("$root/tools/scripts/build-tools.sh" golangci-lint)"
failed=()

echo "== gofmt -l ${modules[*]}"
unformatted="$(gofmt -l "${modules[@]}")"
if [[ -n "$unformatted" ]]; then
  echo "gofmt: these files need formatting (run gofmt -w):" >&2
  echo "$unformatted" >&2
  failed+=("gofmt")
fi

for m in "${modules[@]}"; do
  if [[ -z "$(cd "$m" && go list ./... 2>/dev/null)" ]]; then
    echo "== $m: no Go packages, skipped"
    continue
  fi
  echo "== go vet ./... ($m)"
  (cd "$m" && go vet ./...) || failed+=("go vet ($m)")
  echo "== golangci-lint run ./... ($m)"
  (cd "$m" && "$bin/golangci-lint" run --config "$root/.golangci.yml" ./...) || failed+=("golangci-lint ($m)")
  if [[ "$m" == services ]]; then
    echo "== depguard-planted.sh (roles-are-leaves fires)"
    "$root/tools/scripts/depguard-planted.sh" "$bin/golangci-lint" || failed+=("depguard-planted")
  fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "lint: FAIL: ${failed[*]}" >&2
  exit 1
fi
echo "lint: OK"
