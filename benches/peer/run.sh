#!/usr/bin/env bash
# Throughput from outside with wrk: the `orders` example as shipped (tower-idempotency, durable
# SQLite) against the peer (axum-idempotent + a hand-written transaction, durable SQLite), with
# its sessions in memory (moka) and, when REDIS_URL names a Redis >= 7.4, in Redis; and against
# the minimal handler (`peer --minimal`: no middleware, the article's transaction on its own
# `(tenant, key, payload, status, body)` table).
#
#   benches/peer/run.sh                                 # builds both, runs every case once
#   REDIS_URL=redis://127.0.0.1:6380 benches/peer/run.sh
#   DURATION=20 benches/peer/run.sh                     # seconds per case (default 10)
#
# Cases: new keys (a fresh Idempotency-Key per request) and replays (100 keys created
# beforehand, sent round and round), each at 1 and 64 connections. Every request carries the
# peer's session cookie (the orders example and the minimal handler ignore it). Prints
# requests/s and the server's CPU per request (its user and system time over the case, from
# /proc), the ratios and the goals: orders >= 1.0x the Redis variant everywhere, >= 0.8x the
# in-memory one on replays and on new keys at c1, >= 0.8x the minimal handler on new keys at c1.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
duration=${DURATION:-10}
keys=100
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

if [[ -z "${ORDERS_BIN:-}" ]]; then
  (cd "$root" && cargo build --release --quiet --example orders)
  ORDERS_BIN=$(cd "$root" && cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/examples/orders
fi
if [[ -z "${PEER_BIN:-}" ]]; then
  (cd "$here" && cargo build --release --quiet --bin peer)
  PEER_BIN=$(cd "$here" && cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/peer
fi

servers=(orders minimal peer-moka)
[[ -n "${REDIS_URL:-}" ]] && servers+=(peer-redis)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start NAME: starts the server on a fresh file; sets ADDR, PID and COOKIE.
start() {
  local name=$1 port
  port=$(free_port)
  ADDR=127.0.0.1:$port
  case $name in
    orders) "$ORDERS_BIN" --addr "$ADDR" --db "$work/$name.db" >"$work/$name.out" 2>"$work/$name.err" & ;;
    minimal) "$PEER_BIN" --addr "$ADDR" --db "$work/$name.db" --minimal >"$work/$name.out" 2>"$work/$name.err" & ;;
    peer-moka) "$PEER_BIN" --addr "$ADDR" --db "$work/$name.db" --store moka >"$work/$name.out" 2>"$work/$name.err" & ;;
    peer-redis) "$PEER_BIN" --addr "$ADDR" --db "$work/$name.db" --store "$REDIS_URL" >"$work/$name.out" 2>"$work/$name.err" & ;;
  esac
  PID=$!
  for _ in $(seq 300); do grep -q '^listening on' "$work/$name.out" 2>/dev/null && break; sleep 0.1; done
  grep -q '^listening on' "$work/$name.out" || { echo "$name did not start:"; cat "$work/$name.err"; exit 1; }
  COOKIE=
  if [[ $name == peer-* ]]; then
    COOKIE=$(curl -s -o /dev/null -D - -X POST "http://$ADDR/login" -H 'Authorization: Bearer shop-a-token' |
      sed -n 's/^[Ss]et-[Cc]ookie: \([^;]*\).*/\1/p')
    [[ -n $COOKIE ]] || { echo "$name: login answered no cookie"; exit 1; }
  fi
  for i in $(seq $keys); do
    code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://$ADDR/orders" \
      -H 'Authorization: Bearer shop-a-token' -H "Idempotency-Key: replay-$i" \
      -H 'Content-Type: application/json' ${COOKIE:+-H "Cookie: $COOKIE"} \
      -d '{"sku":"book","quantity":1}')
    [[ $code == 201 ]] || { echo "$name: creating replay-$i answered $code"; exit 1; }
  done
}

# The server's CPU time so far (user + system), in clock ticks.
ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
tick_us=$((1000000 / $(getconf CLK_TCK)))

