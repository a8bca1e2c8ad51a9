#!/usr/bin/env bash
# Instructions per request of the gateway, auth none against warm JWT, counted by valgrind's
# callgrind: the figure of the warm path's own cost that a busy or drifting machine does not
# move (wrk's requests/s on a shared virtual machine swing by more than the 5% the two
# routes differ by).
#
#   make bench-instructions        (or: bash bench/instructions.sh)
#
# Starts its own nginx upstream and token issuer, as bench/run.sh does, and the gateway of
# the warm scenario (bench/configs.sh gateway_config) under callgrind with counting off.
# After a warm-up of both routes, each round counts the gateway's instructions over exactly
# BENCH_INSTRUCTION_REQUESTS requests of the auth-none route, then of the warm route (the
# same request bytes, bench/keepalive_client.py), and prints them per request. A second table
# counts the MCP figures the same way: the RFC 9728 metadata document against auth none, and
# a tools/call POST on a route with per-call rules against the same POST on a route without
# them (BENCH_INSTRUCTION_MCP=0 leaves it out). A third counts the authorization server's
# instructions per client_credentials token request (ES256, SQLite, the bench's token-es256
# configuration), the same way (BENCH_INSTRUCTION_TOKEN=0 leaves it out), and with
# BENCH_INSTRUCTION_OIDC=1 those of oidc-provider (bench/oidc_server.mjs, installed with npm
# as bench/run.sh does) on the same requests, after a longer warm-up for its JIT. Installs
# valgrind, nginx and curl with apt-get when they are missing. Everything it starts is
# stopped on exit.
#
# Environment:
#   BENCH_INSTRUCTION_REQUESTS=2000    requests per route and round
#   BENCH_INSTRUCTION_CONNECTIONS=8    keep-alive connections they are spread over
#   BENCH_INSTRUCTION_ROUNDS=3         rounds (auth none, then warm, each round)
#   BENCH_INSTRUCTION_MCP=1            also count the MCP routes (0: not)
#   BENCH_INSTRUCTION_TOKEN=1          also count the token endpoint (0: not)
#   BENCH_INSTRUCTION_OIDC=0           also count oidc-provider's (1; minutes under valgrind)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
REQUESTS=${BENCH_INSTRUCTION_REQUESTS:-2000}
CONNECTIONS=${BENCH_INSTRUCTION_CONNECTIONS:-8}
ROUNDS=${BENCH_INSTRUCTION_ROUNDS:-3}
MCP=${BENCH_INSTRUCTION_MCP:-1}
TOKEN_ENDPOINT=${BENCH_INSTRUCTION_TOKEN:-1}
OIDC=${BENCH_INSTRUCTION_OIDC:-0}
OUT=$ROOT/bench/out

