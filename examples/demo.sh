#!/usr/bin/env bash
# The gateway in front of an API that knows nothing of OAuth, all on this machine.
#
# Starts, on 127.0.0.1, the development token issuer (examples/dev_issuer.py), the example
# orders API (examples/legacy_api) and the gateway (config/gateway.yaml), waits until the
# gateway is ready, prints a walkthrough of curl commands to try, and stops everything on
# Ctrl-C. Logs go to a temporary directory, which is removed on a clean exit.
#
# Environment:
#   DEMO_SMOKE=1        run the walkthrough itself, check every answer, exit 1 on a mismatch
#   DEMO_PYTHON         the interpreter (.venv/bin/python)
#   DEMO_CONFIG         the gateway config (config/gateway.yaml); like that file, it should
#                       take its addresses from the DEMO_*_PORT variables below
#   DEMO_GATEWAY_PORT   8080     DEMO_ADMIN_PORT    9901
#   DEMO_API_PORT       8081     DEMO_ISSUER_PORT   9000
#   DEMO_START_TIMEOUT  seconds each process gets to become ready (20)
set -euo pipefail
# Paths given in the environment are read from where the script was started.
case ${DEMO_CONFIG:-} in
    /*) CONFIG=$DEMO_CONFIG ;;
    ?*) CONFIG=$PWD/$DEMO_CONFIG ;;
esac
case ${DEMO_PYTHON:-} in
    /*) PYTHON=$DEMO_PYTHON ;;
    */*) PYTHON=$PWD/$DEMO_PYTHON ;;
    ?*) PYTHON=$DEMO_PYTHON ;; # a command found on PATH
esac
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CONFIG=${CONFIG:-config/gateway.yaml}
SMOKE=${DEMO_SMOKE:-0}
START_TIMEOUT=${DEMO_START_TIMEOUT:-20}
# config/gateway.yaml reads these through ${DEMO_..._PORT:-default}.
export DEMO_GATEWAY_PORT=${DEMO_GATEWAY_PORT:-8080}
export DEMO_ADMIN_PORT=${DEMO_ADMIN_PORT:-9901}
export DEMO_API_PORT=${DEMO_API_PORT:-8081}
export DEMO_ISSUER_PORT=${DEMO_ISSUER_PORT:-9000}

GW="http://127.0.0.1:$DEMO_GATEWAY_PORT"
ADMIN="http://127.0.0.1:$DEMO_ADMIN_PORT"
API="http://127.0.0.1:$DEMO_API_PORT"
ISSUER="http://127.0.0.1:$DEMO_ISSUER_PORT"

die() {
    echo "demo: $*" >&2
    exit 1
}

command -v curl >/dev/null || die "curl is needed to run the walkthrough"
"$PYTHON" -c 'import aiohttp, gateway, jwt' 2>/dev/null \
    || die "$PYTHON cannot run Portcullis; 'make demo' sets up .venv first"

echo "Checking $CONFIG"
"$PYTHON" -m gateway check --config "$CONFIG" || die "$CONFIG has problems (listed above)"

# ---------------------------------------------------------------- processes

port_free() {
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    # As the servers do: connections of a previous run in TIME_WAIT do not hold the port.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        sys.exit(1)
EOF
}

for var in DEMO_GATEWAY_PORT DEMO_ADMIN_PORT DEMO_API_PORT DEMO_ISSUER_PORT; do
    port_free "${!var}" || die "port ${!var} is in use; choose another with $var=..."
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/portcullis-demo.XXXXXX")
KEYS="$WORK/keys"
PIDS=()
NAMES=()

stop_all() {
    local status=$?
    trap - EXIT INT TERM
    local pid deadline=$((SECONDS + 15))
    [ -z "${NAP:-}" ] || kill "$NAP" 2>/dev/null || true
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ "$status" -eq 0 ]; then
        rm -rf "$WORK"
    else
        echo "demo: logs kept in $WORK" >&2
    fi
    exit "$status"
}
trap stop_all EXIT
# Ctrl-C is how the interactive demo ends; in smoke mode it is an interruption.
if [ "$SMOKE" = 1 ]; then trap 'exit 130' INT; else trap 'echo; exit 0' INT; fi
trap 'exit 143' TERM

