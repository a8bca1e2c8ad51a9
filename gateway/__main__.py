"""portcullis-gateway: run · check · explain."""

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

from portcullis import runtime
from portcullis.yamlconf import ConfigError

from . import settings as settings_module

log = logging.getLogger("portcullis.gateway")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portcullis-gateway", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve requests")
    run.add_argument("--config", required=True)
    check = commands.add_parser("check", help="validate a config file, print every problem")
    check.add_argument("--config", required=True)
    explain = commands.add_parser("explain", help="show which rule a request meets and why")
    explain.add_argument("--config", required=True)
    explain.add_argument("method")
    explain.add_argument("path")
    explain.add_argument("--token", help="an access token to verify against the live key sets")
    explain.add_argument("--origin", help="a browser Origin: would it get CORS headers?")
    args = parser.parse_args(argv)

    try:
        settings = settings_module.load(args.config)
    except ConfigError as exc:
        for found in exc.problems:
            print(found, file=sys.stderr)
        return 1

    if args.command == "check":
        # Warnings do not fail the check: the file is valid, and may be meant as written.
        for warning in settings_module.warnings(settings):
            print(warning, file=sys.stderr)
        print(f"{args.config}: OK")
        return 0

    if args.command == "explain":
        from .explain import explain as run_explain

        return run_explain(settings, args.method, args.path, args.token, args.origin)

    runtime.configure_logging(settings.log_level)
    for warning in settings_module.warnings(settings):
        log.warning(warning, extra={"event": "config_warning"})
    if settings.workers == 1:
        from .app import serve

        runtime.run(serve(settings))
        return 0
    return supervise(args.config, settings.workers, settings.shutdown_grace)


def _worker(config: str) -> None:
    from .app import serve

    settings = settings_module.load(config)
    runtime.configure_logging(settings.log_level)
    runtime.run(serve(settings, reuse_port=True))


def supervise(config: str, workers: int, grace: timedelta) -> int:
    """N worker processes sharing the listening port (SO_REUSEPORT); each has its own caches.

    A worker that dies is replaced (at most once a second); SIGTERM/SIGINT are passed on
    and the workers drain before the supervisor exits; SIGHUP is passed on as a reload.
    """
    context = multiprocessing.get_context("spawn")
    stopping = False
    # Under `python -m gateway` this file runs as `__main__`, which a spawned child does not
    # re-run, so `__main__._worker` cannot be found there: name it by its package path.
    worker = importlib.import_module("gateway.__main__")._worker

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=worker, args=(config,), daemon=False)
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
    log.info("workers started", extra={"workers": workers})
    last_restart = 0.0
    while not stopping:
        time.sleep(0.2)
        for i, process in enumerate(processes):
            if not process.is_alive() and not stopping:
                if time.monotonic() - last_restart < 1:
                    continue
                log.error("worker exited; starting another", extra={"exitcode": process.exitcode})
                last_restart = time.monotonic()
                processes[i] = start()
    deadline = time.monotonic() + grace.total_seconds() + 5
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
