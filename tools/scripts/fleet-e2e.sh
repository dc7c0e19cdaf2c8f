#!/usr/bin/env bash
# A fleet-wide change end to end, as an operator runs it: the control plane as
# separate processes (api, gateway, nodespec-controller, controllers, placer,
# command-sweeper, outbox-relay) against one PostgreSQL and a real
# nats-server, N simulated nodes joined through bcsim, and a pool's site
# settings changed through the CLI. It times every node's convergence (in the
# database) with the bus up, with nats-server SIGKILLed, and after it restarts
# empty. With GATEWAYS=3 (or more) it runs that many gateway processes, the
# nodes given all of them (bcsim --gateway a,b,c), and then SIGKILLs one
# gateway: it times every node back in session on a survivor and a fleet
# change converged after the kill. Not part of `make test`: run it by hand,
# it prints its numbers.
#
#   [GATEWAYS=3] tools/scripts/fleet-e2e.sh [nodes, default 1000]
#
# The node CA, joinservice's key and the command-signing key are made once by
# a short `better-compute dev` run in the work directory (the development
# key directory), which the separate processes then share.
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-1000}
G=${GATEWAYS:-1}
W=$(mktemp -d /tmp/bc-fleet-e2e.XXXX)
SIM=$(mktemp -d /dev/shm/bc-fleet-e2e.XXXX 2>/dev/null || mktemp -d /tmp/bc-fleet-e2e-sim.XXXX)
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
DB=bc_fleet_e2e_$$
NATS_PORT=$((20000 + RANDOM % 10000))
API_PORT=$((NATS_PORT + 1))
GW_PORT=$((NATS_PORT + 2))
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
(cd tools && go build -o "$W/bcsim" ./cmd/bcsim)
BC="$W/better-compute"
psql "$PGURL/postgres" -qc "CREATE DATABASE $DB"
export DATABASE_URL="$PGURL/$DB" BC_LOG_LEVEL=warn

# Key material, once: dev generates it under its data directory.
BC_DEV_SIM_NODES=0 BC_DEV_DATA_DIR="$W/dev" BC_SERVER_PORT=$API_PORT BC_GATEWAY_LISTEN=127.0.0.1:$GW_PORT \
	"$BC" dev --prometheus=false >"$W/dev.log" 2>&1 & DEV=$!
for _ in $(seq 300); do [ -s "$W/dev/root-credential" ] && curl -sf "http://127.0.0.1:$API_PORT/readyz" >/dev/null && break; sleep 0.2; done
kill "$DEV"; wait "$DEV" || true
TOKEN=$(cat "$W/dev/root-credential")
export BC_JOIN_SERVICE_KEY_DIR="$W/dev/pki" BC_COMMANDS_SIGNING_KEY_FILE="$W/dev/pki/command-signing.key"

