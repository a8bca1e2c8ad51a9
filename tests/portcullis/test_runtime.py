"""portcullis.runtime: JSON-lines logging and serving until a signal."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web

from portcullis import runtime
from tests.support import reserve_port


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """configure_logging changes the root logger: put it back for the tests after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    access_level = logging.getLogger("aiohttp.access").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(access_level)


def logged_lines(stream: io.StringIO) -> list[dict[str, object]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


class Opaque:
    def __str__(self) -> str:
        return "opaque-thing"


def test_each_record_is_one_json_object_on_one_line_with_extra_fields(restore_logging):
    stream = io.StringIO()
    runtime.configure_logging("debug", stream)
    log = logging.getLogger("portcullis.test")
    log.info("first %s", "message", extra={"request_id": "r-1", "status": 200})
    log.warning("two\nlines", extra={"details": {"a": [1, 2]}, "thing": Opaque()})

    first, second = logged_lines(stream)
    assert len(stream.getvalue().splitlines()) == 2
    assert first == {
        "time": first["time"],
        "level": "info",
        "logger": "portcullis.test",
        "message": "first message",
        "request_id": "r-1",
        "status": 200,
    }
    assert second["level"] == "warning"
    assert second["message"] == "two\nlines"  # escaped inside the line, not a second line
    assert second["details"] == {"a": [1, 2]}
    assert second["thing"] == "opaque-thing"  # what JSON cannot hold is written as text


def test_the_time_field_is_utc_with_milliseconds(restore_logging):
    stream = io.StringIO()
    runtime.configure_logging("info", stream)
    before = datetime.now(UTC)
    logging.getLogger("portcullis.test").info("tick")
    after = datetime.now(UTC)
    [entry] = logged_lines(stream)
    assert isinstance(entry["time"], str)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
    logged = datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert before - timedelta(milliseconds=1) <= logged <= after


def test_an_exception_is_logged_with_its_traceback_in_the_same_line(restore_logging):
    stream = io.StringIO()
    runtime.configure_logging("info", stream)
    try:
        raise ValueError("broken thing")
    except ValueError:
        logging.getLogger("portcullis.test").exception("failed", extra={"step": 3})
    [entry] = logged_lines(stream)
    assert entry["level"] == "error"
    assert entry["step"] == 3
    assert isinstance(entry["exception"], str)
    assert entry["exception"].startswith("Traceback (most recent call last):")
    assert entry["exception"].rstrip().endswith("ValueError: broken thing")


def test_records_below_the_configured_level_are_dropped(restore_logging):
    stream = io.StringIO()
    runtime.configure_logging("warning", stream)
    log = logging.getLogger("portcullis.test")
    log.info("quiet")
    log.error("loud")
    assert [entry["message"] for entry in logged_lines(stream)] == ["loud"]


def test_configure_logging_replaces_earlier_handlers(restore_logging):
    first, second = io.StringIO(), io.StringIO()
    runtime.configure_logging("info", first)
    runtime.configure_logging("info", second)
    logging.getLogger("portcullis.test").info("once")
    assert first.getvalue() == ""
    assert [entry["message"] for entry in logged_lines(second)] == ["once"]
    assert logging.getLogger("aiohttp.access").level == logging.WARNING


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_serve_answers_until_sigterm_then_drains_and_returns():
    port = reserve_port()
    events: list[str] = []
    release = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        events.append("slow started")
        await release.wait()
        return web.Response(text="done")

    app = web.Application()
    app.router.add_get("/slow", slow)
    served: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def started() -> None:
        async def client() -> None:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/slow") as resp,
            ):
                served.set_result(await resp.text())

        asyncio.get_running_loop().create_task(client())
        while "slow started" not in events:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by serve, not the default action

    def on_draining() -> None:
        events.append("draining")
        release.set()  # the in-flight request may now finish, within the grace

    await runtime.serve(
        [runtime.Listener(app, "127.0.0.1", port, "test")],
        grace=timedelta(seconds=5),
        on_draining=on_draining,
        started=started,
    )
    assert events == ["slow started", "draining"]
    assert await asyncio.wait_for(served, 1) == "done"
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session:
            await session.get(f"http://127.0.0.1:{port}/slow")
    # The signal handlers are gone again: SIGTERM has its default meaning after serve.
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
