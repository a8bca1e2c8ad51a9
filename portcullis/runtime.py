"""Process runtime shared by both services: event loop, JSON-lines logging, serving, shutdown.

`serve()` runs aiohttp applications until SIGTERM or SIGINT, then stops accepting, lets
in-flight requests finish within a grace period, and closes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

import orjson
from aiohttp import web

log = logging.getLogger("portcullis.runtime")

# Fields every LogRecord has; anything else passed with `extra=` is written as a JSON field.
_STANDARD_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonLinesFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_RECORD_FIELDS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLinesFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp logs every bad request line at debug; its access log is replaced by ours.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def settle_memory() -> None:
    """Call once start-up is done: objects alive now (modules, config, compiled rules) live
    for the whole process, so the cyclic garbage collector stops scanning them, and its
    youngest generation is collected less often. Request-path garbage is acyclic in the
    main and freed by reference counting; what cycles remain are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop when it is installed, else on the standard event loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        asyncio.run(main)
    else:
        uvloop.run(main)


@dataclass(frozen=True)
class Listener:
    """What to serve where: an Application, or a low-level Server built with its options."""

    app: web.Application | web.Server
    host: str
    port: int
    name: str


async def serve(
    listeners: Sequence[Listener],
    *,
    grace: timedelta,
    reuse_port: bool = False,
    on_draining: Callable[[], None] | None = None,
    on_reload: Callable[[], None] | None = None,
    started: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: stop accepting, wait up to `grace`, close.

    With `on_reload`, SIGHUP calls it (the conventional signal to re-read configuration).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_reload is not None:
        loop.add_signal_handler(signal.SIGHUP, on_reload)
    runners: list[web.BaseRunner] = []
    try:
        for listener in listeners:
            runner: web.BaseRunner
            if isinstance(listener.app, web.Server):
                runner = web.ServerRunner(listener.app, shutdown_timeout=grace.total_seconds())
            else:
                runner = web.AppRunner(
                    listener.app, access_log=None, shutdown_timeout=grace.total_seconds()
                )
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, listener.host, listener.port, reuse_port=reuse_port)
            await site.start()
            log.info("listening", extra={"listener": listener.name, "address": site.name})
        if started is not None:
            await started()
        await stop.wait()
        log.info("draining", extra={"grace_seconds": grace.total_seconds()})
        if on_draining is not None:
            on_draining()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        # The first runner is the public one: it stops accepting and drains in-flight
        # requests; admin listeners close after it so /readyz reports the drain.
        for runner in runners:
            await runner.cleanup()
        log.info("stopped")
