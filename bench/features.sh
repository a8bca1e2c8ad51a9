#!/usr/bin/env bash
# Load test of the gateway's costlier features against its JWT baseline, in one run.
#
#   bash bench/features.sh
#
# Same conventions as bench/run.sh: its own nginx (upstream), token issuer (bench/issuer.py,
# tokens from bench/mktoken.py), a small introspection endpoint and the gateway, on free
# 127.0.0.1 ports; the gateway pinned to core 0 and wrk (and the helpers) to core 1; a
# warm-up then the measured run per scenario; the server's CPU per request from /proc; every
# process stopped on exit. Scenarios (all through one gateway, one worker):
#
#   jwt            /api/**      the same ES256 JWT on every request (warm token cache)
#   introspection  /api/**      an opaque token, introspected once, then from the cache
#                               (a second gateway in mode: introspection; target >= 0.85 x jwt)
#   limited        /limited/**  the route of `jwt` plus an in-memory rate limit far above the
#                               load (never rejects; target >= 0.90 x jwt)
#
# Environment: BENCH_DURATION (10), BENCH_WARMUP (2), BENCH_CONNECTIONS (64),
# BENCH_FEATURES="jwt introspection limited", BENCH_KEEP=0 (1 keeps the temporary directory).
# The report goes to stdout and bench/out/features.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=bench/configs.sh
. bench/configs.sh
PY=$ROOT/.venv/bin/python
DURATION=${BENCH_DURATION:-10}
WARMUP=${BENCH_WARMUP:-2}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
SCENARIOS=" ${BENCH_FEATURES-jwt introspection limited} "
OUT=$ROOT/bench/out
SERVER_CPU=0
CLIENT_CPU=1

wanted() { [[ $SCENARIOS == *" $1 "* ]]; }
log() { printf '[features] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------------------- tools

ensure_tools() {
    local missing=()
    command -v wrk >/dev/null || missing+=(wrk)
    command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
    command -v taskset >/dev/null || missing+=(util-linux)
    command -v curl >/dev/null || missing+=(curl)
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}; install them or run as root"
    log "installing ${missing[*]}"
    local no_start=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        no_start=/usr/sbin/policy-rc.d
    fi
    local status=0
    {
        apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${missing[@]}"
    } >/dev/null || status=$?
    [ -n "$no_start" ] && rm -f "$no_start"
    [ "$status" -eq 0 ] || die "apt-get install ${missing[*]} failed"
}

ensure_tools
export PATH=$PATH:/usr/sbin:/sbin
[ -x "$PY" ] || die "$PY not found: run 'make bench' first (it creates .venv)"
if [ "$(nproc)" -lt 2 ]; then
    log "warning: fewer than 2 cores; server and wrk share one"
    CLIENT_CPU=0
fi

# ---------------------------------------------------------------------------- processes

TMP=$(mktemp -d /tmp/portcullis-features.XXXXXX)
RAW=$TMP/raw
mkdir -p "$RAW" "$OUT"
PIDS=()

