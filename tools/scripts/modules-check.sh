#!/usr/bin/env bash
# modules-check.sh — fail unless every module builds alone: outside the
# workspace (GOWORK=off, so only its own go.mod, go.sum and replace
# directives count), `go build ./...` succeeds without touching go.mod or
# go.sum, and `go mod tidy -diff` finds nothing to change.
# Usage: modules-check.sh [module...]   (default: every module)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
modules=("$@")
if [ ${#modules[@]} -eq 0 ]; then
  modules=(proto pkg services agent tools deploy/kubernetes)
fi

export GOWORK=off
# -mod=readonly: a missing go.sum entry or requirement fails instead of being
# added quietly.
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=readonly"

failed=()
for m in "${modules[@]}"; do
  echo "== $m"
  if ! (cd "$root/$m" && go build ./...); then
    failed+=("$m: go build ./... fails outside the workspace")
  fi
  if ! (cd "$root/$m" && go mod tidy -diff); then
    failed+=("$m: go.mod or go.sum is not tidy")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  {
    echo "modules-check: FAIL:"
    printf '  %s\n' "${failed[@]}"
    echo "Run 'go mod tidy' in each module named (make tidy runs it in every module); a module that"
    echo "imports another of ours needs a replace directive for it (and for what that one imports)."
    echo "Commit go.mod and go.sum."
  } >&2
  exit 1
fi
echo "modules-check: OK: every module builds alone and is tidy."
