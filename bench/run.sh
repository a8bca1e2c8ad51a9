#!/usr/bin/env bash
# Load test of the Portcullis gateway against a fast upstream and a reference peer.
#
#   make bench                     (or: bash bench/run.sh)
#
# Installs wrk, nginx and HAProxy with apt-get when they are missing, starts its own nginx,
# token issuer, gateway and HAProxy on free 127.0.0.1 ports, runs five scenarios with wrk,
# and writes a markdown table to stdout and bench/out/latest.md. Every process it starts is
# stopped on exit; nothing is left running.
#
# Environment:
#   BENCH_DURATION=10      seconds of measured load per scenario
#   BENCH_WARMUP=2         seconds of unmeasured load before each scenario
#   BENCH_CONNECTIONS=64   wrk connections (one wrk thread)
#   BENCH_TOKENS=200000    distinct tokens for the fresh-token scenario
#   BENCH_SCENARIOS="direct none warm cold haproxy"   the scenarios to run
#   BENCH_PROFILE=0        1 (or warm): afterwards, profile the gateway under py-spy during
#                          the warm-JWT load and write bench/out/profile-warm*.txt;
#                          cold: the same with the token cache off (every request verified)
#                          (BENCH_SCENARIOS= BENCH_PROFILE=1 profiles only)
#   BENCH_PYSPY_ARGS=--function   py-spy flags (e.g. "--native", or "" for line numbers)
#   BENCH_KEEP=0           1: keep the temporary directory (configs, logs) after the run
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
DURATION=${BENCH_DURATION:-10}
WARMUP=${BENCH_WARMUP:-2}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
TOKENS=${BENCH_TOKENS:-200000}
PROFILE=${BENCH_PROFILE:-0}
SCENARIOS=" ${BENCH_SCENARIOS-direct none warm cold haproxy} "
OUT=$ROOT/bench/out
SERVER_CPU=0
CLIENT_CPU=1
WRK_ARGS="-t1 -c$CONNECTIONS --latency"

