"""portcullis.runtime: JSON-lines logging and serving until a signal."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web

from portcullis import runtime
from portcullis.runtime import Outage
from portcullis.tls import RotatingCertificate, ServerTls
from tests.certificates import CertificateAuthority, client_context
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


# ---------------------------------------------------------------------------- start-up errors


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("which", [0, 1])
async def test_serve_on_a_port_in_use_raises_a_startup_error_naming_the_address(which):
    ports = [reserve_port(), reserve_port()]
    cleaned: list[str] = []

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        yield
        cleaned.append("cleaned up")

    apps = [web.Application(), web.Application()]
    apps[0].cleanup_ctx.append(lifetime)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[which]))
        taken.listen()
        with pytest.raises(runtime.StartupError) as raised:
            await runtime.serve(
                [
                    runtime.Listener(apps[0], "127.0.0.1", ports[0], "public"),
                    runtime.Listener(apps[1], "127.0.0.1", ports[1], "admin"),
                ],
                grace=timedelta(seconds=1),
            )
    assert str(raised.value) == f"cannot listen on 127.0.0.1:{ports[which]}: address already in use"
    assert isinstance(raised.value.__cause__, OSError)
    assert cleaned == ["cleaned up"]  # what had started is closed again
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)


def test_run_service_reports_one_line_for_a_startup_error_and_returns_1(capsys):
    async def failing() -> None:
        raise runtime.StartupError("cannot open the store sqlite:///x.db: disk I/O error")

    lines: list[str] = []
    assert runtime.run_service(failing(), report=lines.append) == 1
    assert lines == ["cannot open the store sqlite:///x.db: disk I/O error"]
    assert capsys.readouterr().err == ""


def test_run_service_names_a_file_it_could_not_use(capsys):
    async def failing() -> None:
        open("/nonexistent-dir/access.log", "ab")  # noqa: SIM115

    lines: list[str] = []
    assert runtime.run_service(failing(), report=lines.append) == 1
    assert lines == ["cannot use /nonexistent-dir/access.log: no such file or directory"]
    assert capsys.readouterr().err == ""


def test_run_service_logs_the_traceback_of_an_unexpected_error(restore_logging, capsys):
    stream = io.StringIO()
    runtime.configure_logging("info", stream)

    async def failing() -> None:
        raise ValueError("boom")

    lines: list[str] = []
    assert runtime.run_service(failing(), report=lines.append) == 1
    assert lines == ["stopped by an unexpected error: ValueError: boom"]
    [entry] = logged_lines(stream)  # one JSON line, the traceback inside it
    assert entry["level"] == "critical"
    assert "ValueError: boom" in str(entry["exception"])
    assert capsys.readouterr().err == ""


def test_run_service_with_debug_prints_the_traceback_before_the_line(capsys):
    async def failing() -> None:
        raise runtime.StartupError("cannot use the key directory /keys: not a directory")

    lines: list[str] = []
    assert runtime.run_service(failing(), debug=True, report=lines.append) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "StartupError: cannot use the key directory /keys: not a directory" in err
    assert lines == ["cannot use the key directory /keys: not a directory"]


def test_run_service_returns_0_when_the_service_stops():
    async def stops() -> None:
        return None

    assert runtime.run_service(stops()) == 0


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_sighup_reloads_the_certificate_of_a_tls_listener_and_calls_on_reload(tmp_path):
    ca = CertificateAuthority()
    cert_file, key_file = ca.server("first").write(tmp_path, "server")
    # Watching is pushed out of the way: only the signal can make the change seen here.
    certificate = RotatingCertificate(
        ServerTls(str(cert_file), str(key_file)), interval=timedelta(hours=1)
    )
    port = reserve_port()
    app = web.Application()
    reloads: list[str] = []
    names: list[str] = []
    context = client_context(ca)

    async def common_name() -> str:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        subject = writer.get_extra_info("peercert")["subject"]
        writer.transport.abort()
        return str(dict(rdn[0] for rdn in subject)["commonName"])

    async def started() -> None:
        async def exercise() -> None:
            names.append(await common_name())
            ca.server("second").write(tmp_path, "server")
            names.append(await common_name())  # files changed, nothing reloaded yet
            os.kill(os.getpid(), signal.SIGHUP)
            while not reloads:
                await asyncio.sleep(0.01)
            names.append(await common_name())
            os.kill(os.getpid(), signal.SIGTERM)

        asyncio.get_running_loop().create_task(exercise())

    await runtime.serve(
        [runtime.Listener(app, "127.0.0.1", port, "test", certificate)],
        grace=timedelta(seconds=1),
        on_reload=lambda: reloads.append("config"),
        started=started,
    )
    assert names == ["first", "first", "second"]
    assert certificate.reloads == 1


def test_an_outage_is_logged_when_it_starts_once_a_minute_while_it_lasts_and_when_it_ends():
    now = [1000.0]
    outage = Outage(timedelta(minutes=1), lambda: now[0])
    assert outage.succeeded() is None  # nothing to end
    logged = []
    for _ in range(18):  # a retry every 5 s for 90 s
        logged.append(outage.failed())
        now[0] += 5
    assert logged[0] is True
    assert logged.count(True) == 2  # the start, and once after a minute
    assert logged.index(True, 1) == 12  # 60 s on
    assert outage.succeeded() == 18
    assert outage.succeeded() is None
    assert outage.failed() is True  # a new outage is told again
