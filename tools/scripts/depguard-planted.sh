#!/usr/bin/env bash
# depguard-planted.sh GOLANGCI_LINT — prove the depguard rules
# roles-are-leaves and roles-are-leaves-interface-plane (.golangci.yml) fire:
# plant, in throwaway packages of the services module, a role importing
# another role and a console package importing a role other than api, and
# expect a report from each; a console package importing api must pass.
# The planted packages are removed on exit. lint.sh runs it.
set -euo pipefail

lint="$1"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root/services"
m=github.com/bettercompute/bettercompute/services
role="internal/planted-role-$$"
iface="console/planted-iface-$$"
trap 'rm -rf "$role" "$iface"' EXIT
mkdir -p "$role" "$iface"
printf 'package planted\n\nimport _ "%s/nodespec"\n' "$m" >"$role/planted.go"
printf 'package planted\n\nimport (\n\t_ "%s/api"\n\t_ "%s/gateway"\n)\n' "$m" "$m" >"$iface/planted.go"

out="$("$lint" run --config "$root/.golangci.yml" --enable-only depguard "./$role/" "./$iface/" 2>&1 || true)"
fail=0
check() { # check WANT_COUNT PATTERN WHAT
  local n
  n="$(grep -c -- "$2" <<<"$out" || true)"
  if [[ "$n" -ne "$1" ]]; then
    echo "depguard-planted: expected $1 report(s) of $3, got $n" >&2
    fail=1
  fi
}
check 1 "$role/planted.go.*services/nodespec. is not allowed from list .roles-are-leaves" "a role importing services/nodespec"
check 1 "$iface/planted.go.*services/gateway. is not allowed from list .roles-are-leaves" "console importing services/gateway"
check 0 "services/api. is not allowed" "console importing services/api"
if [[ "$fail" -ne 0 ]]; then
  echo "$out" >&2
  exit 1
fi
echo "depguard-planted: roles-are-leaves fires on planted imports"