start() { # name command...
    local name=$1
    shift
    "$@" >"$WORK/$name.log" 2>&1 &
    PIDS+=("$!")
    NAMES+=("$name")
}

wait_ready() { # name url: until url answers, while the process started as name runs
    local name=$1 url=$2 pid="" i
    for i in "${!NAMES[@]}"; do [ "${NAMES[$i]}" = "$name" ] && pid=${PIDS[$i]}; done
    local deadline=$((SECONDS + START_TIMEOUT))
    until curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "demo: the $name stopped while starting; the end of its log:" >&2
            tail -n 30 "$WORK/$name.log" >&2
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            echo "demo: the $name was not ready at $url within ${START_TIMEOUT}s; its log:" >&2
            tail -n 30 "$WORK/$name.log" >&2
            exit 1
        fi
        sleep 0.1
    done
}

start issuer "$PYTHON" examples/dev_issuer.py serve --port "$DEMO_ISSUER_PORT" --keys "$KEYS"
start api "$PYTHON" -m examples.legacy_api --port "$DEMO_API_PORT"
wait_ready issuer "$ISSUER/.well-known/openid-configuration"
wait_ready api "$API/healthz"
start gateway "$PYTHON" -m gateway run --config "$CONFIG"
wait_ready gateway "$ADMIN/readyz"

echo "Running, logs in $WORK:"
echo "  dev issuer (development only)  $ISSUER"
echo "  orders API (no OAuth inside)   $API"
echo "  gateway                        $GW   (admin $ADMIN)"
echo

# ---------------------------------------------------------------- the walkthrough

MINT="$(printf %q "$PYTHON") $(printf %q "$ROOT/examples/dev_issuer.py") mint"
MINT+=" --keys $(printf %q "$KEYS") --issuer $ISSUER"
SETUP="GW=$GW
READ_TOKEN=\$($MINT --sub alice --scope 'profile orders:read')
WRITE_TOKEN=\$($MINT --sub alice --scope 'orders:read orders:write')
OTHER_API_TOKEN=\$($MINT --sub alice --scope 'orders:read' --aud billing-api)"

# Each step: the status expected | who answers: the api (the request reached it) or the
# gateway alone | a variable to set from the Location header | text the answer must contain
# | what the step shows | the command.
STEPS=$(
    cat <<'EOF'
200|api|||A public route: /healthz needs no token|curl -sS -i "$GW/healthz"
401|gateway||WWW-Authenticate: Bearer|No token: 401 with a Bearer challenge|curl -sS -i "$GW/orders"
401|gateway||invalid_token|Something that is not a signed JWT: 401 invalid_token|curl -sS -i -H "Authorization: Bearer not-a-real-token" "$GW/orders"
401|gateway||invalid_token|A token meant for another API (aud billing-api): 401 invalid_token|curl -sS -i -H "Authorization: Bearer $OTHER_API_TOKEN" "$GW/orders"
200|api||"subject":"alice"|/me: the API learns the caller from the gateway; a forged X-Auth-Subject is dropped|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" -H "X-Auth-Subject: mallory" "$GW/me"
200|api||"hasMore":true|Alice's paid or shipped orders, largest first, three per page|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW/orders?status=paid&status=shipped&sort=-totalCents&limit=3&fields=id,status,totalCents"
403|gateway||insufficient_scope|Creating an order needs orders:write: 403 insufficient_scope|curl -sS -i -X POST -H "Authorization: Bearer $READ_TOKEN" -H "Content-Type: application/json" -d '{"item": "Green tea 250 g", "quantity": 2, "totalCents": 2900}' "$GW/orders"
201|api|ORDER|"owner":"alice"|With orders:write it is created: 201 and a Location|curl -sS -i -X POST -H "Authorization: Bearer $WRITE_TOKEN" -H "Content-Type: application/json" -d '{"item": "Green tea 250 g", "quantity": 2, "totalCents": 2900}' "$GW/orders"
200|api||ETag|Read it back; the API sets ETag and Cache-Control|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW$ORDER"
422|api||validation_error|Invalid fields: 422 with one detail per field|curl -sS -i -X PUT -H "Authorization: Bearer $WRITE_TOKEN" -H "Content-Type: application/json" -d '{"item": "", "quantity": 0}' "$GW$ORDER"
204|api|||Delete it: 204|curl -sS -i -X DELETE -H "Authorization: Bearer $WRITE_TOKEN" "$GW$ORDER"
404|api||"not_found"|It is gone: 404 from the API|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW$ORDER"
404|gateway||No route|A path no route names: the gateway answers 404 itself|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW/admin/users"
EOF
)