log() { echo "[instructions] $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

[ -x "$PY" ] || die "$PY not found: run 'make bench-instructions' (it creates .venv first)"
export PATH=$PATH:/usr/sbin:/sbin
missing=()
command -v valgrind >/dev/null || missing+=(valgrind)
command -v nginx >/dev/null || missing+=(nginx-light)
command -v curl >/dev/null || missing+=(curl)
if [ "${BENCH_INSTRUCTION_OIDC:-0}" = 1 ]; then
    command -v node >/dev/null || missing+=(nodejs)
    command -v npm >/dev/null || missing+=(npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}; install them or run as root"
    log "installing ${missing[*]}"
    {
        apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${missing[@]}"
    } >/dev/null || die "apt-get install ${missing[*]} failed"
fi

TMP=$(mktemp -d)
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

# shellcheck source=bench/configs.sh
source bench/configs.sh
read -r P_NGINX P_ISSUER P_GW P_GW_ADMIN P_AS P_AS_ADMIN P_OIDC < <(free_ports 7)
NGINX=http://127.0.0.1:$P_NGINX
ISSUER=http://127.0.0.1:$P_ISSUER

# wait_for URL NAME PID: until URL answers 200; fails if PID exits or 60 s pass (the gateway
# starts slowly under valgrind).
wait_for() {
    local i
    for i in $(seq 600); do
        kill -0 "$3" 2>/dev/null || { cat "$TMP/$2.log" >&2 || true; die "$2 exited"; }
        curl -sf -o /dev/null "$1" && return 0
        sleep 0.1
    done
    die "$2: $1 did not answer"
}

nginx_upstream_config "$TMP/nginx.conf"
nginx -p "$TMP/nginx" -e "$TMP/nginx-error.log" -c "$TMP/nginx.conf" -g 'daemon off;' \
    >"$TMP/nginx.log" 2>&1 &
PIDS+=($!)
wait_for "$NGINX/" nginx "${PIDS[-1]}"
"$PY" bench/issuer.py --port "$P_ISSUER" --kid bench-es256 \
    --private-key "$TMP/issuer-private.pem" --public-key "$TMP/issuer-public.pem" \
    >"$TMP/issuer.log" 2>&1 &
PIDS+=($!)
wait_for "$ISSUER/.well-known/openid-configuration" issuer "${PIDS[-1]}"
TOKEN=$("$PY" bench/mktoken.py --key "$TMP/issuer-private.pem" --kid bench-es256 \
    --issuer "$ISSUER" --audience bench-api --scope "bench:read")

# The MCP routes, with the same scopes as api: a plain route (the body streamed on, as to
# any API), an MCP route without per-call rules (the message read and checked), and one with
# three rules, the second of which the bench's call meets.
export BENCH_EXTRA_ROUTES='  - {name: mcp-plain, path: /plain/mcp, scopes: {any: ["bench:read"]}}
  - {name: mcp-bare, path: /bare/mcp, scopes: {any: ["bench:read"]}, mcp: {}}
  - name: mcp
    path: /mcp
    scopes: {any: ["bench:read"]}
    mcp:
      calls:
        - {method: tools/call, name: "delete_*", scopes: {all: ["bench:admin"]}}
        - {method: tools/call, name: "get_*", scopes: {all: ["bench:read"]}}
        - {method: resources/read, scopes: {all: ["bench:read"]}}'
printf '%s' '{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"get_item","arguments":{"id":42}}}' \
    >"$TMP/call.json"
gateway_config "$TMP/gateway.yaml" 100000
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$TMP/callgrind.%p" \
    "$PY" -m gateway run --config "$TMP/gateway.yaml" >"$TMP/gateway.log" 2>&1 &
GATEWAY_PID=$!
PIDS+=("$GATEWAY_PID")
log "gateway under callgrind (pid $GATEWAY_PID), waiting for it"
wait_for "http://127.0.0.1:$P_GW_ADMIN/readyz" gateway "$GATEWAY_PID"

# load ROUTE N: N requests of ROUTE: public and api (GETs of /ROUTE/items), metadata (the
# api resource's RFC 9728 document, no token), mcp, mcp-bare and mcp-plain (the tools/call
# POST).
load() {
    local args=(--port "$P_GW" --requests "$2" --connections "$CONNECTIONS")
    case $1 in
    metadata) args+=(--path /.well-known/oauth-protected-resource/api) ;;
    mcp | mcp-plain | mcp-bare)
        args+=(--path "$(case $1 in mcp) echo /mcp ;; mcp-plain) echo /plain/mcp ;;
            *) echo /bare/mcp ;; esac)" --method POST
            --body "$TMP/call.json" --header "Content-Type: application/json"
            --header "Accept: application/json, text/event-stream"
            --authorization "Bearer $TOKEN") ;;
    token | oidc)
        args=(--port "$(if [ "$1" = token ]; then echo "$P_AS"; else echo "$P_OIDC"; fi)"
            --requests "$2" --connections "$CONNECTIONS" --path /token
            --method POST --body "$TMP/token-form"
            --header "Content-Type: application/x-www-form-urlencoded"
            --authorization "Basic $BASIC") ;;
    *) args+=(--path "/$1/items" --authorization "Bearer $TOKEN") ;;
    esac
    "$PY" bench/keepalive_client.py "${args[@]}"
}

# count ROUTE [PID]: the instructions per request of the gateway (or of process PID) over
# REQUESTS requests of ROUTE.
count() {
    local before after dump total pid=${2:-$GATEWAY_PID}
    callgrind_control --zero "$pid" >/dev/null 2>&1
    callgrind_control --instr=on "$pid" >/dev/null 2>&1
    load "$1" "$REQUESTS"
    callgrind_control --instr=off "$pid" >/dev/null 2>&1
    before=$(find "$TMP" -name 'callgrind.*.*' | wc -l)
    callgrind_control --dump="$1" "$pid" >/dev/null 2>&1
    for _ in $(seq 100); do
        after=$(find "$TMP" -name 'callgrind.*.*' | wc -l)
        [ "$after" -gt "$before" ] && break
        sleep 0.1
    done
    dump=$(find "$TMP" -name 'callgrind.*.*' -printf '%T@ %p\n' | sort -n | tail -1 | cut -d' ' -f2)
    total=$(awk '/^totals:/ { print $2; exit }' "$dump")
    [ -n "$total" ] || die "no totals in $dump"
    echo $((total / REQUESTS))
}

