#!/usr/bin/env bash
# The gateway in front of an API that knows nothing of OAuth, with Portcullis's authorization
# server issuing the tokens, all on this machine.
#
# Starts, on 127.0.0.1, the authorization server (config/authserver.yaml), the example orders
# API (examples/legacy_api), the gateway (config/gateway.yaml), the example web app
# (examples/web_client) and the example single-page app (examples/spa), waits until each is
# ready, prints a walkthrough (curl commands, the machine client, and browser links), and
# stops everything on Ctrl-C. Logs go to a
# temporary directory, which is removed on a clean exit unless DEMO_KEEP_LOGS=1 (what `make
# demo` sets); so is the authorization server's state (database and signing keys) unless
# DEMO_STATE_DIR names a directory to keep it in.
#
# Environment:
#   DEMO_SMOKE=1          run the walkthrough itself (and a sign-in through the web app without
#                         a browser), check every answer, exit 1 on a mismatch
#   DEMO_PYTHON           the interpreter (.venv/bin/python)
#   DEMO_CONFIG           the gateway config (config/gateway.yaml)
#   DEMO_AUTH_CONFIG      the authorization server config (config/authserver.yaml); both take
#                         their addresses from the DEMO_*_PORT variables below
#   DEMO_STATE_DIR        where the authorization server keeps its database and keys (default:
#                         a fresh temporary directory per run)
#   DEMO_KEEP_LOGS=1      keep the logs after a clean exit too (a failed run always keeps
#                         them); the script names their directory when it stops
#   DEMO_GATEWAY_PORT 8080   DEMO_ADMIN_PORT 9901   DEMO_API_PORT 8081
#   DEMO_AUTH_PORT    9000   DEMO_WEB_PORT   8082   DEMO_SPA_PORT 8083
#   DEMO_AUTH_ADMIN_PORT 9902
#   DEMO_MACHINE_SECRET, DEMO_WEB_SECRET   the demo clients' secrets (published demo values
#                         by default; config/authserver.yaml reads the same variables)
#   DEMO_START_TIMEOUT    seconds each process gets to become ready (20)
set -euo pipefail
# Paths given in the environment are read from where the script was started.
case ${DEMO_CONFIG:-} in
    /*) CONFIG=$DEMO_CONFIG ;;
    ?*) CONFIG=$PWD/$DEMO_CONFIG ;;
esac
case ${DEMO_AUTH_CONFIG:-} in
    /*) AUTH_CONFIG=$DEMO_AUTH_CONFIG ;;
    ?*) AUTH_CONFIG=$PWD/$DEMO_AUTH_CONFIG ;;
esac
case ${DEMO_STATE_DIR:-} in
    /*) STATE=$DEMO_STATE_DIR ;;
    ?*) STATE=$PWD/$DEMO_STATE_DIR ;;
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
AUTH_CONFIG=${AUTH_CONFIG:-config/authserver.yaml}
SMOKE=${DEMO_SMOKE:-0}
KEEP_LOGS=${DEMO_KEEP_LOGS:-0}
START_TIMEOUT=${DEMO_START_TIMEOUT:-20}
# The configs read these through ${DEMO_...:-default}, with the same defaults.
export DEMO_GATEWAY_PORT=${DEMO_GATEWAY_PORT:-8080}
export DEMO_ADMIN_PORT=${DEMO_ADMIN_PORT:-9901}
export DEMO_API_PORT=${DEMO_API_PORT:-8081}
export DEMO_AUTH_PORT=${DEMO_AUTH_PORT:-9000}
export DEMO_WEB_PORT=${DEMO_WEB_PORT:-8082}
export DEMO_SPA_PORT=${DEMO_SPA_PORT:-8083}
export DEMO_AUTH_ADMIN_PORT=${DEMO_AUTH_ADMIN_PORT:-9902}
export DEMO_MACHINE_SECRET=${DEMO_MACHINE_SECRET:-demo-machine-secret-not-for-production-use}
export DEMO_WEB_SECRET=${DEMO_WEB_SECRET:-demo-web-secret-not-for-production-use}
# The demo user, as config/authserver.yaml has them (only the password's hash is there).
DEMO_USER=alice
DEMO_PASSWORD=wonderland

GW="http://127.0.0.1:$DEMO_GATEWAY_PORT"
ADMIN="http://127.0.0.1:$DEMO_ADMIN_PORT"
API="http://127.0.0.1:$DEMO_API_PORT"
AUTH="http://127.0.0.1:$DEMO_AUTH_PORT"
WEB="http://127.0.0.1:$DEMO_WEB_PORT"
SPA="http://127.0.0.1:$DEMO_SPA_PORT"

die() {
    echo "demo: $*" >&2
    exit 1
}

command -v curl >/dev/null || die "curl is needed to run the walkthrough"
"$PYTHON" -c 'import aiohttp, authserver, gateway, jinja2, jwt' 2>/dev/null \
    || die "$PYTHON cannot run Portcullis; 'make demo' sets up .venv first"

echo "Checking $AUTH_CONFIG and $CONFIG"
# check requires the database's directory; a fresh state directory is made further down, so
# until then any existing directory stands in for it.
[ -z "${STATE:-}" ] || mkdir -p "$STATE"
DEMO_STATE_DIR=${STATE:-${TMPDIR:-/tmp}} "$PYTHON" -m authserver check --config "$AUTH_CONFIG" \
    >/dev/null || die "$AUTH_CONFIG has problems (listed above)"
"$PYTHON" -m gateway check --config "$CONFIG" >/dev/null || die "$CONFIG has problems (listed above)"

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

for var in DEMO_GATEWAY_PORT DEMO_ADMIN_PORT DEMO_API_PORT DEMO_AUTH_PORT DEMO_WEB_PORT \
    DEMO_SPA_PORT DEMO_AUTH_ADMIN_PORT; do
    port_free "${!var}" || die "port ${!var} is in use; choose another with $var=..."
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/portcullis-demo.XXXXXX")
# The authorization server's database and keys: fresh each run unless the caller keeps them.
export DEMO_STATE_DIR=${STATE:-$WORK/state}
mkdir -p "$DEMO_STATE_DIR"
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
    if [ "$status" -eq 0 ] && [ "$KEEP_LOGS" = 1 ]; then
        # The logs only: a fresh state directory goes as on any clean exit.
        [ -n "${STATE:-}" ] || rm -rf "$WORK/state"
        echo "demo: logs kept in $WORK" >&2
    elif [ "$status" -eq 0 ]; then
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

DEMO_NAME=demo
# shellcheck source=examples/processes.sh
. "$ROOT/examples/processes.sh"

start authserver "$PYTHON" -m authserver run --config "$AUTH_CONFIG"
start api "$PYTHON" -m examples.legacy_api --port "$DEMO_API_PORT"
wait_ready authserver "$AUTH/.well-known/openid-configuration"
wait_ready api "$API/healthz"
# The gateway is ready once it holds the authorization server's keys.
start gateway "$PYTHON" -m gateway run --config "$CONFIG"
# The secret travels in the environment, not on the command line where `ps` shows it.
WEB_CLIENT_SECRET=$DEMO_WEB_SECRET start web "$PYTHON" -m examples.web_client \
    --port "$DEMO_WEB_PORT" --issuer "$AUTH" --client-id demo-web --api "$GW"
# The single-page app: a public client, so no secret; CORS lets its origin call the gateway.
start spa "$PYTHON" -m examples.spa --port "$DEMO_SPA_PORT" --issuer "$AUTH" --client-id demo-spa \
    --api "$GW"
wait_ready gateway "$ADMIN/readyz"
wait_ready web "$WEB/"
wait_ready spa "$SPA/"

echo "Running, logs in $WORK:"
echo "  authorization server           $AUTH   (state in $DEMO_STATE_DIR)"
echo "  orders API (no OAuth inside)   $API"
echo "  gateway                        $GW   (admin $ADMIN)"
echo "  example web app                $WEB/"
echo "  example single-page app        $SPA/"
echo

# ---------------------------------------------------------------- the walkthrough

# The addresses, and three access tokens the machine client gets by client_credentials: one
# with orders:read only, one with orders:write too, one for another API (RFC 8707 resource).
# curl -u sends the id and secret as they are; RFC 6749 §2.3.1 would form-encode them first,
# which changes nothing for these characters.
SETUP=$(
    cat <<EOF
GW=$GW
AUTH=$AUTH
WEB=$WEB
SPA=$SPA
REPO=$(printf %q "$ROOT")
PY=$(printf %q "$PYTHON")
MACHINE_SECRET=$(printf %q "$DEMO_MACHINE_SECRET")
token() { curl -sS -u "demo-machine:\$MACHINE_SECRET" -d grant_type=client_credentials "\$@" "\$AUTH/token" | sed -n 's/.*"access_token":"\([^"]*\)".*/\1/p'; }
READ_TOKEN=\$(token -d scope=orders:read)
WRITE_TOKEN=\$(token -d 'scope=orders:read orders:write')
OTHER_API_TOKEN=\$(token -d scope=orders:read -d resource=billing-api)
EOF
)