wanted() { [[ $SCENARIOS == *" $1 "* ]]; }
log() { printf '[bench] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------------------- tools

ensure_tools() {
    local missing=()
    command -v wrk >/dev/null || missing+=(wrk)
    command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
    command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
    command -v taskset >/dev/null || missing+=(util-linux)
    command -v curl >/dev/null || missing+=(curl)
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}; install them or run as root"
    log "installing ${missing[*]}"
    # Packaged services must not start: this script runs its own copies, in the foreground.
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
[ -x "$PY" ] || die "$PY not found: run 'make bench' (it creates .venv first)"
if [ "$(nproc)" -lt 2 ]; then
    log "warning: fewer than 2 cores; server and wrk share one"
    CLIENT_CPU=0
fi

# ---------------------------------------------------------------------------- processes

TMP=$(mktemp -d /tmp/portcullis-bench.XXXXXX)
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

# expect NAME STATUS BODY URL [CURL ARGS...]: one request must give STATUS (and BODY if set).
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

stop_started() {
    stop_pid "$1"
    local kept=() pid
    for pid in "${PIDS[@]}"; do [ "$pid" != "$1" ] && kept+=("$pid"); done
    PIDS=("${kept[@]}")
}

read -r P_NGINX P_ISSUER P_GW P_GW_ADMIN P_HAPROXY < <(
    "$PY" -c '
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()
'
)
NGINX=http://127.0.0.1:$P_NGINX
ISSUER=http://127.0.0.1:$P_ISSUER
GATEWAY=http://127.0.0.1:$P_GW
HAPROXY=http://127.0.0.1:$P_HAPROXY

# ---------------------------------------------------------------------------- wrk

cpu_snapshot() { grep -E "^cpu($SERVER_CPU|$CLIENT_CPU) " /proc/stat >"$1"; }

# Whatever else runs on the machine skews every figure: measure it once before starting.
cpu_snapshot "$RAW/idle.cpu-before"
sleep 1
cpu_snapshot "$RAW/idle.cpu-after"

# server_ticks FILE: CPU time (utime + stime, in clock ticks) of SERVER_PIDS, all threads.
server_ticks() {
    local pid total=0 ticks
    for pid in "${SERVER_PIDS[@]}"; do
        # Fields after "pid (comm) ": utime and stime are the 12th and 13th.
        ticks=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$pid/stat" 2>/dev/null || echo 0)
        total=$((total + ticks))
    done
    echo "$total" >"$1"
}

# measure KEY URL WRK-ARGS...: a warm-up (with WARM_ARGS when set, else the same arguments),
# then the measured run, saved with the busy time of both cores and the CPU time used by
# the server under test (SERVER_PIDS), which tells its cost per request even when something
# else on the machine takes a share of core 0.
measure() {
    local key=$1 url=$2
    shift 2
    local warm=("$@")
    if [ ${#WARM_ARGS[@]} -gt 0 ]; then warm=("${WARM_ARGS[@]}"); fi
    log "scenario $key: warm-up ${WARMUP}s"
    # The URL comes first: wrk passes whatever follows `--` to its script.
    taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"${WARMUP}s" "$url" "${warm[@]}" >/dev/null
    log "scenario $key: ${DURATION}s"
    cpu_snapshot "$RAW/$key.cpu-before"
    server_ticks "$RAW/$key.server-before"
    taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url" "$@" \
        >"$RAW/$key.txt"
    cpu_snapshot "$RAW/$key.cpu-after"
    server_ticks "$RAW/$key.server-after"
    grep -E 'Requests/sec|^ +(50|99)%|Non-2xx|Socket errors|Fresh tokens' "$RAW/$key.txt" >&2 || true
}
WARM_ARGS=()
SERVER_PIDS=()

# ---------------------------------------------------------------------------- 1. nginx

mkdir -p "$TMP/nginx"
cat >"$TMP/nginx.conf" <<EOF
worker_processes 1;
pid $TMP/nginx.pid;
error_log $TMP/nginx-error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx/body;
    proxy_temp_path $TMP/nginx/proxy;
    fastcgi_temp_path $TMP/nginx/fastcgi;
    uwsgi_temp_path $TMP/nginx/uwsgi;
    scgi_temp_path $TMP/nginx/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 60s;
    server {
        listen 127.0.0.1:$P_NGINX;
        default_type text/plain;
        location / { return 200 "ok"; }
        # What the upstream received from a proxy: lets the checks see identity headers.
        location = /api/whoami { return 200 "\$http_x_auth_subject \$http_x_auth_scopes"; }
    }
}
EOF
start nginx "$SERVER_CPU" nginx -p "$TMP/nginx" -e "$TMP/nginx-error.log" -c "$TMP/nginx.conf" \
    -g 'daemon off;'
NGINX_PID=$LAST_PID
wait_status "$NGINX/" 200 "$NGINX_PID" nginx
# shellcheck disable=SC2207 # pids are words
SERVER_PIDS=("$NGINX_PID" $(pgrep -P "$NGINX_PID" || true))
expect "nginx direct" 200 ok "$NGINX/items"
if wanted direct; then
    measure direct "$NGINX/items"
fi

# From here nginx is the upstream, not the server under test: core 0 belongs to the proxy.
for pid in "${SERVER_PIDS[@]}"; do
    taskset -a -p -c "$CLIENT_CPU" "$pid" >/dev/null
done

# ---------------------------------------------------------------------------- issuer, tokens

start issuer "$CLIENT_CPU" "$PY" bench/issuer.py --port "$P_ISSUER" --kid bench-es256 \
    --private-key "$TMP/issuer-private.pem" --public-key "$TMP/issuer-public.pem"
ISSUER_PID=$LAST_PID
wait_status "$ISSUER/.well-known/openid-configuration" 200 "$ISSUER_PID" issuer
MKTOKEN=("$PY" bench/mktoken.py --key "$TMP/issuer-private.pem" --kid bench-es256
    --issuer "$ISSUER" --audience bench-api --scope "bench:read")
TOKEN=$("${MKTOKEN[@]}")
TAMPERED=$("${MKTOKEN[@]}" --tamper)
EXPIRED=$("${MKTOKEN[@]}" --lifetime -3600)
OTHER_AUDIENCE=$("${MKTOKEN[@]}" --audience other-api)
OTHER_SCOPE=$("${MKTOKEN[@]}" --scope "bench:write")
if wanted cold; then
    log "signing $TOKENS fresh tokens"
    "${MKTOKEN[@]}" --count "$TOKENS" --out "$TMP/tokens.txt"
    [ "$(sort -u "$TMP/tokens.txt" | wc -l)" -eq "$TOKENS" ] || die "tokens are not all distinct"
fi

# ---------------------------------------------------------------------------- gateway

# gateway_config FILE CACHE-SIZE
gateway_config() {
    cat >"$1" <<EOF
listen: "127.0.0.1:$P_GW"
admin_listen: "127.0.0.1:$P_GW_ADMIN"
upstream: {url: "$NGINX", connect_timeout: 2s, read_timeout: 10s}
issuers:
  - issuer: "$ISSUER"
    audiences: [bench-api]
    algorithms: [ES256]
routes:
  - {name: public, path: "/public/**", auth: none}
  - {name: api, path: "/api/**", scopes: {any: ["bench:read"]}}
token_cache_size: $2
shutdown_grace: 1s
log_level: warning
EOF
    .venv/bin/portcullis-gateway check --config "$1" >/dev/null
}

# start_gateway CONFIG: runs the gateway on core 0 and waits for /readyz.
start_gateway() {
    start gateway "$SERVER_CPU" .venv/bin/portcullis-gateway run --config "$1"
    GATEWAY_PID=$LAST_PID
    wait_status "http://127.0.0.1:$P_GW_ADMIN/readyz" 200 "$GATEWAY_PID" gateway
    SERVER_PIDS=("$GATEWAY_PID")
}

# check_proxy NAME URL: the proxy lets the valid token through with the identity it carries,
# and refuses what it must, so that its throughput measures real checks.
check_proxy() {
    local name=$1 url=$2
    expect "$name: valid token" 200 ok "$url/api/items" -H "Authorization: Bearer $TOKEN"
    expect "$name: identity sent upstream" 200 "user-0 bench:read" "$url/api/whoami" \
        -H "Authorization: Bearer $TOKEN" -H "X-Auth-Subject: spoofed"
    expect "$name: no token" 401 "" "$url/api/items"
    expect "$name: tampered signature" 401 "" "$url/api/items" -H "Authorization: Bearer $TAMPERED"
    expect "$name: expired token" 401 "" "$url/api/items" -H "Authorization: Bearer $EXPIRED"
    expect "$name: other audience" 401 "" "$url/api/items" \
        -H "Authorization: Bearer $OTHER_AUDIENCE"
    expect "$name: scope missing" 403 "" "$url/api/items" -H "Authorization: Bearer $OTHER_SCOPE"
}

gateway_config "$TMP/gateway-warm.yaml" 100000
gateway_config "$TMP/gateway-cold.yaml" 0

if wanted none || wanted warm; then
    start_gateway "$TMP/gateway-warm.yaml"
    expect "gateway: auth none" 200 ok "$GATEWAY/public/items"
    check_proxy gateway "$GATEWAY"
    if wanted none; then
        measure none "$GATEWAY/public/items"
    fi
    if wanted warm; then
        measure warm "$GATEWAY/api/items" -H "Authorization: Bearer $TOKEN"
    fi
    stop_started "$GATEWAY_PID"
fi

if wanted cold; then
    start_gateway "$TMP/gateway-cold.yaml"
    check_proxy "gateway (token cache off)" "$GATEWAY"
    # Warm-up with the one token: with the cache off it takes the same path as a fresh
    # token, and the token file stays unused until the measured run.
    WARM_ARGS=(-H "Authorization: Bearer $TOKEN")
    measure cold "$GATEWAY/api/items" -s bench/fresh_tokens.lua -- "$TMP/tokens.txt" 1
    WARM_ARGS=()
    stop_started "$GATEWAY_PID"
fi

# ---------------------------------------------------------------------------- HAProxy

if wanted haproxy; then
    # Checks what the gateway's route needs: signature and alg, iss, aud, exp, scope. Client
    # copies of identity headers are dropped; the subject and scopes are sent upstream.
    cat >"$TMP/haproxy.cfg" <<EOF
global
    nbthread 1
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    timeout http-keep-alive 60s
frontend bench
    bind 127.0.0.1:$P_HAPROXY
    http-request del-header X-Auth-Subject
    http-request del-header X-Auth-Scopes
    http-request set-var(txn.bearer) http_auth_bearer
    http-request deny deny_status 401 unless { var(txn.bearer) -m found }
    http-request set-var(txn.alg) var(txn.bearer),jwt_header_query('\$.alg')
    http-request deny deny_status 401 unless { var(txn.alg) -m str ES256 }
    http-request deny deny_status 401 unless { var(txn.bearer),jwt_verify(ES256,"$TMP/issuer-public.pem") -m int 1 }
    http-request set-var(txn.iss) var(txn.bearer),jwt_payload_query('\$.iss')
    http-request deny deny_status 401 unless { var(txn.iss) -m str $ISSUER }
    http-request set-var(txn.aud) var(txn.bearer),jwt_payload_query('\$.aud')
    http-request deny deny_status 401 unless { var(txn.aud) -m str bench-api }
    http-request set-var(txn.now) date
    http-request set-var(txn.exp) var(txn.bearer),jwt_payload_query('\$.exp','int')
    http-request deny deny_status 401 unless { var(txn.exp),sub(txn.now) -m int gt 0 }
    http-request set-var(txn.scope) var(txn.bearer),jwt_payload_query('\$.scope')
    http-request deny deny_status 403 unless { var(txn.scope) -m reg '(^| )bench:read( |\$)' }
    http-request set-header X-Auth-Subject %[var(txn.bearer),jwt_payload_query('\$.sub')]
    http-request set-header X-Auth-Scopes %[var(txn.scope)]
    default_backend upstream
backend upstream
    http-reuse always
    server nginx 127.0.0.1:$P_NGINX
EOF
    haproxy -c -q -f "$TMP/haproxy.cfg" || die "haproxy rejected its config"
    start haproxy "$SERVER_CPU" haproxy -db -f "$TMP/haproxy.cfg"
    HAPROXY_PID=$LAST_PID
    wait_status "$HAPROXY/api/items" 401 "$HAPROXY_PID" haproxy
    SERVER_PIDS=("$HAPROXY_PID")
    check_proxy haproxy "$HAPROXY"
    measure haproxy "$HAPROXY/api/items" -H "Authorization: Bearer $TOKEN"
    stop_started "$HAPROXY_PID"
fi

# ---------------------------------------------------------------------------- report

{
    echo "date=$(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "nproc=$(nproc)"
    echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    echo "duration=$DURATION"
    echo "warmup=$WARMUP"
    echo "wrk_args=$WRK_ARGS"
    echo "tokens=$TOKENS"
    echo "clk_tck=$(getconf CLK_TCK)"
    echo "versions=$("$PY" -c 'import sys, aiohttp; print(f"Python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}")'), $(nginx -v 2>&1 | sed 's/.*: //'), $(haproxy -v | head -1 | cut -d' ' -f1-3), $(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2)"
} >"$RAW/meta"
status=0
[ "$SCENARIOS" = "  " ] || "$PY" bench/report.py --raw "$RAW" --meta "$RAW/meta" --out "$OUT/latest.md" || status=$?

# ---------------------------------------------------------------------------- profile

# Attaches py-spy to the running gateway; when it cannot attach (or BENCH_PROFILE_LAUNCH=1),
# py-spy launches the gateway itself instead.
[ "$PROFILE" = 1 ] && PROFILE=warm
if [ "$PROFILE" = warm ] || [ "$PROFILE" = cold ]; then
    SPY=$ROOT/.venv/bin/py-spy
    [ -x "$SPY" ] || "$PY" -m pip install --quiet py-spy
    # shellcheck disable=SC2206 # extra flags are words
    SPY_ARGS=(record --duration "$DURATION" --rate 250 --format raw
        --output "$OUT/profile-$PROFILE.txt" ${BENCH_PYSPY_ARGS---function})
    start_gateway "$TMP/gateway-$PROFILE.yaml"
    spy_load() {
        taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"$((DURATION + 4))s" \
            -H "Authorization: Bearer $TOKEN" "$GATEWAY/api/items" >"$OUT/profile-$PROFILE-wrk.txt" &
        WRK_PID=$!
        PIDS+=("$WRK_PID")
        sleep 2
    }
    spy_load
    log "profiling the gateway under $PROFILE-JWT load for ${DURATION}s"
    if [ "${BENCH_PROFILE_LAUNCH:-0}" = 1 ] ||
        ! taskset -c "$CLIENT_CPU" "$SPY" "${SPY_ARGS[@]}" --pid "$GATEWAY_PID" \
            >"$TMP/py-spy.log" 2>&1; then
        cat "$TMP/py-spy.log" >&2 2>/dev/null || true
        log "py-spy launches the gateway instead of attaching"
        wait "$WRK_PID" || true
        stop_started "$GATEWAY_PID"
        start py-spy "$SERVER_CPU" "$SPY" "${SPY_ARGS[@]}" -- \
            "$PY" -m gateway run --config "$TMP/gateway-$PROFILE.yaml"
        SPY_PID=$LAST_PID
        wait_status "http://127.0.0.1:$P_GW_ADMIN/readyz" 200 "$SPY_PID" py-spy
        GATEWAY_PID=$(pgrep -P "$SPY_PID" | head -1)
        PIDS+=("$GATEWAY_PID")
        spy_load
        # py-spy stops after --duration and writes the profile; the gateway may outlive it.
        wait "$SPY_PID" || die "py-spy failed: $(tail -5 "$TMP/py-spy.log")"
    fi
    wait "$WRK_PID" || true
    stop_started "$GATEWAY_PID"
    "$PY" bench/profile_summary.py "$OUT/profile-$PROFILE.txt" |
        tee "$OUT/profile-$PROFILE-summary.txt"
fi
exit "$status"
