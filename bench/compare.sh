#!/usr/bin/env bash
# The gateway's auth-none and warm-JWT paths of two checkouts, measured in turns.
#
#   git worktree add /tmp/base <commit>
#   BENCH_BASE=/tmp/base bash bench/compare.sh
#
# One nginx upstream and one token issuer (core 1) serve both gateways (core 0, running side
# by side, loaded one at a time by wrk on core 1). Each round loads every pair of checkout and
# route in turn, the order reversed every other round, so that a burst of load from other
# processes, or a drift of the machine, falls on both sides alike. Prints each run and the
# medians of the gateway's CPU time per request (from /proc, so whatever else runs on core 0
# does not count) and of requests/s, with the ratios warm / none and this checkout / base.
#
# Environment:
#   BENCH_BASE=            the other checkout (required); its own code runs (PYTHONPATH)
#   BENCH_ROUNDS=5         rounds (0: profile only)
#   BENCH_DURATION=5       seconds of measured load per run (after a 1 s warm-up)
#   BENCH_CONNECTIONS=64   wrk connections (one wrk thread)
#   BENCH_PROFILE=0        warm (or 1) or none: afterwards, profile each checkout's gateway
#                          under py-spy (base, then head) while wrk loads that route, for
#                          BENCH_DURATION seconds each; writes bench/out/profile-compare-
#                          ROUTE-base.txt and -head.txt (py-spy's raw format), and
#                          -summary.txt, the two side by side (bench/profile_summary.py --base)
#   BENCH_PYSPY_ARGS=--function   py-spy flags (e.g. "--native", or "" for line numbers)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=bench/configs.sh
. "$ROOT/bench/configs.sh"
BASE=${BENCH_BASE:?BENCH_BASE must name the checkout to compare with}
BASE=$(cd "$BASE" && pwd)
ROUNDS=${BENCH_ROUNDS:-5}
DURATION=${BENCH_DURATION:-5}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
PROFILE=${BENCH_PROFILE:-0}
[ "$PROFILE" = 1 ] && PROFILE=warm
case $PROFILE in 0 | warm | none) ;; *) echo "BENCH_PROFILE=$PROFILE: use 1, warm or none" >&2; exit 2 ;; esac
PY=$ROOT/.venv/bin/python
[ -x "$PY" ] || { echo "$PY not found: run 'make bench' once (it creates .venv)" >&2; exit 1; }
for tool in wrk taskset curl; do
    command -v "$tool" >/dev/null || { echo "$tool is needed (see bench/run.sh)" >&2; exit 1; }
done
NGINX_BIN=$(command -v nginx || echo /usr/sbin/nginx)

TMP=$(mktemp -d /tmp/portcullis-compare.XXXXXX)
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

read -r P_NGINX P_ISSUER P_BASE P_BASE_ADMIN P_HEAD P_HEAD_ADMIN < <(free_ports 6)

nginx_upstream_config "$TMP/nginx.conf"
taskset -c 1 "$NGINX_BIN" -c "$TMP/nginx.conf" -e "$TMP/nginx-error.log" -g 'daemon off;' &
PIDS+=($!)
cd "$ROOT"
taskset -c 1 "$PY" bench/issuer.py --port "$P_ISSUER" --kid bench-es256 \
    --private-key "$TMP/issuer-private.pem" --public-key "$TMP/issuer-public.pem" \
    >"$TMP/issuer.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$P_ISSUER/.well-known/openid-configuration" >/dev/null && break
    sleep 0.1
done
TOKEN=$("$PY" bench/mktoken.py --key "$TMP/issuer-private.pem" --kid bench-es256 \
    --issuer "http://127.0.0.1:$P_ISSUER" --audience bench-api --scope "bench:read")

# gateway SIDE DIR PORT ADMIN-PORT: the gateway of checkout DIR on core 0; sets PID_<SIDE>.
gateway() {
    local side=$1 dir=$2 port=$3 admin=$4
    cat >"$TMP/$side.yaml" <<EOF
listen: "127.0.0.1:$port"
admin_listen: "127.0.0.1:$admin"
upstream: {url: "http://127.0.0.1:$P_NGINX", connect_timeout: 2s, read_timeout: 10s}
issuers:
  - issuer: "http://127.0.0.1:$P_ISSUER"
    audiences: [bench-api]
    algorithms: [ES256]
routes:
  - {name: public, path: "/public/**", auth: none}
  - {name: api, path: "/api/**", scopes: {any: ["bench:read"]}}
token_cache_size: 100000
shutdown_grace: 1s
log_level: warning
EOF
    (cd "$dir" && PYTHONPATH=$dir exec taskset -c 0 "$PY" -m gateway run --config "$TMP/$side.yaml") \
        >"$TMP/$side.log" 2>&1 &
    PIDS+=($!)
    printf -v "PID_$side" '%s' "$!"
    local _
    for _ in $(seq 200); do
        curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null && break
        sleep 0.1
    done
    local body
    body=$(curl -s -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$port/api/items")
    [ "$body" = ok ] || { cat "$TMP/$side.log" >&2; echo "$side: the warm path fails" >&2; exit 1; }
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/api/items")" = 401 ] ||
        { echo "$side: a request without a token is not refused" >&2; exit 1; }
}
gateway base "$BASE" "$P_BASE" "$P_BASE_ADMIN"
gateway head "$ROOT" "$P_HEAD" "$P_HEAD_ADMIN"

