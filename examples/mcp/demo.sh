#!/usr/bin/env bash
# An MCP server behind the gateway, with Portcullis's authorization server issuing the
# tokens, all on this machine: what `make mcp-demo` runs.
#
# Starts, on 127.0.0.1, the authorization server (examples/mcp/authserver.yaml), the example
# MCP server (examples/mcp/server.py) and the gateway (examples/mcp/gateway.yaml), waits
# until each is ready, prints the URL to give an MCP client and the discovery steps to try
# with curl, and stops everything on Ctrl-C (or SIGTERM). Logs and the authorization
# server's state (database, signing keys, registered clients) go to a temporary directory,
# named when the demo stops; MCP_DEMO_STATE_DIR keeps the state elsewhere.
#
# Environment:
#   MCP_DEMO_PYTHON           the interpreter (.venv/bin/python)
#   MCP_DEMO_AUTH_CONFIG      the authorization server's configuration, in place of
#                             examples/mcp/authserver.yaml (to try its other settings)
#   MCP_DEMO_STATE_DIR        where the authorization server keeps its database and keys
#   MCP_DEMO_GATEWAY_PORT 8090   MCP_DEMO_ADMIN_PORT 9911   MCP_DEMO_SERVER_PORT 8091
#   MCP_DEMO_AUTH_PORT    9010   MCP_DEMO_AUTH_ADMIN_PORT 9912
#   MCP_DEMO_START_TIMEOUT    seconds each process gets to become ready (20)
set -euo pipefail
case ${MCP_DEMO_STATE_DIR:-} in
    /*) STATE=$MCP_DEMO_STATE_DIR ;;
    ?*) STATE=$PWD/$MCP_DEMO_STATE_DIR ;;
esac
AUTH_CONFIG=
case ${MCP_DEMO_AUTH_CONFIG:-} in
    /*) AUTH_CONFIG=$MCP_DEMO_AUTH_CONFIG ;;
    ?*) AUTH_CONFIG=$PWD/$MCP_DEMO_AUTH_CONFIG ;;
esac
case ${MCP_DEMO_PYTHON:-} in
    /*) PYTHON=$MCP_DEMO_PYTHON ;;
    */*) PYTHON=$PWD/$MCP_DEMO_PYTHON ;;
    ?*) PYTHON=$MCP_DEMO_PYTHON ;; # a command found on PATH
esac
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
START_TIMEOUT=${MCP_DEMO_START_TIMEOUT:-20}
CONFIG=examples/mcp/gateway.yaml
AUTH_CONFIG=${AUTH_CONFIG:-examples/mcp/authserver.yaml}
# The configs read these through ${MCP_DEMO_...:-default}, with the same defaults.
export MCP_DEMO_GATEWAY_PORT=${MCP_DEMO_GATEWAY_PORT:-8090}
export MCP_DEMO_ADMIN_PORT=${MCP_DEMO_ADMIN_PORT:-9911}
export MCP_DEMO_SERVER_PORT=${MCP_DEMO_SERVER_PORT:-8091}
export MCP_DEMO_AUTH_PORT=${MCP_DEMO_AUTH_PORT:-9010}
export MCP_DEMO_AUTH_ADMIN_PORT=${MCP_DEMO_AUTH_ADMIN_PORT:-9912}

GW="http://127.0.0.1:$MCP_DEMO_GATEWAY_PORT"
AUTH="http://127.0.0.1:$MCP_DEMO_AUTH_PORT"
SERVER="http://127.0.0.1:$MCP_DEMO_SERVER_PORT"

die() {
    echo "mcp-demo: $*" >&2
    exit 1
}

command -v curl >/dev/null || die "curl is needed to wait for the processes"
"$PYTHON" -c 'import authserver, gateway, mcp' 2>/dev/null \
    || die "$PYTHON cannot run the example (the mcp package is missing?); 'make mcp-demo' sets up .venv first"

for var in MCP_DEMO_GATEWAY_PORT MCP_DEMO_ADMIN_PORT MCP_DEMO_SERVER_PORT MCP_DEMO_AUTH_PORT \
    MCP_DEMO_AUTH_ADMIN_PORT; do
    # As the servers do: connections of a previous run in TIME_WAIT do not hold the port.
    "$PYTHON" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "${!var}" 2>/dev/null \
        || die "port ${!var} is in use; choose another with $var=..."
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/portcullis-mcp-demo.XXXXXX")
export MCP_DEMO_STATE_DIR=${STATE:-$WORK/state}
mkdir -p "$MCP_DEMO_STATE_DIR"
"$PYTHON" -m authserver check --config "$AUTH_CONFIG" >/dev/null \
    || die "$AUTH_CONFIG has problems (listed above)"
"$PYTHON" -m gateway check --config "$CONFIG" >/dev/null || die "$CONFIG has problems (listed above)"

PIDS=()
NAMES=()
stop_all() {
    local status=$?
    trap - EXIT INT TERM
    local pid deadline=$((SECONDS + 15))
    [ -z "${NAP:-}" ] || kill "$NAP" 2>/dev/null || true
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    echo "mcp-demo: stopped; logs kept in $WORK" >&2
    exit "$status"
}
trap stop_all EXIT
trap 'echo; exit 0' INT TERM

DEMO_NAME=mcp-demo
# shellcheck source=examples/processes.sh
. "$ROOT/examples/processes.sh"

start authserver "$PYTHON" -m authserver run --config "$AUTH_CONFIG"
start mcp-server "$PYTHON" -m examples.mcp --port "$MCP_DEMO_SERVER_PORT"
wait_ready authserver "$AUTH/.well-known/oauth-authorization-server"
# Any answer will do: the server is up once it answers at all (a GET without a session is
# refused).
wait_ready mcp-server "$SERVER/mcp" any
# The gateway is ready once it holds the authorization server's keys.
start gateway "$PYTHON" -m gateway run --config "$CONFIG"
wait_ready gateway "http://127.0.0.1:$MCP_DEMO_ADMIN_PORT/readyz"

cat <<EOF
Running, logs in $WORK:
  authorization server   $AUTH   (state in $MCP_DEMO_STATE_DIR)
  MCP server             $SERVER/mcp   (no OAuth inside; reach it through the gateway)
  gateway                $GW

Give your MCP client this URL (Streamable HTTP) and nothing else:

  $GW/mcp

It registers itself and sends you to sign in: alice, password wonderland. Ask it to call
whoami or list_orders; delete_order makes it ask you again, for mcp:admin.

What the client finds on its way (examples/mcp/README.md says more):
  curl -si -X POST $GW/mcp                                       # 401, resource_metadata=...
  curl -s $GW/.well-known/oauth-protected-resource/mcp          # resource, authorization_servers
  curl -s $AUTH/.well-known/oauth-authorization-server          # endpoints, registration_endpoint

Press Ctrl-C to stop everything.
EOF
while :; do
    for i in "${!PIDS[@]}"; do
        if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
            echo "mcp-demo: the ${NAMES[$i]} stopped unexpectedly; the end of its log:" >&2
            tail -n 30 "$WORK/${NAMES[$i]}.log" >&2
            exit 1
        fi
    done
    sleep 1 &
    NAP=$!
    wait "$NAP" || true
done