if [ "$SMOKE" != 1 ]; then
    echo "Try it from another terminal. First the base URL and three development tokens:"
    echo
    echo "$SETUP"
    echo
    n=0
    while IFS='|' read -r expected answers capture _ what command; do
        n=$((n + 1))
        if [ "$answers" = api ]; then
            echo "# $n. $what (expect $expected)"
        else
            echo "# $n. $what (expect $expected; the API never sees it)"
        fi
        echo "$command"
        if [ -n "$capture" ]; then
            echo "$capture=/orders/...   # copy the path from the Location header of that answer"
        fi
        echo
    done <<<"$STEPS"
    echo "Logs: $WORK/{issuer,api,gateway}.log"
    echo "Press Ctrl-C to stop everything."
    while :; do
        for i in "${!PIDS[@]}"; do
            if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
                echo "demo: the ${NAMES[$i]} stopped unexpectedly; the end of its log:" >&2
                tail -n 30 "$WORK/${NAMES[$i]}.log" >&2
                exit 1
            fi
        done
        sleep 1 &
        NAP=$!
        wait "$NAP" || true
    done
fi

# Smoke mode: the same commands, run and checked.
curl() { command curl --max-time 10 "$@"; }
echo "$SETUP"
eval "$SETUP"
echo
n=0
failed=0
api_requests() { grep -c 'aiohttp.access' "$WORK/api.log" || true; }
while IFS='|' read -r expected answers capture pattern what command; do
    n=$((n + 1))
    echo "==> $n. $what"
    echo "\$ $command"
    seen=$(api_requests)
    answer=$(eval "$command" 2>&1 </dev/null) || true
    answer=$(printf '%s\n' "$answer" | tr -d '\r')
    printf '%s\n' "$answer" | sed 's/^/    /'
    status=$(printf '%s\n' "$answer" | awk 'NR == 1 { print $2 }')
    problems=()
    [ "$status" = "$expected" ] || problems+=("expected status $expected, got ${status:-no answer}")
    if [ -n "$pattern" ] && ! grep -qiF -- "$pattern" <<<"$answer"; then
        problems+=("the answer does not contain $pattern")
    fi
    if [ "$answers" = api ]; then
        # The API logs a request just after answering it: give the line a moment to appear.
        deadline=$((SECONDS + 3))
        while [ "$(api_requests)" -le "$seen" ] && ((SECONDS < deadline)); do sleep 0.05; done
        [ "$(api_requests)" -gt "$seen" ] || problems+=("the API did not get the request")
    elif [ "$(api_requests)" -ne "$seen" ]; then
        problems+=("the API got a request the gateway should have stopped")
    fi
    if [ -n "$capture" ]; then
        location=$(printf '%s\n' "$answer" | awk 'tolower($1) == "location:" { print $2; exit }')
        [ -n "$location" ] || problems+=("no Location header")
        printf -v "$capture" '%s' "$location"
    fi
    if [ "${#problems[@]}" -eq 0 ]; then
        if [ "$answers" = api ]; then echo "ok: $expected"; else echo "ok: $expected (API not reached)"; fi
    else
        failed=$((failed + 1))
        for problem in "${problems[@]}"; do echo "FAILED: $problem"; done
    fi
    echo
done <<<"$STEPS"

if [ "$failed" -ne 0 ]; then
    echo "demo smoke: $failed of $n steps did not answer as expected"
    exit 1
fi
echo "demo smoke: all $n steps answered as expected"