# measure SCRIPT CONNECTIONS: prints requests/s and the server's CPU per request in us (and
# warns of any non-2xx answer).
measure() {
  local script=$1 c=$2 threads=1 out before after prefix=()
  ((c > 1)) && threads=2
  # New keys get a prefix of the run's own; replays use the keys `start` created.
  [[ $script == new_keys.lua ]] && prefix=(KEY_PREFIX="new-$RANDOM$RANDOM")
  before=$(ticks)
  out=$(env COOKIE="$COOKIE" KEYS=$keys "${prefix[@]}" \
    wrk -t"$threads" -c"$c" -d"${duration}s" -s "$here/wrk/$script" "http://$ADDR" 2>&1)
  after=$(ticks)
  if grep -q 'Non-2xx' <<<"$out"; then
    echo "warning: $(grep 'Non-2xx' <<<"$out") ($script c$c)" >&2
  fi
  awk -v cpu="$(( (after - before) * tick_us ))" '
    /requests in/ {requests = $1}
    /^Requests\/sec:/ {rps = $2}
    END {printf "%s %.0f\n", rps, (requests > 0 ? cpu / requests : 0)}' <<<"$out"
}

# The disk's fsync latency, which bounds durable new keys at c1.
fsync_us=$( { TIMEFORMAT=%R; time dd if=/dev/zero of="$work/fsync-probe" bs=4k count=200 oflag=dsync 2>/dev/null; } 2>&1 |
  awk '{printf "%.0f", $1 * 1e6 / 200}')
echo "fsync latency: ${fsync_us} us per 4 KiB write+sync (the machine may be shared: compare ratios, not figures)"

cases=("new_keys.lua 1" "new_keys.lua 64" "replays.lua 1" "replays.lua 64")
declare -A rps cpu
for name in "${servers[@]}"; do
  start "$name"
  # Warm-up: a few seconds of new keys.
  DURATION_SAVED=$duration; duration=2; measure new_keys.lua 16 >/dev/null; duration=$DURATION_SAVED
  for case in "${cases[@]}"; do
    read -r "rps[$name,$case]" "cpu[$name,$case]" < <(measure $case)
    printf '%-10s %-9s c%-3s %10s req/s %6s us CPU/req\n' "$name" "${case%.lua *}" "${case#* }" \
      "${rps[$name,$case]}" "${cpu[$name,$case]}"
  done
  kill "$PID"; wait "$PID" 2>/dev/null || true
done

echo
echo "ratios: orders / the others, requests/s (higher is better for orders)"
met=0; missed=0
goal() { # goal CASE PEER MIN
  local r
  r=$(awk -v a="${rps[orders,$1]}" -v b="${rps[$2,$1]}" 'BEGIN {printf "%.2f", a / b}')
  if awk -v r="$r" -v m="$3" 'BEGIN {exit !(r >= m)}'; then verdict=met; met=$((met + 1)); else verdict="NOT met"; missed=$((missed + 1)); fi
  printf '  %-9s c%-3s vs %-10s %5sx   goal >= %s: %s\n' "${1%.lua *}" "${1#* }" "$2" "$r" "$3" "$verdict"
}
for case in "${cases[@]}"; do
  if [[ $case == "new_keys.lua 1" ]]; then
    goal "$case" minimal 0.8
    r=$(awk -v a="${cpu[orders,$case]}" -v b="${cpu[minimal,$case]}" 'BEGIN {printf "%.2f", a / b}')
    printf '  %-9s c%-3s vs %-10s %5sx   server CPU per request, orders / minimal (no goal)\n' new_keys 1 minimal "$r"
  fi
  [[ " ${servers[*]} " == *" peer-redis "* ]] && goal "$case" peer-redis 1.0
  if [[ $case == "new_keys.lua 64" ]]; then
    r=$(awk -v a="${rps[orders,$case]}" -v b="${rps[peer-moka,$case]}" 'BEGIN {printf "%.2f", a / b}')
    printf '  %-9s c%-3s vs %-10s %5sx   (no goal)\n' new_keys 64 peer-moka "$r"
  else
    goal "$case" peer-moka 0.8
  fi
done
echo "goals met: $met, not met: $missed"
