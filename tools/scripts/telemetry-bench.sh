#!/usr/bin/env bash
# What node telemetry costs a fleet, measured as an operator would: the
# control plane (`better-compute dev`, no simulated fleet of its own) against
# a private database, N simulated nodes in a separate `bcsim` process, each
# exporting bcd's telemetry (eight mock GPUs) over OTLP/gRPC every 10 s to one
# receiver process (tools/cmd/otlpsink, which decodes every request and keeps
# nothing). It prints the receiver's CPU, requests/s and bytes/s, and bcsim's
# CPU per node with telemetry on and, on the same joined nodes, off. Not part
# of `make test`: `make bench-telemetry` or by hand.
#
#   tools/scripts/telemetry-bench.sh [nodes, default 1000] [window seconds, default 60]
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-1000}
WINDOW=${2:-60}
INTERVAL=${TELEMETRY_INTERVAL:-10s}
W=$(mktemp -d /tmp/bc-telemetry-bench.XXXX)
SIM=$(mktemp -d /dev/shm/bc-telemetry-bench.XXXX 2>/dev/null || mktemp -d /tmp/bc-telemetry-bench-sim.XXXX)
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
DB=bc_telemetry_bench_$$
API_PORT=$((20000 + RANDOM % 10000))
GW_PORT=$((API_PORT + 1))
OTLP_PORT=$((API_PORT + 2))
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	psql "$PGURL/postgres" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
	rm -rf "$SIM"
}
trap cleanup EXIT

echo "building into $W"
(cd services && go build -o "$W/better-compute" ./cmd/better-compute)
(cd tools && go build -o "$W/bcsim" ./cmd/bcsim && go build -o "$W/otlpsink" ./cmd/otlpsink)
BC="$W/better-compute"
psql "$PGURL/postgres" -qc "CREATE DATABASE $DB"
export DATABASE_URL="$PGURL/$DB" BC_LOG_LEVEL=warn
BC_DEV_SIM_NODES=0 BC_DEV_DATA_DIR="$W/dev" BC_SERVER_PORT=$API_PORT BC_GATEWAY_LISTEN=127.0.0.1:$GW_PORT \
	"$BC" dev --prometheus=false >"$W/dev.log" 2>&1 & pids+=($!)
BASE="http://127.0.0.1:$API_PORT"
for _ in $(seq 600); do [ -s "$W/dev/root-credential" ] && curl -sf "$BASE/readyz" >/dev/null && break; sleep 0.2; done
export BETTER_COMPUTE_URL=$BASE BETTER_COMPUTE_TOKEN=$(cat "$W/dev/root-credential")
POOL=$("$BC" api pools.create tenantId=root name=telemetry class=gpu | python3 -c 'import json,sys; print(json.load(sys.stdin)["pool"]["id"])')
JT=$("$BC" api joinTokens.create tenantId=root poolId="$POOL" uses:="$N" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')

"$W/otlpsink" --listen "127.0.0.1:$OTLP_PORT" --every 10s >"$W/otlpsink.log" 2>&1 & pids+=($!)

# phase NAME [bcsim flags…]: run bcsim until every session is up, settle,
# then keep it WINDOW seconds; its CPU lines (and the receiver's) over the
# window are averaged.
phase() {
	local name=$1; shift
	"$W/bcsim" --gateway "127.0.0.1:$GW_PORT" --ca "$W/dev/pki/ca.pem" --joinservice-key "$W/dev/pki/joinservice.pub" \
		--token "$JT" --nodes "$N" --root "$SIM" --every 1s --cpu-every 10s "$@" >"$W/bcsim-$name.log" 2>&1 &
	local sim=$!
	pids+=("$sim")
	local start=$SECONDS
	until grep -q "sessions $N/$N" "$W/bcsim-$name.log"; do
		if ! kill -0 "$sim" 2>/dev/null || [ $((SECONDS - start)) -gt 900 ]; then
			echo "$name: bcsim did not bring up $N sessions:" >&2; tail -5 "$W/bcsim-$name.log" >&2; return 1
		fi
		sleep 1
	done
	echo "$name: $N sessions up after $((SECONDS - start)) s; settling 20 s, then measuring ${WINDOW} s"
	sleep 20
	local from_sim from_sink
	from_sim=$(wc -l <"$W/bcsim-$name.log")
	from_sink=$(wc -l <"$W/otlpsink.log")
	sleep "$WINDOW"
	tail -n +"$((from_sim + 1))" "$W/bcsim-$name.log" | grep ' cpu ' | awk -v n="$name" '
		{ for (i = 1; i <= NF; i++) { if ($i == "cores,") c += $(i-1); if ($i == "µs/s") u += $(i-1); if ($i == "rss") { m += $(i+1); kb += $(i+3) } if ($i == "delivered,") d += $(i-1); if ($i == "failed") f += $(i-1) } k++ }
		END { if (k) printf "%s: bcsim cpu %.3f cores, %.1f µs of CPU per second per node; rss %.0f MiB (%.0f KiB per node); exports/s %.1f delivered, %.1f failed (%d samples)\n", n, c/k, u/k, m/k, kb/k, d/k, f/k, k }'
	if [ "$name" = on ]; then
		tail -n +"$((from_sink + 1))" "$W/otlpsink.log" | grep 'requests/s' | awk '
			{ for (i = 1; i <= NF; i++) { if ($i == "requests/s") r += $(i+1); if ($i == "TCP") t += $(i+2); if ($i == "payload") p += $(i+2); if ($i == "decoded") d += $(i+2); if ($i == "cpu") c += $(i+1); if ($i == "conns") k2 = $(i+1) } k++ }
			END { if (k) printf "receiver: %.3f cores, %.1f requests/s, %.0f TCP bytes/s in (%.0f gzip payload, %.0f decoded), %d connections (%d samples)\n", c/k, r/k, t/k, p/k, d/k, k2, k }'
	fi
	kill "$sim"; wait "$sim" 2>/dev/null || true
}
phase on --otlp-endpoint "http://127.0.0.1:$OTLP_PORT" --telemetry-interval "$INTERVAL"
phase off
echo "logs in $W"
