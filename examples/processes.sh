# The demos' processes (examples/demo.sh, examples/mcp/demo.sh): sourced by them, not run.
# They set WORK (where each process's log goes), START_TIMEOUT (seconds each process gets
# to become ready), DEMO_NAME (what their messages begin with), and the arrays PIDS and
# NAMES, which stop_all reads to stop everything started.

start() { # name command...: run command in the background, its output in WORK/name.log
    local name=$1
    shift
    "$@" >"$WORK/$name.log" 2>&1 &
    PIDS+=("$!")
    NAMES+=("$name")
}

# wait_ready name url [any]: until url answers with a success (with `any`: with any status),
# while the process started as name runs; else the end of its log, and exit 1.
wait_ready() {
    local name=$1 url=$2 pid="" i fail=-f
    [ "${3:-}" = any ] && fail=
    for i in "${!NAMES[@]}"; do [ "${NAMES[$i]}" = "$name" ] && pid=${PIDS[$i]}; done
    local deadline=$((SECONDS + START_TIMEOUT))
    until curl $fail -sS -o /dev/null --max-time 1 "$url" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "$DEMO_NAME: the $name stopped while starting; the end of its log:" >&2
            tail -n 30 "$WORK/$name.log" >&2
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            echo "$DEMO_NAME: the $name was not ready at $url within ${START_TIMEOUT}s; its log:" >&2
            tail -n 30 "$WORK/$name.log" >&2
            exit 1
        fi
        sleep 0.1
    done
}