ticks() { awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

# run SIDE ROUTE: one warm-up and one measured wrk run; appends "SIDE ROUTE rps us" to results.
run() {
    local side=$1 route=$2 port pid
    if [ "$side" = base ]; then port=$P_BASE pid=$PID_base; else port=$P_HEAD pid=$PID_head; fi
    local url="http://127.0.0.1:$port/$route/items" args=(-H "Authorization: Bearer $TOKEN")
    taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d1s "$url" "${args[@]}" >/dev/null
    local before after out
    before=$(ticks "$pid")
    out=$(taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" "$url" "${args[@]}")
    after=$(ticks "$pid")
    if grep -q -E 'Non-2xx|Socket errors' <<<"$out"; then
        echo "$side $route: errors" >&2
        grep -E 'Non-2xx|Socket errors' <<<"$out" >&2
    fi
    local requests rps
    requests=$(awk '/requests in/ { print $1 }' <<<"$out")
    rps=$(awk '/Requests\/sec/ { print $2 }' <<<"$out")
    if [ "${requests:-0}" -eq 0 ]; then
        echo "$side $route: no request answered (run left out)" >&2
        return
    fi
    local us=$(((after - before) * 1000000 / HZ * 10 / requests))
    us=$(awk -v t="$us" 'BEGIN { printf "%.1f", t / 10 }')
    echo "$side $route $rps $us" | tee -a "$TMP/results" >&2
}

for round in $(seq "$ROUNDS"); do
    echo "round $round" >&2
    sides=(base head) routes=(public api)
    if [ $((round % 2)) = 0 ]; then sides=(head base) routes=(api public); fi
    for side in "${sides[@]}"; do
        for route in "${routes[@]}"; do run "$side" "$route"; done
    done
done

if [ -s "$TMP/results" ]; then
"$PY" - "$TMP/results" "$BASE" <<'EOF'
import statistics
import sys

runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
for line in open(sys.argv[1]):
    side, route, rps, us = line.split()
    runs.setdefault((side, route), []).append((float(rps), float(us)))
median = {
    key: (statistics.median(r for r, _ in v), statistics.median(u for _, u in v), len(v))
    for key, v in runs.items()
}
print(f"base: {sys.argv[2]}; medians of each side's runs")
print()
print("| checkout | route | runs | requests/s | server CPU per request |")
print("| --- | --- | ---: | ---: | ---: |")
for side in ("base", "head"):
    for route, name in (("public", "auth none"), ("api", "warm JWT")):
        rps, us, n = median[(side, route)]
        print(f"| {side} | {name} | {n} | {rps:,.0f} | {us:.0f} µs |")
print()
print("| ratio | requests/s | by server CPU per request |")
print("| --- | ---: | ---: |")
for side in ("base", "head"):
    none, warm = median[(side, "public")], median[(side, "api")]
    print(f"| {side}: warm / none | {warm[0] / none[0]:.2f} | {none[1] / warm[1]:.2f} |")
for route, name in (("public", "auth none"), ("api", "warm JWT")):
    base, head = median[("base", route)], median[("head", route)]
    print(f"| {name}: head / base | {head[0] / base[0]:.2f} | {base[1] / head[1]:.2f} |")
EOF
fi

# profile SIDE ROUTE: py-spy attached to SIDE's gateway (from core 1, beside wrk) while wrk
# loads ROUTE; the raw profile goes to bench/out/profile-compare-MODE-SIDE.txt.
profile() {
    local side=$1 route=$2 port pid
    if [ "$side" = base ]; then port=$P_BASE pid=$PID_base; else port=$P_HEAD pid=$PID_head; fi
    taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"$((DURATION + 3))s" \
        "http://127.0.0.1:$port/$route/items" -H "Authorization: Bearer $TOKEN" >/dev/null &
    local load=$!
    PIDS+=("$load")
    sleep 1
    echo "profiling $side ($route) for ${DURATION}s" >&2
    # shellcheck disable=SC2086 # extra flags are words
    taskset -c 1 "$SPY" record --duration "$DURATION" --rate 250 --format raw \
        --output "$OUT/profile-compare-$PROFILE-$side.txt" ${BENCH_PYSPY_ARGS---function} \
        --pid "$pid" >"$TMP/py-spy-$side.log" 2>&1 ||
        { cat "$TMP/py-spy-$side.log" >&2; echo "py-spy could not profile $side" >&2; exit 1; }
    wait "$load" || true
}

if [ "$PROFILE" != 0 ]; then
    SPY=$ROOT/.venv/bin/py-spy
    [ -x "$SPY" ] || "$PY" -m pip install --quiet py-spy
    OUT=$ROOT/bench/out
    mkdir -p "$OUT"
    route=public
    [ "$PROFILE" = warm ] && route=api
    profile base "$route"
    profile head "$route"
    echo
    "$PY" bench/profile_summary.py "$OUT/profile-compare-$PROFILE-head.txt" \
        --base "$OUT/profile-compare-$PROFILE-base.txt" |
        tee "$OUT/profile-compare-$PROFILE-summary.txt"
fi
