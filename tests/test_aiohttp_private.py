"""portcullis.aiohttp_private: the parts of aiohttp the listeners rely on that
aiohttp does not promise. Each test names what changed when it fails, on a real server and
socket, apart from the gateway and the authorization server."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage

from portcullis.aiohttp_private import HeadSettlingRequest, RefusingAppRunner, http11_if_unparsable
from tests.support import raw_exchange, raw_request, refused_exchange, start_site


class _Recording(HeadSettlingRequest):
    seen: list[dict[str, str]]

    def settle(self, response: web.StreamResponse) -> None:
        self.seen.append(dict(response.headers))
        response.headers.popall("Server", None)
        response.headers["X-Settled"] = "yes"


async def _serve(messages: list[RawRequestMessage], seen: list[dict[str, str]]) -> Any:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(text="hello")

    def factory(message: RawRequestMessage, payload: Any, protocol: Any, writer: Any, task: Any):
        messages.append(message)
        request = _Recording(
            http11_if_unparsable(message),
            payload,
            protocol,
            writer,
            task,
            asyncio.get_running_loop(),
        )
        request.seen = seen
        return request

    server = web.Server(handle, request_factory=factory, max_line_size=100)
    return await start_site(server)


async def test_the_head_hook_runs_after_the_default_fields_and_before_the_head_is_written():
    messages: list[RawRequestMessage] = []
    seen: list[dict[str, str]] = []
    runner, url = await _serve(messages, seen)
    try:
        answer = await raw_exchange(url, raw_request("GET", "/"))
    finally:
        await runner.cleanup()
    assert len(seen) == 1, "aiohttp no longer calls BaseRequest._prepare_hook on prepare"
    assert {"Date", "Server", "Content-Type"} <= set(seen[0]), (
        "aiohttp adds its default fields after BaseRequest._prepare_hook now"
    )
    assert answer.status == 200
    assert answer.headers.get("X-Settled") == "yes"
    assert answer.headers.get("Server") is None, "the head was written before the hook ran"


async def test_a_request_the_parser_refuses_reaches_the_factory_as_aiohttps_error_message():
    messages: list[RawRequestMessage] = []
    seen: list[dict[str, str]] = []
    runner, url = await _serve(messages, seen)
    try:
        answer = await raw_exchange(url, raw_request("GET", "/" + "p" * 200))
    finally:
        await runner.cleanup()
    assert len(messages) == 1
    refused = messages[0]
    assert refused.version == HttpVersion10, "aiohttp's stand-in for a refused request changed"
    assert http11_if_unparsable(refused) is not refused, (
        "aiohttp.web_protocol.ERROR is no longer what a refused request reaches the factory as"
    )
    assert http11_if_unparsable(refused).version == HttpVersion11
    assert answer.version == "HTTP/1.1"
    assert answer.status == 400  # aiohttp's own handle_error (the gateway's says 414)


async def test_a_parsed_request_keeps_its_message():
    messages: list[RawRequestMessage] = []
    runner, url = await _serve(messages, [])
    try:
        answer = await raw_exchange(url, raw_request("GET", "/ok"))
    finally:
        await runner.cleanup()
    assert answer.status == 200
    assert http11_if_unparsable(messages[0]) is messages[0]


# ---------------------------------------------------------------------------- RefusingAppRunner


async def _serve_app(
    app: web.Application, refused: list[BaseException | None]
) -> tuple[RefusingAppRunner, str]:
    def refuse(exc: BaseException | None) -> web.StreamResponse:
        refused.append(exc)
        response = web.json_response({"refused": True}, status=400)
        response.force_close()
        return response

    runner = RefusingAppRunner(app, refuse=refuse, access_log=None, max_line_size=100)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _app(prepared: list[str]) -> web.Application:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def broken(_: web.Request) -> web.Response:
        raise RuntimeError("a fault of the server's own")

    async def on_prepare(_: web.Request, response: web.StreamResponse) -> None:
        prepared.append(response.headers.get("Server", ""))

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_get("/broken", broken)
    app.on_response_prepare.append(on_prepare)
    return app


async def test_an_applications_refused_request_is_answered_by_refuse_and_logged_unquoted(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG)
    refused: list[BaseException | None] = []
    prepared: list[str] = []
    runner, url = await _serve_app(_app(prepared), refused)
    try:
        bad = b"GET /hello HTTP/1.1\r\nHost: a\r\nX-Secret: kept-out-of-logs\x01\r\n\r\n"
        answer = await refused_exchange(url, bad)
    finally:
        await runner.cleanup()
    assert len(refused) == 1, "aiohttp no longer hands a refused request to handle_error"
    assert answer.json() == {"refused": True}
    assert answer.version == "HTTP/1.1", "the request factory no longer sees aiohttp's ERROR"
    assert "Server" not in answer.headers, "BaseRequest._prepare_hook no longer runs"
    assert prepared == []  # no route matched it: the application's hook did not run
    assert "kept-out-of-logs" not in caplog.text
    [line] = [r for r in caplog.records if r.getMessage() == "unparsable request refused"]
    assert (line.levelno, line.__dict__["status"]) == (logging.INFO, 400)
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]


async def test_an_applications_parsed_requests_and_its_own_faults_stay_aiohttps(
    caplog: pytest.LogCaptureFixture,
):
    refused: list[BaseException | None] = []
    prepared: list[str] = []
    runner, url = await _serve_app(_app(prepared), refused)
    try:
        hello = await raw_exchange(url, raw_request("GET", "/hello"))
        broken = await raw_exchange(url, raw_request("GET", "/broken"))
    finally:
        await runner.cleanup()
    assert (hello.status, hello.body) == (200, b"hello")
    assert prepared and prepared[0].startswith("Python/"), "on_response_prepare did not run"
    assert broken.status == 500
    assert refused == []
    # A fault of the server's own is logged by aiohttp with its traceback, as before.
    assert any(
        r.name == "aiohttp.server" and "a fault of the server's own" in r.exc_text
        for r in caplog.records
        if r.exc_text
    )