log "warm-up: $REQUESTS requests of each route, not counted"
load public "$REQUESTS"
load api "$REQUESTS"
if [ "$MCP" = 1 ]; then
        for route in metadata mcp-plain mcp-bare mcp; do load "$route" "$REQUESTS"; done
    fi
    echo "| round | auth none: instructions per request | warm JWT | warm − none | none / warm |"
    echo "| ---: | ---: | ---: | ---: | ---: |"
    gaps=()
    for round in $(seq "$ROUNDS"); do
        none=$(count public)
        warm=$(count api)
        gaps+=($((warm - none)))
        printf '| %d | %d | %d | %d | %s |\n' "$round" "$none" "$warm" $((warm - none)) \
            "$("$PY" -c "print(f'{$none / $warm:.3f}')")"
    done
    median=$(printf '%s\n' "${gaps[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    echo
    echo "Median gap: $median instructions per request ($REQUESTS requests per route and round," \
        "$CONNECTIONS connections; the rest of a request is the same on both routes)."

    ratio() { "$PY" -c "print(f'{$1 / $2:.3f}')"; }
    if [ "$MCP" = 1 ]; then
    echo
    echo "| round | auth none | metadata document | none / metadata | POST, plain route | POST, MCP route, no call rules | POST, MCP route, call rules | plain / rules | no rules / rules |"
    echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for round in $(seq "$ROUNDS"); do
        none=$(count public)
        metadata=$(count metadata)
        plain=$(count mcp-plain)
        bare=$(count mcp-bare)
        rules=$(count mcp)
        printf '| %d | %d | %d | %s | %d | %d | %d | %s | %s |\n' "$round" "$none" "$metadata" \
            "$(ratio "$none" "$metadata")" "$plain" "$bare" "$rules" "$(ratio "$plain" "$rules")" \
            "$(ratio "$bare" "$rules")"
    done
    echo
    echo "A ratio of 1 or more: the metadata document costs no more than auth none, the call rules"
    echo "nothing beyond the route without them (instructions per request, not time)."
fi

[ "$TOKEN_ENDPOINT" = 1 ] || exit 0
# The authorization server of the token-es256 scenario (bench/configs.sh authserver_config),
# started under callgrind as the gateway is; one client, client_secret_basic.
AUTHSERVER=http://127.0.0.1:$P_AS
CLIENT_ID=bench
CLIENT_SECRET=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(30))')
BASIC=$(printf '%s:%s' "$CLIENT_ID" "$CLIENT_SECRET" | base64 -w0)
printf 'grant_type=client_credentials&scope=bench:read' >"$TMP/token-form"
authserver_config ES256
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$TMP/callgrind.%p" \
    "$PY" -m authserver run --config "$AUTHSERVER_CONFIG" >"$TMP/authserver.log" 2>&1 &
AUTHSERVER_PID=$!
PIDS+=("$AUTHSERVER_PID")
log "authserver under callgrind (pid $AUTHSERVER_PID), waiting for it"
wait_for "$AUTHSERVER/healthz" authserver "$AUTHSERVER_PID"
log "warm-up: $REQUESTS token requests, not counted"
load token "$REQUESTS"
if [ "$OIDC" = 1 ]; then
    ensure_oidc_provider
    NODE_ENV=production BENCH_CLIENT_SECRET="$CLIENT_SECRET" \
        valgrind --tool=callgrind --smc-check=all-non-file --instr-atstart=no \
        --callgrind-out-file="$TMP/callgrind.%p" node bench/oidc_server.mjs \
        --modules "$OIDC_MODULES" --port "$P_OIDC" --alg ES256 --client-id "$CLIENT_ID" \
        >"$TMP/oidc.log" 2>&1 &
    OIDC_PID=$!
    PIDS+=("$OIDC_PID")
    log "oidc-provider $OIDC_VERSION under callgrind (pid $OIDC_PID), waiting for it"
    wait_for "http://127.0.0.1:$P_OIDC/.well-known/openid-configuration" oidc "$OIDC_PID"
    # Its JIT compiles the hot path over the first thousands of requests.
    log "warm-up: $((REQUESTS * 5)) token requests to oidc-provider, not counted"
    load oidc $((REQUESTS * 5))
fi
echo
if [ "$OIDC" = 1 ]; then
    echo "| round | token endpoint, client_credentials ES256: instructions per request | oidc-provider | oidc-provider / ours |"
    echo "| ---: | ---: | ---: | ---: |"
else
    echo "| round | token endpoint, client_credentials ES256: instructions per request |"
    echo "| ---: | ---: |"
fi
for round in $(seq "$ROUNDS"); do
    ours=$(count token "$AUTHSERVER_PID")
    if [ "$OIDC" = 1 ]; then
        theirs=$(count oidc "$OIDC_PID")
        printf '| %d | %d | %d | %s |\n' "$round" "$ours" "$theirs" "$(ratio "$theirs" "$ours")"
    else
        printf '| %d | %d |\n' "$round" "$ours"
    fi
done
echo
echo "User-space instructions only: the kernel's share of a request (its reads and writes) is"
echo "not counted, nor time spent waiting."