export NATS_URL="nats://127.0.0.1:$NATS_PORT"
start_nats() { /usr/sbin/nats-server -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$W/nats-$1" >"$W/nats-$1.log" 2>&1 & NATS_PID=$!; pids+=("$NATS_PID"); }
start_nats 1
serve() { # $1 role, $2 port
	"$BC" serve --roles "$1" --port "$2" --no-migrate >"$W/$1.log" 2>&1 & pids+=($!)
}
serve api "$API_PORT"
for r in nodespec-controller controllers placer command-sweeper outbox-relay; do serve "$r" 0; done
GWS=""
gwpids=()
for g in $(seq "$G"); do
	port=$((GW_PORT + 10 * (g - 1)))
	BC_GATEWAY_LISTEN=127.0.0.1:$port BC_GATEWAY_ID=gw-e2e-$g serve gateway 0
	gwpids+=("${pids[-1]}")
	GWS="${GWS:+$GWS,}127.0.0.1:$port"
done
BASE="http://127.0.0.1:$API_PORT"
for _ in $(seq 100); do curl -sf "$BASE/readyz" >/dev/null && break; sleep 0.1; done
export BETTER_COMPUTE_URL=$BASE BETTER_COMPUTE_TOKEN=$TOKEN

POOL=$("$BC" api pools.create tenantId=root name=e2e class=gpu | python3 -c 'import json,sys; print(json.load(sys.stdin)["pool"]["id"])')
JT=$("$BC" api joinTokens.create tenantId=root poolId="$POOL" uses:="$N" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$GW_PORT") 2>/dev/null && break; sleep 0.1; done

echo "joining $N simulated nodes through bcsim"
"$W/bcsim" --gateway "$GWS" --ca "$W/dev/pki/ca.pem" --joinservice-key "$W/dev/pki/joinservice.pub" \
	--token "$JT" --nodes "$N" --root "$SIM" --every 500ms >"$W/bcsim.log" 2>&1 & pids+=($!)

converged() { # $1 site log level ("" for any): nodes converged on it
	psql "$DATABASE_URL" -Atc "SELECT count(*) FROM nodes WHERE pool_id = '$POOL' AND generation > 0
		AND observed_generation = generation AND ('$1' = '' OR spec->'site'->>'logLevel' = '$1')"
}
wait_converged() { # $1 level, $2 timeout seconds
	local start=$SECONDS
	until [ "$(converged "$1")" -ge "$N" ]; do
		if [ $((SECONDS - start)) -gt "$2" ]; then echo "timed out: $(converged "$1") of $N converged" >&2; return 1; fi
		sleep 0.05
	done
}
wait_converged "" 900
grep "ready in" "$W/bcsim.log" || true

change() { # $1 phase, $2 level
	local t0 t1
	t0=$(date +%s.%N)
	"$BC" api pools.update tenantId=root poolId="$POOL" site:="{\"logLevel\":\"$2\"}" updateMask=site >/dev/null
	wait_converged "$2" 300
	t1=$(date +%s.%N)
	printf '%-22s every node converged %.2f s after pools.update\n' "$1" "$(echo "$t1 - $t0" | bc)"
}
sleep 2
change "bus up" debug
kill -9 "$NATS_PID"
change "nats-server SIGKILLed" warn
start_nats 2
sleep 3
change "nats-server empty" info
if [ "$G" -gt 1 ]; then
	# SIGKILL the gateway holding the most sessions; time every node back in
	# session on a survivor, then a change made right after the kill.
	victim=$(psql "$DATABASE_URL" -Atc "SELECT gateway_id FROM nodes WHERE pool_id = '$POOL' AND gateway_id <> ''
		GROUP BY gateway_id ORDER BY count(*) DESC LIMIT 1")
	held=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM nodes WHERE pool_id = '$POOL' AND gateway_id = '$victim'")
	t0=$(date +%s.%N)
	kill -9 "${gwpids[$((${victim##*-} - 1))]}"
	"$BC" api pools.update tenantId=root poolId="$POOL" site:='{"logLevel":"debug"}' updateMask=site >/dev/null
	start=$SECONDS
	until [ "$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM nodes WHERE pool_id = '$POOL' AND gateway_id NOT IN ('', '$victim')")" -ge "$N" ]; do
		if [ $((SECONDS - start)) -gt 300 ]; then echo "timed out waiting for the sessions to move" >&2; exit 1; fi
		sleep 0.05
	done
	t1=$(date +%s.%N)
	printf '%-22s every node back in session %.2f s after SIGKILL of %s (it held %d)\n' "gateway SIGKILLed" "$(echo "$t1 - $t0" | bc)" "$victim" "$held"
	wait_converged debug 300
	t2=$(date +%s.%N)
	printf '%-22s every node converged %.2f s after the SIGKILL and pools.update\n' "" "$(echo "$t2 - $t0" | bc)"
fi
sleep 1
echo "bcsim saw:"; grep "change: all" "$W/bcsim.log" || true
echo "the processes' logs are in $W"
