"""Process runtime shared by both services: event loop, JSON-lines logging, serving, shutdown.

`serve()` runs aiohttp applications until SIGTERM or SIGINT, then stops accepting, lets
in-flight requests finish within a grace period, and closes. What keeps a service from
starting (a port in use, a file it cannot read, a store it cannot reach) becomes a
`StartupError`: `run_service` prints its one line and the command exits 1, without a
traceback unless asked for one. A listener with TLS follows its
certificate files as they change, and reloads them on SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

import orjson
from aiohttp import web

from .aiohttp_private import RefusingAppRunner
from .http import field_limit, unparsable, unparsable_status
from .tls import RotatingCertificate

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


class Outage:
    """When a background task's failing dependency is worth a log line: the first failure,
    then at most one line every `every` while it lasts (with how many failures it counted),
    and one when it is over; never a line per retry (a database down for a minute would
    otherwise fill the log)."""

    def __init__(
        self, every: timedelta = timedelta(minutes=1), now: Callable[[], float] = time.monotonic
    ) -> None:
        self._every = every.total_seconds()
        self._now = now
        self._since: float | None = None
        self._logged_at = 0.0
        self.failures = 0

    def failed(self) -> bool:
        """Count a failure; whether to log it."""
        now = self._now()
        self.failures += 1
        if self._since is None:
            self._since = self._logged_at = now
            return True
        if now - self._logged_at >= self._every:
            self._logged_at = now
            return True
        return False

    def succeeded(self) -> int | None:
        """The failures the outage counted, when one just ended (to log); else None."""
        if self._since is None:
            return None
        failures, self._since, self.failures = self.failures, None, 0
        return failures


class StartupError(Exception):
    """What kept the service from starting, in one line for the operator: what and why."""


def describe(error: BaseException) -> str:
    """A one-line account of an error that stopped the service."""
    if isinstance(error, StartupError):
        return str(error)
    if isinstance(error, OSError) and error.filename is not None:
        return f"cannot use {error.filename}: {reason(error)}"
    return f"stopped by an unexpected error: {type(error).__name__}: {error}"


def _expected(error: BaseException) -> bool:
    """Errors the operator can act on from their one line: no traceback needed."""
    return isinstance(error, StartupError) or (
        isinstance(error, OSError) and error.filename is not None
    )


def reason(error: OSError) -> str:
    """The system's words for an OSError, without the details asyncio wraps around them."""
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno).lower()
    return str(error.strerror or error).lower()


def _listen_error(error: OSError, listener: Listener | None) -> StartupError | None:
    """The bind failing, when `error` is that: an errno without a file name while a
    listener starts."""
    if listener is None or error.errno is None or error.filename is not None:
        return None
    return StartupError(f"cannot listen on {listener.host}:{listener.port}: {reason(error)}")


def print_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_service(
    main: Coroutine[Any, Any, None],
    *,
    debug: bool = False,
    report: Callable[[str], None] = print_line,
) -> int:
    """Run a service until it stops: 0, or 1 once `report` was given the one line saying
    what kept it from starting (with `debug`, the traceback is printed before it)."""
    try:
        run(main)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were in place
        return 130
    except Exception as error:
        if debug:
            traceback.print_exception(error, file=sys.stderr)
        elif not _expected(error):
            # A fault of ours, not of the setup: its traceback goes to the log (one line).
            log.critical("unexpected error", exc_info=error)
        report(describe(error))
        return 1
    return 0


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
    """What to serve where: an Application, or a low-level Server built with its options.

    An Application is served by `app_runner`: `refused`, when given, is told the status of
    each request its parser refuses (to count it); `server_header` gives the Server field of
    those answers ("": none), as the application's own answers have it."""

    app: web.Application | web.Server
    host: str
    port: int
    name: str
    tls: RotatingCertificate | None = None
    refused: Callable[[int], None] | None = None
    server_header: Callable[[], str] | None = None


# The limits of an Application's listener, as aiohttp's parser applies them: a request line
# of 8 KiB, each header field as long (one byte more as given, so the two can be told apart).
REQUEST_LINE_LIMIT = 8 * 1024
FIELD_LIMIT = 8 * 1024


def app_runner(
    app: web.Application,
    *,
    shutdown_timeout: float,
    refused: Callable[[int], None] | None = None,
    server_header: Callable[[], str] | None = None,
) -> web.AppRunner:
    """The runner of an Application's listener: within the limits above, its requests the
    parser refuses answered 414, 431 or 400 with the resource error body, never quoting the
    request (see aiohttp_private), their status told to `refused`."""

    def refuse(exc: BaseException | None) -> web.StreamResponse:
        response = unparsable(unparsable_status(exc, REQUEST_LINE_LIMIT))
        if refused is not None:
            refused(response.status)
        return response

    return RefusingAppRunner(
        app,
        refuse=refuse,
        server_header=server_header or (lambda: ""),
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        max_line_size=REQUEST_LINE_LIMIT,
        max_field_size=field_limit(FIELD_LIMIT, REQUEST_LINE_LIMIT),
    )


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

    With `on_reload`, SIGHUP calls it (the conventional signal to re-read configuration);
    SIGHUP also reloads the certificates of TLS listeners, which are besides watched.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    certificates = [listener.tls for listener in listeners if listener.tls is not None]

    def hangup() -> None:
        for certificate in certificates:
            certificate.reload()
        if on_reload is not None:
            on_reload()

    if on_reload is not None or certificates:
        loop.add_signal_handler(signal.SIGHUP, hangup)
    watchers = [
        asyncio.create_task(certificate.watch(), name="certificate watcher")
        for certificate in certificates
    ]
    runners: list[web.BaseRunner] = []
    starting: Listener | None = None  # the listener being set up, for start-up errors
    serving = False
    try:
        for listener in listeners:
            starting = listener
            runner: web.BaseRunner
            if isinstance(listener.app, web.Server):
                runner = web.ServerRunner(listener.app, shutdown_timeout=grace.total_seconds())
            else:
                runner = app_runner(
                    listener.app,
                    shutdown_timeout=grace.total_seconds(),
                    refused=listener.refused,
                    server_header=listener.server_header,
                )
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(
                runner,
                listener.host,
                listener.port,
                reuse_port=reuse_port,
                ssl_context=listener.tls.context if listener.tls is not None else None,
            )
            await site.start()
            log.info("listening", extra={"listener": listener.name, "address": site.name})
        if started is not None:
            await started()
        serving = True
        await stop.wait()
        log.info("draining", extra={"grace_seconds": grace.total_seconds()})
        if on_draining is not None:
            on_draining()
    except OSError as error:
        failed = None if serving else _listen_error(error, starting)
        if failed is None:
            raise
        raise failed from error
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        # The first runner is the public one: it stops accepting and drains in-flight
        # requests; admin listeners close after it so /readyz reports the drain.
        for runner in runners:
            await runner.cleanup()
        log.info("stopped")
