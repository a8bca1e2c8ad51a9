"""WebSockets through the gateway: the upgrade passes the route, token and scope checks, then
messages flow both ways, closes carry their code across, and with close_on_token_expiry the
session ends (1008) when the token that opened it expires.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import (
    gateway_yaml,
    raw_exchange,
    raw_request,
    running_gateway,
    start_site,
    wait_for,
)

ROUTES = """
  - name: chat
    path: "/ws/**"
    scopes: {any: ["chat"]}
    websocket: true
  - name: expiring
    path: "/expiring/**"
    websocket: {close_on_token_expiry: true}
"""


@dataclass
class WebSocketUpstream:
    """Echoes every message; `whoami` answers with the headers of the upgrade request;
    `close:<code>` closes with that code. Offers the subprotocol `chat.v1`. Refuses every
    upgrade to `/ws/refuse/<status>` with that status, fields and a body of its own."""

    url: str = ""
    runner: Any = None
    upgrades: list[dict[str, str]] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    closed: list[int | None] = field(default_factory=list)

    async def start(self) -> WebSocketUpstream:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self.runner, self.url = await start_site(app)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/ws/refuse/"):
            # An API that will not upgrade this request, and says why in its own words.
            self.refused.append(request.path)
            return web.Response(
                status=int(request.path.rsplit("/", 1)[1]),
                headers={
                    "WWW-Authenticate": 'Bearer error="upstream_says_no"',
                    "X-Refused-By": "upstream",
                    "Location": "http://elsewhere.invalid/ws",
                },
                text='{"reason": "not for you"}',
                content_type="application/problem+json",
            )
        ws = web.WebSocketResponse(protocols=("chat.v1",))
        if not ws.can_prepare(request).ok:
            self.plain.append(request.path)
            return web.json_response({"upgraded": False})
        await ws.prepare(request)
        headers = dict(request.headers)
        self.upgrades.append(headers)
        async for message in ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                if message.data == "whoami":
                    await ws.send_str(json.dumps(headers))
                elif message.data.startswith("close:"):
                    await ws.close(code=int(message.data[6:]), message=b"bye")
                else:
                    await ws.send_str(message.data)
            elif message.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(message.data)
        self.closed.append(ws.close_code)
        return ws


@pytest.fixture
async def ws_upstream() -> AsyncIterator[WebSocketUpstream]:
    server = await WebSocketUpstream().start()
    yield server
    await server.stop()


def ws_url(http_url: str, path: str) -> str:
    return "ws://" + http_url.split("://", 1)[1] + path


async def test_messages_flow_both_ways_with_the_identity_of_the_token(issuer, ws_upstream, client):
    token = issuer.token("ES256", sub="alice", scope="chat")
    async with (
        running_gateway(gateway_yaml(issuer.url, ws_upstream.url, extra_routes=ROUTES)) as gateway,
        client.ws_connect(
            ws_url(gateway.url, "/ws/room/1"),
            headers={"Authorization": f"Bearer {token}", "X-Auth-Subject": "mallory"},
            protocols=("chat.v1",),
        ) as ws,
    ):
        assert ws.protocol == "chat.v1"  # the upstream's choice, passed on
        await ws.send_str("hello")
        assert await ws.receive_str(timeout=5) == "hello"
        await ws.send_bytes(b"\x00\x01binary")
        assert await ws.receive_bytes(timeout=5) == b"\x00\x01binary"
        await ws.send_str("whoami")
        seen = json.loads(await ws.receive_str(timeout=5))
    assert seen["X-Auth-Subject"] == "alice"  # the client's copy was dropped
    assert seen["X-Auth-Scopes"] == "chat"
    assert seen["X-Auth-Issuer"] == issuer.url
    assert "Sec-WebSocket-Key" in seen  # the gateway's own handshake, not the client's
    await wait_for(lambda: ws_upstream.closed, what="the upstream's close")
    assert ws_upstream.closed == [1000]  # the client's close reached the upstream


@pytest.mark.parametrize(
    ("scope", "status"), [(None, 401), ("orders:read", 403)], ids=["no-token", "no-scope"]
)
async def test_an_upgrade_that_fails_the_checks_is_refused_before_the_upstream(
    issuer, ws_upstream, client, scope, status
):
    headers = {} if scope is None else {"Authorization": f"Bearer {issuer.token(scope=scope)}"}
    async with running_gateway(
        gateway_yaml(issuer.url, ws_upstream.url, extra_routes=ROUTES)
    ) as gateway:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(ws_url(gateway.url, "/ws/room/1"), headers=headers)
    assert refused.value.status == status
    assert ws_upstream.upgrades == [] and ws_upstream.plain == []


@pytest.mark.parametrize("status", [302, 400, 401, 403, 404])
async def test_an_upstream_that_refuses_the_upgrade_is_answered_as_it_answered(
    issuer, ws_upstream, status
):
    """RFC 6455 §4.1: an answer other than 101 is an ordinary HTTP answer, the upstream's to
    give; a 502 "could not be reached" would be false (RFC 9110 §15.6.3). A redirect is
    passed on too, never followed by the gateway."""
    token = issuer.token("ES256", scope="chat")
    handshake = [
        ("Authorization", f"Bearer {token}"),
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("Sec-WebSocket-Version", "13"),
    ]
    async with running_gateway(
        gateway_yaml(issuer.url, ws_upstream.url, extra_routes=ROUTES)
    ) as gateway:
        upgrade = raw_request("GET", f"/ws/refuse/{status}", handshake)
        answer = await raw_exchange(gateway.url, upgrade)
    assert ws_upstream.refused == [f"/ws/refuse/{status}"]
    assert answer.status == status
    assert answer.headers["WWW-Authenticate"] == 'Bearer error="upstream_says_no"'
    assert answer.headers["X-Refused-By"] == "upstream"
    assert answer.headers["Location"] == "http://elsewhere.invalid/ws"
    assert answer.headers["Content-Type"] == "application/problem+json; charset=utf-8"
    assert answer.body == b'{"reason": "not for you"}'
    assert "Upgrade" not in answer.headers and "Sec-WebSocket-Accept" not in answer.headers


async def test_a_close_from_the_upstream_reaches_the_client_with_its_code(
    issuer, ws_upstream, client
):
    token = issuer.token("ES256", scope="chat")
    async with (
        running_gateway(gateway_yaml(issuer.url, ws_upstream.url, extra_routes=ROUTES)) as gateway,
        client.ws_connect(
            ws_url(gateway.url, "/ws/room/1"), headers={"Authorization": f"Bearer {token}"}
        ) as ws,
    ):
        await ws.send_str("close:4001")
        message = await ws.receive(timeout=5)
    assert message.type == aiohttp.WSMsgType.CLOSE
    assert (message.data, message.extra) == (4001, "bye")


async def test_close_on_token_expiry_ends_the_session_with_1008(issuer, ws_upstream, client):
    token = issuer.token("ES256", lifetime=2)  # expires within two seconds
    async with (
        running_gateway(gateway_yaml(issuer.url, ws_upstream.url, extra_routes=ROUTES)) as gateway,
        client.ws_connect(
            ws_url(gateway.url, "/expiring/1"), headers={"Authorization": f"Bearer {token}"}
        ) as ws,
    ):
        await ws.send_str("still here")
        assert await ws.receive_str(timeout=5) == "still here"
        message = await ws.receive(timeout=5)
    assert message.type == aiohttp.WSMsgType.CLOSE
    assert (message.data, message.extra) == (1008, "token expired")
    await wait_for(lambda: ws_upstream.closed, what="the upstream's close")
    assert ws_upstream.closed == [1008]


async def test_a_route_without_websocket_does_not_pass_the_upgrade_on(issuer, ws_upstream, client):
    token = issuer.token("ES256")
    async with running_gateway(gateway_yaml(issuer.url, ws_upstream.url)) as gateway:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(
                ws_url(gateway.url, "/orders/1"), headers={"Authorization": f"Bearer {token}"}
            )
    # Upgrade is hop-by-hop: the upstream saw a plain GET and answered it as one.
    assert refused.value.status == 200
    assert ws_upstream.upgrades == []
    assert ws_upstream.plain == ["/orders/1"]


async def test_an_open_session_holds_an_upstream_connection_and_others_get_503_not_a_hang(
    issuer, ws_upstream, client
):
    token = issuer.token("ES256", scope="chat")
    config = gateway_yaml(issuer.url, ws_upstream.url, extra_routes=ROUTES).replace(
        "read_timeout: 2s", "read_timeout: 2s, max_connections: 1, pool_timeout: 500ms"
    )
    async with running_gateway(config) as gateway:
        async with client.ws_connect(
            ws_url(gateway.url, "/ws/room/1"), headers={"Authorization": f"Bearer {token}"}
        ) as ws:
            await ws.send_str("hello")
            assert await ws.receive_str(timeout=5) == "hello"
            async with client.get(gateway.url + "/public/x") as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"
        # Once the session is over (the wait covers its closing upstream), others are served.
        async with client.get(gateway.url + "/public/x") as resp:
            assert resp.status == 200
