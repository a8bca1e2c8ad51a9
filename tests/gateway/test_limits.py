"""Limits on what a client may send: headers, bodies, and how long it may take.

Each refusal is checked for its answer, for what the upstream did NOT receive, and for the
gateway still serving an ordinary request afterwards. Oversized or stalled requests are sent
over raw sockets, since ordinary clients refuse to make them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from multidict import CIMultiDict

from tests.support import (
    EchoUpstream,
    RawConnection,
    RunningGateway,
    TestIssuer,
    challenges_of,
    gateway_yaml,
    raw_exchange,
    raw_request,
    running_gateway,
)

LIMITS = """
limits: {max_field_size: 1KiB, max_headers: 20, idle_timeout: 300ms, body_timeout: 300ms}
"""


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    server = TestIssuer()
    server.add_key("ES256")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def gateway(issuer: TestIssuer, upstream: EchoUpstream) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, extra=LIMITS)) as gw:
        yield gw


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": []}}


async def assert_still_serving(gateway: RunningGateway, upstream: EchoUpstream) -> None:
    before = len(upstream.requests)
    answer = await raw_exchange(gateway.url, raw_request("GET", "/public/after"))
    assert answer.status == 200
    assert answer.json()["raw_path"] == "/public/after"
    assert len(upstream.requests) == before + 1


def auth(issuer: TestIssuer) -> tuple[str, str]:
    return ("Authorization", f"Bearer {issuer.token()}")


# ---------------------------------------------------------------------------- headers


async def test_several_authorization_headers_are_refused_with_invalid_request(
    gateway, issuer, upstream, client
):
    token = issuer.token()
    headers = CIMultiDict([("Authorization", f"Bearer {token}"), ("Authorization", "Bearer x")])
    async with client.get(gateway.url + "/orders/1", headers=headers) as resp:
        assert resp.status == 400
        assert challenges_of(resp.headers)[0] == (
            'Bearer realm="portcullis", error="invalid_request", '
            'error_description="more than one Authorization header"'
        )
        assert await resp.json() == error_body(
            "invalid_request",
            "The request's credentials are malformed: more than one Authorization header.",
        )
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_header_line_over_max_field_size_is_refused_with_431(gateway, upstream):
    long = raw_request("GET", "/public/x", [("X-Big", "a" * 2000)])
    answer = await raw_exchange(gateway.url, long)
    assert (answer.version, answer.status) == ("HTTP/1.1", 431)
    assert answer.json() == error_body(
        "header_fields_too_large",
        "The request's header fields are larger, or more, than this API accepts.",
    )
    assert upstream.requests == []
    # Just under the configured limit passes: the refusal is the limit, not any header.
    fits = await raw_exchange(gateway.url, raw_request("GET", "/public/x", [("X-Big", "a" * 900)]))
    assert fits.status == 200
    assert len(upstream.requests) == 1
    await assert_still_serving(gateway, upstream)


@pytest.mark.parametrize(
    "limits",
    ["", "limits: {max_line_size: 1KiB, max_field_size: 4KiB}"],
    ids=["equal-limits", "line-limit-lower"],
)
async def test_a_request_line_over_max_line_size_gets_414_and_a_header_field_431(
    issuer, upstream, limits
):
    """RFC 9112 §3: 414 for a request line over the limit; RFC 6585 §5: 431 for header
    fields. By default both limits are 8 KiB, and the two are still told apart."""
    config = gateway_yaml(issuer.url, upstream.url, extra=limits)
    line_limit = 1024 if limits else 8192
    async with running_gateway(config) as gateway:
        long_line = raw_request("GET", "/public/" + "p" * line_limit)
        answer = await raw_exchange(gateway.url, long_line)
        assert (answer.version, answer.status) == ("HTTP/1.1", 414)
        assert answer.reason == "Request-URI Too Long"
        assert answer.json() == error_body(
            "uri_too_long", "The request line is longer than this API accepts."
        )
        assert b"ppp" not in answer.body
        long_field = raw_request("GET", "/public/x", [("X-Big", "/" + "f" * 9000)])
        answer = await raw_exchange(gateway.url, long_field)
        assert (answer.version, answer.status) == ("HTTP/1.1", 431)
        # Under the limit, the same request line is served.
        fits = await raw_exchange(gateway.url, raw_request("GET", "/public/" + "p" * 900))
        assert fits.status == 200
    assert [seen["raw_path"] for seen in upstream.requests] == ["/public/" + "p" * 900]


async def test_every_parse_error_is_answered_in_http_1_1_and_closes_the_connection(
    gateway, upstream
):
    for request in (
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /public/x HTTP/1.1\r\nHost: a\r\nBad Header Name: x\r\n\r\n",
        b"GET /public/x HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ):
        connection = await RawConnection.open(gateway.url)
        try:
            await connection.send(request)
            answer = await connection.response()
            assert (answer.version, answer.status) == ("HTTP/1.1", 400), request
            assert answer.headers["Connection"] == "close"
            assert answer.json()["error"]["code"] == "bad_request"
            assert await connection.closed_by_peer()
        finally:
            connection.close()
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_unparsable_requests_get_the_error_body_without_echoing_the_request(
    gateway, upstream
):
    too_long = raw_request("GET", "/public/secret-path", [("X-Big", "c" * 2000)])
    too_many = raw_request("GET", "/public/secret-path", [(f"X-H{i}", "v") for i in range(40)])
    for request in (too_long, too_many):
        answer = await raw_exchange(gateway.url, request)
        assert answer.status == 431
        assert answer.headers["Content-Type"].startswith("application/json")
        assert answer.json()["error"]["code"] == "header_fields_too_large"
        assert b"secret-path" not in answer.body and b"ccc" not in answer.body
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_a_long_header_closes_the_connection(gateway, upstream):
    connection = await RawConnection.open(gateway.url)
    try:
        await connection.send(raw_request("GET", "/public/x", [("X-Big", "b" * 5000)]))
        answer = await connection.response()
        assert answer.status == 431
        assert await connection.closed_by_peer()
    finally:
        connection.close()
    assert upstream.requests == []


async def test_too_many_headers_are_refused_with_431(gateway, upstream):
    many = [(f"X-H{i}", str(i)) for i in range(40)]
    answer = await raw_exchange(gateway.url, raw_request("GET", "/public/x", many))
    assert (answer.version, answer.status) == ("HTTP/1.1", 431)
    assert upstream.requests == []
    few = [(f"X-H{i}", str(i)) for i in range(10)]
    assert (await raw_exchange(gateway.url, raw_request("GET", "/public/x", few))).status == 200
    await assert_still_serving(gateway, upstream)


# ---------------------------------------------------------------------------- body size


async def test_content_length_over_the_route_limit_is_refused_before_forwarding(
    gateway, issuer, upstream
):
    connection = await RawConnection.open(gateway.url)
    try:
        # Only the head is sent: the answer must not wait for a body it is going to refuse.
        head = raw_request("POST", "/small/x", [auth(issuer), ("Content-Length", "2048")])
        await connection.send(head)
        answer = await connection.response()
        assert await connection.closed_by_peer()
    finally:
        connection.close()
    assert answer.status == 413
    assert answer.headers["Connection"] == "close"
    assert answer.json() == error_body(
        "payload_too_large", "The request body is larger than 1024 bytes allowed here."
    )
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_body_at_the_route_limit_is_forwarded(gateway, issuer, upstream, client):
    body = b"k" * 1024
    async with client.post(
        gateway.url + "/small/x", data=body, headers=dict([auth(issuer)])
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["body_size"] == 1024
    assert len(upstream.requests) == 1


async def test_the_global_max_body_size_applies_where_a_route_sets_none(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, extra="limits: {max_body_size: 100}")
    async with running_gateway(config) as gw:
        async with client.post(gw.url + "/public/x", data=b"z" * 101) as resp:
            assert resp.status == 413
            assert await resp.json() == error_body(
                "payload_too_large", "The request body is larger than 100 bytes allowed here."
            )
        async with client.post(gw.url + "/public/x", data=b"z" * 100) as resp:
            assert resp.status == 200
        # A route's own limit wins over the global one, in both directions.
        body = b"u" * 5000
        async with client.post(gw.url + "/upload/x", data=body, headers=dict([auth(issuer)])) as r:
            assert r.status == 200
    assert [seen["body_size"] for seen in upstream.requests] == [100, 5000]


async def chunks(total: int, size: int = 256) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        part = min(size, total - sent)
        yield b"c" * part
        sent += part
        await asyncio.sleep(0)


async def test_chunked_body_over_the_limit_is_refused_with_413(gateway, issuer, upstream, client):
    async with client.post(
        gateway.url + "/small/x", data=chunks(4096), headers=dict([auth(issuer)])
    ) as resp:
        assert resp.status == 413
        assert resp.headers["Connection"] == "close"
        assert await resp.json() == error_body(
            "payload_too_large", "The request body is larger than 1024 bytes allowed here."
        )
    # The upstream may have seen the start of it, but never a complete request.
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_chunked_body_within_the_limit_is_forwarded_whole(gateway, issuer, upstream, client):
    async with client.post(
        gateway.url + "/small/x", data=chunks(1000), headers=dict([auth(issuer)])
    ) as resp:
        assert resp.status == 200
        seen = await resp.json()
    assert seen["body_size"] == 1000
    assert upstream.requests == [seen]


# ---------------------------------------------------------------------------- time


@pytest.mark.parametrize(
    ("framing", "sent"),
    [
        ([("Content-Length", "100")], b"0123456789"),  # read whole before forwarding
        ([("Content-Length", "200000")], b"s" * 1000),  # streamed to the upstream
        ([("Transfer-Encoding", "chunked")], b"a\r\n0123456789\r\n"),
    ],
    ids=["small", "streamed", "chunked"],
)
async def test_client_stalling_mid_body_gets_408_and_the_connection_closed(
    gateway, issuer, upstream, framing, sent
):
    connection = await RawConnection.open(gateway.url)
    try:
        await connection.send(raw_request("POST", "/upload/x", [auth(issuer), *framing], sent))
        answer = await connection.response()
        assert await connection.closed_by_peer()
    finally:
        connection.close()
    assert answer.status == 408
    assert answer.headers["Connection"] == "close"
    assert answer.json() == error_body(
        "request_timeout", "The request body did not arrive in time."
    )
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_half_a_request_head_is_dropped_after_idle_timeout(gateway, upstream):
    connection = await RawConnection.open(gateway.url)
    try:
        await connection.send(b"GET /public/x HTTP/1.1\r\nHost: gateway.test\r\nX-Slow: ")
        # idle_timeout is 300ms: the connection is closed without an answer.
        assert await connection.closed_by_peer(timeout=5)
    finally:
        connection.close()
    assert upstream.requests == []
    await assert_still_serving(gateway, upstream)


async def test_a_connection_that_never_sends_is_dropped_after_idle_timeout(gateway, upstream):
    connection = await RawConnection.open(gateway.url)
    try:
        assert await connection.closed_by_peer(timeout=5)
    finally:
        connection.close()
    await assert_still_serving(gateway, upstream)


async def test_an_idle_keep_alive_connection_is_closed_after_idle_timeout(gateway, upstream):
    connection = await RawConnection.open(gateway.url)
    try:
        await connection.send(raw_request("GET", "/public/first"))
        assert (await connection.response()).status == 200
        assert await connection.closed_by_peer(timeout=5)
    finally:
        connection.close()
    assert [seen["raw_path"] for seen in upstream.requests] == ["/public/first"]


async def test_idle_timeout_does_not_cut_a_slow_upstream_answer(gateway, issuer, upstream):
    # The request is complete; waiting for the upstream is not idleness of the client.
    answer = await raw_exchange(gateway.url, raw_request("GET", "/_slow/0.6", [auth(issuer)]))
    assert answer.status == 200
    assert answer.json()["raw_path"] == "/_slow/0.6"