# Each step: what is expected (an HTTP status, or exit0 for a program that must succeed) |
# who answers: the api (the request reached it), the gateway alone, or the authserver alone |
# a variable to set from the Location header | text the answer must contain | what the step
# shows | the command.
STEPS=$(
    cat <<'EOF'
200|authserver||"token_type":"Bearer"|The machine client's token: client_credentials, its id and secret in HTTP Basic|curl -sS -i -u "demo-machine:$MACHINE_SECRET" -d grant_type=client_credentials -d scope=orders:read "$AUTH/token"
401|authserver||invalid_client|A wrong secret: 401 invalid_client|curl -sS -i -u demo-machine:not-the-secret -d grant_type=client_credentials "$AUTH/token"
400|authserver||invalid_scope|A scope the client is not registered for: 400 invalid_scope|curl -sS -i -u "demo-machine:$MACHINE_SECRET" -d grant_type=client_credentials -d scope=admin "$AUTH/token"
400|authserver||Access-Control-Allow-Origin|The single-page app's page may read the token endpoint's answers, refusals too: its origin is that of demo-spa's redirect URI (CORS)|curl -sS -i -H "Origin: $SPA" -d grant_type=refresh_token -d refresh_token=not-a-refresh-token -d client_id=demo-spa "$AUTH/token"
200|api|||A public route: /healthz needs no token|curl -sS -i "$GW/healthz"
401|gateway||WWW-Authenticate: Bearer|No token: 401 with a Bearer challenge|curl -sS -i "$GW/orders"
401|gateway||invalid_token|Something that is not a signed JWT: 401 invalid_token|curl -sS -i -H "Authorization: Bearer not-a-real-token" "$GW/orders"
401|gateway||invalid_token|A token meant for another API (resource=billing-api, so aud billing-api): 401 invalid_token|curl -sS -i -H "Authorization: Bearer $OTHER_API_TOKEN" "$GW/orders"
200|api||"subject":"demo-machine"|/me: the API learns the caller from the gateway; a forged X-Auth-Subject is dropped|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" -H "X-Auth-Subject: mallory" "$GW/me"
200|api||"data":[|The machine client's own orders (none yet): orders:read is enough|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW/orders?limit=5"
403|gateway||insufficient_scope|Creating an order needs orders:write, which READ_TOKEN lacks: 403 insufficient_scope|curl -sS -i -X POST -H "Authorization: Bearer $READ_TOKEN" -H "Content-Type: application/json" -d '{"item": "Green tea 250 g", "quantity": 2, "totalCents": 2900}' "$GW/orders"
201|api|ORDER|"owner":"demo-machine"|With orders:write it is created: 201 and a Location|curl -sS -i -X POST -H "Authorization: Bearer $WRITE_TOKEN" -H "Content-Type: application/json" -d '{"item": "Green tea 250 g", "quantity": 2, "totalCents": 2900}' "$GW/orders"
200|api||ETag|Read it back; the API sets ETag and Cache-Control|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW$ORDER"
422|api||validation_error|Invalid fields: 422 with one detail per field|curl -sS -i -X PUT -H "Authorization: Bearer $WRITE_TOKEN" -H "Content-Type: application/json" -d '{"item": "", "quantity": 0}' "$GW$ORDER"
204|api|||Delete it: 204|curl -sS -i -X DELETE -H "Authorization: Bearer $WRITE_TOKEN" "$GW$ORDER"
404|api||"not_found"|It is gone: 404 from the API|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW$ORDER"
404|gateway||No route|A path no route names: the gateway answers 404 itself|curl -sS -i -H "Authorization: Bearer $READ_TOKEN" "$GW/admin/users"
204|gateway||Access-Control-Allow-Origin|The single-page app's origin asks first (a CORS preflight, as its browser does before sending a token): the gateway allows it|curl -sS -i -X OPTIONS -H "Origin: $SPA" -H "Access-Control-Request-Method: GET" -H "Access-Control-Request-Headers: authorization" "$GW/orders"
403|gateway||cors_refused|Any other origin is refused, with no CORS header: its page cannot send a token|curl -sS -i -X OPTIONS -H "Origin: http://evil.example" -H "Access-Control-Request-Method: GET" -H "Access-Control-Request-Headers: authorization" "$GW/orders"
exit0|api||GET /orders?limit=5 -> 200|The machine client in Python: discovery, client_credentials, then /me and /orders|$PY "$REPO/examples/machine_client.py" --issuer "$AUTH" --client-id demo-machine --client-secret "$MACHINE_SECRET" --api "$GW"
exit0|api||sign-in, API call, refresh and sign-out all worked|Alice signs in to the web app, as a browser would (login form, consent, callback), calls the API, refreshes and signs out|(cd "$REPO" && $PY -m examples.web_client.signin --url "$WEB" --username alice --password wonderland --expect-sub alice)
EOF
)

if [ "$SMOKE" != 1 ]; then
    echo "Open $WEB/ in a browser and sign in as $DEMO_USER, password $DEMO_PASSWORD: the web app"
    echo "sends you to the authorization server to sign in and allow access, shows the claims of"
    echo "your ID token, and calls the orders API through the gateway with your access token."
    echo "$SPA/ does the same from the browser itself: a single-page app, a public client with"
    echo "PKCE, its tokens in the tab's memory, calling the gateway across origins (CORS)."
    echo
    echo "Or try it from another terminal. First the addresses and three access tokens:"
    echo
    echo "$SETUP"
    echo
    n=0
    while IFS='|' read -r expected answers capture _ what command; do
        n=$((n + 1))
        case $expected/$answers in
            exit0/*) echo "# $n. $what" ;;
            */api) echo "# $n. $what (expect $expected)" ;;
            */gateway) echo "# $n. $what (expect $expected; the API never sees it)" ;;
            *) echo "# $n. $what (expect $expected from the authorization server)" ;;
        esac
        echo "$command"
        if [ -n "$capture" ]; then
            echo "$capture=/orders/...   # copy the path from the Location header of that answer"
        fi
        echo
    done <<<"$STEPS"
    echo "Logs: $WORK/{authserver,api,gateway,web,spa}.log"
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
# Without -e inside: a failed token request leaves its variable empty, reported just below.
eval "$SETUP" || true
[ -n "$READ_TOKEN" ] && [ -n "$WRITE_TOKEN" ] && [ -n "$OTHER_API_TOKEN" ] \
    || die "the authorization server issued no token to demo-machine; see $WORK/authserver.log"
