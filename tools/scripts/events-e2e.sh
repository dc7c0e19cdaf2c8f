#!/usr/bin/env bash
# Events end to end, as an operator runs them: the control plane as separate
# processes (api, controllers, two outbox relays) against one PostgreSQL and a
# real nats-server, a webhook receiver (`better-compute webhooks listen`), and
# pool creations through the REST API. It measures commit-to-webhook latency
# with the bus up, with nats-server SIGKILLed, and after it restarts empty;
# SIGKILLs the leading relay on the way; and checks that every event reached
# the receiver. Not part of `make test`: run it by hand, it prints its numbers.
#
#   tools/scripts/events-e2e.sh [events per phase, default 200]
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-200}
W=$(mktemp -d /tmp/bc-events-e2e.XXXX)
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
DB=bc_events_e2e_$$
NATS_PORT=$((20000 + RANDOM % 10000))
API_PORT=$((NATS_PORT + 1))
HOOK_PORT=$((NATS_PORT + 2))
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	psql "$PGURL/postgres" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "building into $W"
(cd services && go build -o "$W/better-compute" ./cmd/better-compute)
BC="$W/better-compute"
psql "$PGURL/postgres" -qc "CREATE DATABASE $DB"
export DATABASE_URL="$PGURL/$DB" NATS_URL="nats://127.0.0.1:$NATS_PORT"
export BC_WEBHOOKS_ALLOW_INSECURE=true BC_WEBHOOKS_ALLOW_PRIVATE_NETWORKS=true BC_LOG_LEVEL=warn
$BC migrate up >/dev/null

start_nats() { /usr/sbin/nats-server -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$W/nats-$1" >"$W/nats-$1.log" 2>&1 & NATS_PID=$!; pids+=("$NATS_PID"); }
start_nats 1
$BC serve --roles api --port "$API_PORT" --no-migrate >"$W/api.log" 2>&1 & pids+=($!)
$BC serve --roles controllers --port 0 --no-migrate >"$W/controllers.log" 2>&1 & pids+=($!)
$BC serve --roles outbox-relay --port 0 --no-migrate >"$W/relay1.log" 2>&1 & RELAY1=$!; pids+=("$RELAY1")
$BC serve --roles outbox-relay --port 0 --no-migrate >"$W/relay2.log" 2>&1 & RELAY2=$!; pids+=("$RELAY2")
BASE="http://127.0.0.1:$API_PORT"
for _ in $(seq 100); do curl -sf "$BASE/healthz" >/dev/null && break; sleep 0.1; done
TOKEN=$($BC bootstrap 2>/dev/null | grep -o 'bck_[a-z0-9]*\.[a-z0-9]*' | head -1)
export BETTER_COMPUTE_URL=$BASE BETTER_COMPUTE_TOKEN=$TOKEN

SECRET=$($BC api webhooks.create tenantId=root "url=http://127.0.0.1:$HOOK_PORT/hook" 'eventTypes:=["pool.created"]' |
	python3 -c 'import json,sys; print(json.load(sys.stdin)["secret"])')
$BC webhooks listen --addr "127.0.0.1:$HOOK_PORT" --secret "$SECRET" >"$W/received.jsonl" 2>"$W/listen.log" & pids+=($!)
sleep 0.5

create() { # $1 phase: N pools, one request at a time
	for i in $(seq "$N"); do
		curl -sf -X POST "$BASE/api/compute/pools/create" -H "Authorization: Bearer $TOKEN" \
			-d "{\"tenantId\":\"root\",\"class\":\"gpu\",\"name\":\"$1-$i\"}" >/dev/null
	done
}
received() { grep -c '"duplicate":false' "$W/received.jsonl" || true; }
wait_for() { # $1 count
	for _ in $(seq 600); do [ "$(received)" -ge "$1" ] && return 0; sleep 0.1; done
	echo "timed out: $(received) of $1 received" >&2; return 1
}

echo "phase 1: bus up"; create up; wait_for "$N"
echo "phase 2: nats-server SIGKILLed"; kill -9 "$NATS_PID"; create down; wait_for $((2 * N))
echo "phase 3: nats-server back, empty; the leading relay SIGKILLed midway"
start_nats 2
create empty1
leader=$(psql "$DATABASE_URL" -Atc "SELECT holder FROM leases WHERE name = 'singleton:outbox-relay'")
echo "  lease held by $leader; killing relay 1 (pid $RELAY1)"
kill -9 "$RELAY1"
create empty2; wait_for $((4 * N))

python3 - "$W/received.jsonl" "$N" <<'PY'
import json, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
n = int(sys.argv[2])
def t(s): return datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))
phases = {}
for r in rows:
    if r["duplicate"]: continue
    name = r["data"]["pool"]["name"].rsplit("-", 1)[0]
    lat = (t(r["received"]) - t(r["data"]["pool"]["createTime"])).total_seconds() * 1000
    phases.setdefault(name, []).append(lat)
for name in ["up", "down", "empty1", "empty2"]:
    l = sorted(phases.get(name, []))
    if not l: print(f"{name}: none"); continue
    print(f"{name:7s} {len(l):5d} events  p50 {l[len(l)//2]:7.1f} ms  p99 {l[min(len(l)-1, len(l)*99//100)]:7.1f} ms  max {l[-1]:7.1f} ms")
dups = sum(1 for r in rows if r["duplicate"])
distinct = len({r["id"] for r in rows})
print(f"distinct events {distinct} of {4*n} created; duplicate deliveries {dups} (same webhook-id)")
sys.exit(0 if distinct == 4 * n else 1)
PY
