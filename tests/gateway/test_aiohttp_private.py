"""gateway.transport.aiohttp_private: the two parts of aiohttp the public listener relies on that
aiohttp does not promise. Each test names what changed when it fails, on a real low-level
server and socket, apart from the gateway."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage

from gateway.transport.aiohttp_private import HeadSettlingRequest, http11_if_unparsable
from tests.support import raw_exchange, raw_request, start_site


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