echo
n=0
failed=0
api_requests() { grep -c 'aiohttp.access' "$WORK/api.log" || true; }
while IFS='|' read -r expected answers capture pattern what command; do
    n=$((n + 1))
    echo "==> $n. $what"
    echo "\$ $command"
    seen=$(api_requests)
    if answer=$(eval "$command" 2>&1 </dev/null); then rc=0; else rc=$?; fi
    answer=$(printf '%s\n' "$answer" | tr -d '\r')
    printf '%s\n' "$answer" | sed 's/^/    /'
    problems=()
    if [ "$expected" = exit0 ]; then
        outcome="exit $rc"
        [ "$rc" -eq 0 ] || problems+=("expected exit status 0, got $rc")
    else
        outcome=$(printf '%s\n' "$answer" | awk 'NR == 1 { print $2 }')
        [ "$outcome" = "$expected" ] || problems+=("expected status $expected, got ${outcome:-no answer}")
    fi
    if [ -n "$pattern" ] && ! grep -qiF -- "$pattern" <<<"$answer"; then
        problems+=("the answer does not contain $pattern")
    fi
    if [ "$answers" = api ]; then
        # The API logs a request just after answering it: give the line a moment to appear.
        deadline=$((SECONDS + 3))
        while [ "$(api_requests)" -le "$seen" ] && ((SECONDS < deadline)); do sleep 0.05; done
        [ "$(api_requests)" -gt "$seen" ] || problems+=("the API did not get the request")
    elif [ "$(api_requests)" -ne "$seen" ]; then
        problems+=("the API got a request the $answers should have stopped")
    fi
    if [ -n "$capture" ]; then
        location=$(printf '%s\n' "$answer" | awk 'tolower($1) == "location:" { print $2; exit }')
        [ -n "$location" ] || problems+=("no Location header")
        printf -v "$capture" '%s' "$location"
    fi
    if [ "${#problems[@]}" -eq 0 ]; then
        case $answers in
            api) echo "ok: $outcome" ;;
            gateway) echo "ok: $outcome (API not reached)" ;;
            *) echo "ok: $outcome (authorization server)" ;;
        esac
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
