"""portcullis-gateway: run · check (and the worst-case memory) · explain."""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from multiprocessing.queues import SimpleQueue

from portcullis import cli, runtime
from portcullis.version import version
from portcullis.yamlconf import ConfigError

from . import settings as settings_module
from .ops import metrics

log = logging.getLogger("portcullis.gateway")

CONFIG_VARIABLE = "PORTCULLIS_GATEWAY_CONFIG"  # the config file when --config is not given
CONFIG_HELP = f"the config file (default: ${CONFIG_VARIABLE})"


def main(argv: list[str] | None = None) -> int:
    return cli.command(_main, argv)


def command_line() -> argparse.ArgumentParser:
    """The command line's parser (the docs' command reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="portcullis-gateway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve requests")
    run.add_argument("--config", help=CONFIG_HELP)
    run.add_argument(
        "--debug", action="store_true", help="print the traceback when the gateway cannot start"
    )
    check = commands.add_parser("check", help="validate a config file, print every problem")
    check.add_argument("--config", help=CONFIG_HELP)
    explain = commands.add_parser("explain", help="show which rule a request meets and why")
    explain.add_argument("--config", help=CONFIG_HELP)
    explain.add_argument("method")
    explain.add_argument("path")
    explain.add_argument("--token", help="an access token to verify against the live key sets")
    explain.add_argument("--origin", help="a browser Origin: would it get CORS headers?")
    explain.add_argument(
        "--call",
        metavar="METHOD[:NAME]",
        help="on an MCP route, a JSON-RPC call (tools/call:delete_order): the scopes it needs",
    )
    explain.add_argument(
        "--ext-authz",
        action="store_true",
        help="also show the decision listener's answer and what each front proxy makes of it",
    )
    return parser


def _main(argv: list[str] | None) -> int:
    parser = command_line()
    args = parser.parse_args(argv)
    args.config = args.config or os.environ.get(CONFIG_VARIABLE)
    if not args.config:
        parser.error(f"--config FILE is required (or set {CONFIG_VARIABLE})")

    try:
        # Explaining a rule without a token reads no secret and no certificate.
        secrets = args.command != "explain" or args.token is not None
        settings = settings_module.load(args.config, secrets=secrets)
    except ConfigError as exc:
        for found in exc.problems:
            print(found, file=sys.stderr)
        return 1

    if args.command == "check":
        # Warnings do not fail the check: the file is valid, and may be meant as written.
        for warning in settings_module.warnings(settings):
            print(warning, file=sys.stderr)
        print(f"{args.config}: OK")
        from .memory import worst_case

        # What to set a container's memory limit from (see bench/memory.py).
        print(f"worst-case memory: {worst_case(settings)}")
        return 0

    if args.command == "explain":
        from .explain import explain as run_explain

        return run_explain(
            settings, args.method, args.path, args.token, args.origin, args.ext_authz, args.call
        )

    runtime.configure_logging(settings.log_level)
    log.info("starting", extra={"version": version(), "config": args.config})
    for warning in settings_module.warnings(settings):
        log.warning(warning, extra={"event": "config_warning"})
    if settings.workers == 1:
        from .app import serve

        return runtime.run_service(serve(settings), debug=args.debug)
    with metrics.shared_directory():
        return supervise(args.config, settings.workers, settings.shutdown_grace, debug=args.debug)


# What a worker tells the supervisor when it cannot start: its pid and the one line why.
Failures = SimpleQueue[tuple[int, str]]


def _worker(config: str, debug: bool, failures: Failures) -> None:
    from .app import serve

    def report(message: str) -> None:
        failures.put((os.getpid(), message))

    try:
        settings = settings_module.load(config)
    except ConfigError as exc:  # the file changed since the supervisor read it
        report("; ".join(str(problem) for problem in exc.problems))
        sys.exit(1)
    runtime.configure_logging(settings.log_level)
    log.info("worker starting", extra={"version": version(), "pid": os.getpid()})
    shared_metrics = os.environ[metrics.SHARED_DIRECTORY]  # set by the supervisor
    sys.exit(
        runtime.run_service(
            serve(settings, reuse_port=True, shared_metrics=shared_metrics),
            debug=debug,
            report=report,
        )
    )


def supervise(config: str, workers: int, grace: timedelta, *, debug: bool = False) -> int:
    """N worker processes sharing the listening port (SO_REUSEPORT); each has its own caches,
    and their metrics are added up in the directory metrics.shared_directory() names.

    A worker that dies is replaced (at most once a second); SIGTERM/SIGINT are passed on
    and the workers drain before the supervisor exits; SIGHUP is passed on as a reload.
    When one of the first workers cannot start (a port in use, a file it cannot read), the
    others are stopped and the supervisor prints why and exits 1; a replacement that cannot
    start is logged and tried again.
    """
    context = multiprocessing.get_context("spawn")
    stopping = False
    # Under `python -m gateway` this file runs as `__main__`, which a spawned child does not
    # re-run, so `__main__._worker` cannot be found there: name it by its package path.
    worker = importlib.import_module("gateway.__main__")._worker
    failures: Failures = context.SimpleQueue()

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=worker, args=(config, debug, failures), daemon=False)
        process.start()
        return process

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            if process.is_alive() and process.pid:
                os.kill(process.pid, signal.SIGTERM)

    # Handlers first: a SIGTERM that came while workers were starting would otherwise kill
    # the supervisor alone and leave its workers running.
    def reload(signum: int, _frame: object) -> None:
        # Each worker reloads its own copy of the configuration.
        for process in processes:
            if process.is_alive() and process.pid:
                os.kill(process.pid, signal.SIGHUP)

    processes: list[multiprocessing.process.BaseProcess] = []
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)
    for _ in range(workers):
        if not stopping:
            processes.append(start())
    first = {process.pid for process in processes}
    log.info("workers started", extra={"workers": workers})
    last_restart = 0.0
    why: str | None = None  # why a first worker could not start: printed once all have stopped
    while not stopping:
        time.sleep(0.2)
        while not failures.empty():
            pid, message = failures.get()
            if pid in first:
                why = message
                stop(signal.SIGTERM, None)
                break
            log.error("a new worker could not start", extra={"reason": message, "pid": pid})
        for i, process in enumerate(processes):
            if not process.is_alive() and not stopping:
                if time.monotonic() - last_restart < 1:
                    continue
                log.error("worker exited; starting another", extra={"exitcode": process.exitcode})
                if process.pid is not None:
                    metrics.worker_exited(process.pid)
                last_restart = time.monotonic()
                processes[i] = start()
    deadline = time.monotonic() + grace.total_seconds() + 5
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
    if why is None:
        return 0
    # Last, after the other workers' own log lines: the one line a person reads.
    runtime.print_line(why)
    return 1


if __name__ == "__main__":
    sys.exit(main())