stop_pid() {
    local pid=$1 i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local status=$? i
    trap - EXIT INT TERM
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        stop_pid "${PIDS[$i]}"
    done
    if [ "$status" -ne 0 ]; then
        mkdir -p "$OUT/logs"
        cp "$TMP"/*.log "$OUT/logs/" 2>/dev/null || true
        log "failed; logs copied to bench/out/logs/"
    fi
    if [ "${BENCH_KEEP:-0}" = 1 ]; then
        log "kept $TMP"
    else
        rm -rf "$TMP"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start NAME CPU COMMAND...: runs COMMAND pinned to CPU, output to $TMP/NAME.log; sets LAST_PID.
start() {
    local name=$1 cpu=$2
    shift 2
    taskset -c "$cpu" "$@" >"$TMP/$name.log" 2>&1 &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

stop_started() {
    stop_pid "$1"
    local kept=() pid
    for pid in "${PIDS[@]}"; do [ "$pid" != "$1" ] && kept+=("$pid"); done
    PIDS=("${kept[@]}")
}

# wait_status URL STATUS PID NAME: until URL answers STATUS; fails if PID dies or 20 s pass.
wait_status() {
    local url=$1 want=$2 pid=$3 name=$4 i code
    for i in $(seq 200); do
        kill -0 "$pid" 2>/dev/null || { cat "$TMP/$name.log" >&2; die "$name exited"; }
        code=$(curl -s -o /dev/null -w '%{http_code}' "$url" || true)
        [ "$code" = "$want" ] && return 0
        sleep 0.1
    done
    cat "$TMP/$name.log" >&2
    die "$name: $url did not answer $want"
}

# expect WHAT STATUS BODY URL [CURL ARGS...]: one request must give STATUS (and BODY if set).
expect() {
    local what=$1 want=$2 body=$3 url=$4
    shift 4
    local got
    got=$(curl -s -o "$TMP/body" -w '%{http_code}' "$@" "$url" || true)
    if [ "$got" != "$want" ] || { [ -n "$body" ] && [ "$(cat "$TMP/body")" != "$body" ]; }; then
        die "check failed: $what: expected $want ${body:+\"$body\"}, got $got \"$(head -c 300 "$TMP/body")\""
    fi
    log "ok: $what -> $got"
}

read -r P_NGINX P_ISSUER P_INTROSPECT P_GW P_GW_ADMIN < <(free_ports 5)
NGINX=http://127.0.0.1:$P_NGINX
ISSUER=http://127.0.0.1:$P_ISSUER
INTROSPECT=http://127.0.0.1:$P_INTROSPECT
GATEWAY=http://127.0.0.1:$P_GW

# ---------------------------------------------------------------------------- measuring

cpu_snapshot() { grep -E "^cpu($SERVER_CPU|$CLIENT_CPU) " /proc/stat >"$1"; }
cpu_snapshot "$RAW/idle.cpu-before"
sleep 1
cpu_snapshot "$RAW/idle.cpu-after"

# server_ticks FILE: CPU time (utime + stime, in clock ticks) of the gateway, all threads.
server_ticks() {
    awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$GATEWAY_PID/stat" >"$1" 2>/dev/null ||
        echo 0 >"$1"
}

# measure KEY URL WRK-ARGS...: warm-up, then the measured run with CPU snapshots around it.
measure() {
    local key=$1 url=$2
    shift 2
    log "scenario $key: warm-up ${WARMUP}s"
    taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"${WARMUP}s" "$url" "$@" >/dev/null
    log "scenario $key: ${DURATION}s"
    cpu_snapshot "$RAW/$key.cpu-before"
    server_ticks "$RAW/$key.server-before"
    taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url" "$@" \
        >"$RAW/$key.txt"
    cpu_snapshot "$RAW/$key.cpu-after"
    server_ticks "$RAW/$key.server-after"
    grep -E 'Requests/sec|^ +(50|99)%|Non-2xx|Socket errors' "$RAW/$key.txt" >&2 || true
}

# ---------------------------------------------------------------------------- upstream, issuer

nginx_upstream_config "$TMP/nginx.conf"
# The upstream and the helpers run next to wrk: core 0 belongs to the gateway.
start nginx "$CLIENT_CPU" nginx -p "$TMP/nginx" -e "$TMP/nginx-error.log" -c "$TMP/nginx.conf" \
    -g 'daemon off;'
wait_status "$NGINX/" 200 "$LAST_PID" nginx

start issuer "$CLIENT_CPU" "$PY" bench/issuer.py --port "$P_ISSUER" --kid bench-es256 \
    --private-key "$TMP/issuer-private.pem" --public-key "$TMP/issuer-public.pem"
wait_status "$ISSUER/.well-known/openid-configuration" 200 "$LAST_PID" issuer
MKTOKEN=("$PY" bench/mktoken.py --key "$TMP/issuer-private.pem" --kid bench-es256
    --issuer "$ISSUER" --audience bench-api --scope "bench:read")
TOKEN=$("${MKTOKEN[@]}")
OPAQUE=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')

# An RFC 7662 endpoint for the introspection scenario: the opaque token is active, anything
# else is not. Warm-cache load asks it once per cache_ttl, so its own speed does not matter.
cat >"$TMP/introspect.py" <<'EOF'
import base64, sys, time
from aiohttp import web

port, issuer, token = int(sys.argv[1]), sys.argv[2], sys.argv[3]
expected = "Basic " + base64.b64encode(b"bench-gateway:bench-secret").decode()
calls = 0


async def introspect(request):
    global calls
    calls += 1
    if request.headers.get("Authorization") != expected:
        return web.json_response({"error": "invalid_client"}, status=401)
    form = await request.post()
    if form.get("token") != token:
        return web.json_response({"active": False})
    now = int(time.time())
    return web.json_response({
        "active": True, "iss": issuer, "sub": "user-0", "aud": "bench-api",
        "client_id": "bench-client", "scope": "bench:read", "token_type": "Bearer",
        "iat": now, "exp": now + 3600,
    }, headers={"Cache-Control": "no-store"})


async def count(_):
    return web.Response(text=str(calls))

app = web.Application()
app.router.add_post("/introspect", introspect)
app.router.add_get("/calls", count)
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
EOF
start introspect "$CLIENT_CPU" "$PY" "$TMP/introspect.py" "$P_INTROSPECT" "$ISSUER" "$OPAQUE"
wait_status "$INTROSPECT/calls" 200 "$LAST_PID" introspect

# ---------------------------------------------------------------------------- gateways

# gateway_config FILE ISSUER-ENTRY: the bench routes; the same for every scenario.
gateway_config() {
    cat >"$1" <<EOF
listen: "127.0.0.1:$P_GW"
admin_listen: "127.0.0.1:$P_GW_ADMIN"
upstream: {url: "$NGINX", connect_timeout: 2s, read_timeout: 10s}
issuers:
$2
routes:
  - {name: api, path: "/api/**", scopes: {any: ["bench:read"]}}
  - name: limited
    path: "/limited/**"
    scopes: {any: ["bench:read"]}
    rate_limit: {rate: 10000000/s, burst: 10000000, key: subject}
token_cache_size: 100000
shutdown_grace: 1s
log_level: warning
EOF
    .venv/bin/portcullis-gateway check --config "$1" >/dev/null
}

gateway_config "$TMP/gateway-jwt.yaml" "  - {issuer: \"$ISSUER\", audiences: [bench-api], algorithms: [ES256]}"
gateway_config "$TMP/gateway-introspection.yaml" "  - issuer: \"$ISSUER\"
    audiences: [bench-api]
    mode: introspection
    introspection:
      url: \"$INTROSPECT/introspect\"
      client_id: bench-gateway
      client_secret: bench-secret
      cache_ttl: 60s"

start_gateway() {
    start gateway "$SERVER_CPU" .venv/bin/portcullis-gateway run --config "$1"
    GATEWAY_PID=$LAST_PID
    wait_status "http://127.0.0.1:$P_GW_ADMIN/readyz" 200 "$GATEWAY_PID" gateway
}

if wanted jwt || wanted limited; then
    start_gateway "$TMP/gateway-jwt.yaml"
    expect "jwt: valid token" 200 ok "$GATEWAY/api/items" -H "Authorization: Bearer $TOKEN"
    expect "jwt: identity sent upstream" 200 "user-0 bench:read" "$GATEWAY/api/whoami" \
        -H "Authorization: Bearer $TOKEN"
    expect "jwt: no token" 401 "" "$GATEWAY/api/items"
    expect "limited: valid token" 200 ok "$GATEWAY/limited/items" -H "Authorization: Bearer $TOKEN"
    curl -s -D - -o /dev/null -H "Authorization: Bearer $TOKEN" "$GATEWAY/limited/items" |
        grep -qi '^RateLimit: "limited";r=' || die "limited: no RateLimit field on the answer"
    log "ok: limited: RateLimit field on the answer"
    if wanted jwt; then
        measure jwt "$GATEWAY/api/items" -H "Authorization: Bearer $TOKEN"
    fi
    if wanted limited; then
        measure limited "$GATEWAY/limited/items" -H "Authorization: Bearer $TOKEN"
    fi
    stop_started "$GATEWAY_PID"
fi

if wanted introspection; then
    start_gateway "$TMP/gateway-introspection.yaml"
    expect "introspection: active token" 200 ok "$GATEWAY/api/items" -H "Authorization: Bearer $OPAQUE"
    expect "introspection: identity sent upstream" 200 "user-0 bench:read" "$GATEWAY/api/whoami" \
        -H "Authorization: Bearer $OPAQUE"
    expect "introspection: unknown token" 401 "" "$GATEWAY/api/items" \
        -H "Authorization: Bearer not-$OPAQUE"
    measure introspection "$GATEWAY/api/items" -H "Authorization: Bearer $OPAQUE"
    INTROSPECTION_CALLS=$(curl -s "$INTROSPECT/calls")
    stop_started "$GATEWAY_PID"
fi

# ---------------------------------------------------------------------------- report

{
    echo "date=$(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "nproc=$(nproc)"
    echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    echo "duration=$DURATION"
    echo "warmup=$WARMUP"
    echo "connections=$CONNECTIONS"
    echo "clk_tck=$(getconf CLK_TCK)"
    echo "introspection_calls=${INTROSPECTION_CALLS:-n/a}"
} >"$RAW/meta"

"$PY" - "$RAW" "$OUT/features.md" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from report import cpu_use, parse_wrk, read_meta  # noqa: E402

raw, out = Path(sys.argv[1]), Path(sys.argv[2])
meta = read_meta(raw / "meta")
clk = int(meta.get("clk_tck", "100"))
labels = {
    "jwt": "JWT, warm token cache (`/api/**`, baseline)",
    "introspection": "opaque token, introspection mode, warm cache (`/api/**`)",
    "limited": "JWT, warm, in-memory rate limit that never rejects (`/limited/**`)",
}
results, cpu = {}, {}
for key in labels:
    if (raw / f"{key}.txt").exists():
        results[key] = parse_wrk((raw / f"{key}.txt").read_text())
        cpu[key] = cpu_use(raw, key, results[key].requests, clk)
idle = cpu_use(raw, "idle", 0, clk)
lines = [
    f"# Portcullis gateway feature bench — {meta.get('date', '')}",
    "",
    f"Machine: {meta.get('nproc')} cores, {meta.get('cpu')}; gateway pinned to core 0, wrk to"
    f" core 1. wrk -t1 -c{meta.get('connections')} --latency, {meta.get('duration')} s per"
    f" scenario after a {meta.get('warmup')} s warm-up.",
]
if idle is not None:
    load = " / ".join(f"{v:.0%}" for _, v in sorted(idle.busy.items()))
    lines.append(f"Load from other processes before the run (core 0 / core 1): {load}.")
lines += [
    "",
    "| scenario | requests/s | p50 | p99 | gateway CPU per request | non-2xx / socket errors |",
    "| --- | ---: | ---: | ---: | ---: | ---: |",
]
for key, label in labels.items():
    r = results.get(key)
    if r is None:
        lines.append(f"| {label} | not run | | | | |")
        continue
    use = cpu.get(key)
    per = f"{use.server_us_per_request:,.0f} µs" if use and use.server_us_per_request else "n/a"
    flag = f"{r.non_2xx} / {r.socket_errors}"
    if r.non_2xx or r.socket_errors:
        flag = f"**{flag} (invalid)**"
    lines.append(
        f"| {label} | {r.requests_per_s:,.0f} | {r.p50_ms:.2f} ms | {r.p99_ms:.2f} ms | {per} | {flag} |"
    )
lines += ["", "| ratio (requests/s) | value | target |", "| --- | ---: | --- |"]
for top, target in (("introspection", 0.85), ("limited", 0.90)):
    a, b = results.get(top), results.get("jwt")
    if a and b:
        ratio = a.requests_per_s / b.requests_per_s
        verdict = "met" if ratio >= target else "NOT met"
        lines.append(f"| {top} / jwt | {ratio:.2f} | >= {target:.2f}: {verdict} |")
lines += [
    "",
    f"Introspection calls during the introspection scenario: {meta.get('introspection_calls')}"
    " (cache_ttl 60s: the cache stayed warm).",
    "",
]
report = "\n".join(lines)
sys.stdout.write(report)
out.write_text(report)
EOF
