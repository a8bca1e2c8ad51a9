"""A few clients cannot starve the rest: slow bodies, a full upstream pool, connection floods.

Each test runs a real gateway in front of a real upstream on 127.0.0.1 with a small pool and
short timeouts, and plays the attack over raw sockets: bodies sent a byte at a time, bodies
that never end, more connections than the gateway takes. Then it checks that an ordinary
request is still answered, and that the gateway's refusal is the documented one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.transport.capacity import BodiesInFlight, Slots
from tests.support import (
    CountingUpstream,
    EchoUpstream,
    RawConnection,
    RawResponse,
    TestIssuer,
    gateway_yaml,
    raw_exchange,
    raw_request,
    running_gateway,
    wait_for,
)

TRICKLE = 0.1  # seconds between the bytes of a slow body: well under body_timeout


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    server = TestIssuer()
    server.add_key("ES256")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def counting_upstream() -> AsyncIterator[CountingUpstream]:
    server = CountingUpstream()
    await server.start()
    yield server
    await server.stop()


def config(issuer: TestIssuer, upstream: EchoUpstream, pool: str = "", limits: str = "") -> str:
    """The usual test config, with `pool` keys added to `upstream` and a `limits` section."""
    text = gateway_yaml(issuer.url, upstream.url, extra=f"limits: {{{limits}}}" if limits else "")
    return text.replace(
        "read_timeout: 2s", f"read_timeout: 2s, {pool}" if pool else "read_timeout: 2s"
    )


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": []}}


class SlowBody:
    """A request whose body arrives a byte every TRICKLE seconds until `finish` or `close`."""

    def __init__(self, connection: RawConnection, chunked: bool) -> None:
        self.connection = connection
        self.chunked = chunked
        self.sent = 0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        url: str,
        target: str = "/public/slow",
        *,
        length: int | None = None,
        prefix: int = 0,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> SlowBody:
        """Send the head (chunked, or with Content-Length `length`), `prefix` bytes at once,
        then one byte every TRICKLE seconds."""
        connection = await RawConnection.open(url)
        framing = (
            ("Transfer-Encoding", "chunked") if length is None else ("Content-Length", str(length))
        )
        slow = cls(connection, length is None)
        await connection.send(raw_request("POST", target, [framing, *headers]))
        if prefix:
            await slow._send(b"p" * prefix)
        slow._task = asyncio.create_task(slow._trickle())
        return slow

    async def _send(self, data: bytes) -> None:
        framed = f"{len(data):x}\r\n".encode() + data + b"\r\n" if self.chunked else data
        self.sent += len(data)  # written before the first pause, so counted before it
        await self.connection.send(framed)

    async def _trickle(self) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await self._send(b"t")
                await asyncio.sleep(TRICKLE)

    async def stop_trickling(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def finish(self, rest: bytes = b"") -> RawResponse:
        """Send `rest` and the end of the body, then read the answer."""
        await self.stop_trickling()
        if rest:
            await self._send(rest)
        if self.chunked:
            await self.connection.send(b"0\r\n\r\n")
        return await self.connection.response()

    async def close(self) -> None:
        await self.stop_trickling()
        self.connection.close()


@contextlib.asynccontextmanager
async def slow_bodies(url: str, count: int, **options: Any) -> AsyncIterator[list[SlowBody]]:
    bodies = [await SlowBody.start(url, **options) for _ in range(count)]
    try:
        yield bodies
    finally:
        for body in bodies:
            await body.close()


async def ordinary_request(url: str, target: str = "/public/ordinary") -> RawResponse:
    """A GET without a body, given 2 seconds: far more than it takes when nothing is stuck."""
    return await raw_exchange(url, raw_request("GET", target), timeout=2)


# ---------------------------------------------------------------------------- the attack


async def test_slow_chunked_bodies_on_a_public_route_do_not_starve_other_clients(
    issuer, counting_upstream
):
    # Six clients, no token, each sending a chunked body a byte at a time (always within
    # body_timeout) to a pool of four upstream connections.
    text = config(issuer, counting_upstream, pool="max_connections: 4", limits="body_timeout: 1s")
    async with running_gateway(text) as gw, slow_bodies(gw.url, 6):
        await asyncio.sleep(5 * TRICKLE)  # the slow bodies are well under way
        for _ in range(3):
            answer = await ordinary_request(gw.url)
            assert answer.status == 200
            assert answer.json()["raw_path"] == "/public/ordinary"
        # None of them holds an upstream connection while it is still arriving.
        assert "/public/slow" not in counting_upstream.arrived


@pytest.mark.parametrize(
    ("length", "prefix"),
    [(None, 0), (200_000, 0), (200_000, 20_000)],
    ids=["chunked", "long-content-length", "long-content-length-part-sent"],
)
async def test_a_body_still_within_the_buffer_size_holds_no_upstream_connection(
    issuer, counting_upstream, length, prefix
):
    text = config(issuer, counting_upstream, pool="max_connections: 1", limits="body_timeout: 1s")
    async with running_gateway(text) as gw:
        slow = await SlowBody.start(gw.url, length=length, prefix=prefix)
        try:
            await asyncio.sleep(5 * TRICKLE)
            answer = await ordinary_request(gw.url)
            assert answer.status == 200
            assert counting_upstream.arrived == ["/public/ordinary"]
            # The slow body is forwarded whole once it is complete.
            await slow.stop_trickling()
            rest = b"r" * (length - slow.sent) if length is not None else b"end"
            finished = await slow.finish(rest)
        finally:
            await slow.close()
        assert finished.status == 200
        assert finished.json()["body_size"] == slow.sent


# ---------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize(
    ("length", "prefix"),
    [(None, 0), (200_000, 100_000), (None, 100_000)],
    ids=["chunked-buffering", "content-length-streaming", "chunked-streaming"],
)
async def test_a_body_trickling_past_body_total_timeout_gets_408(issuer, upstream, length, prefix):
    # Every pause is well within body_timeout; the body as a whole is not.
    text = config(issuer, upstream, limits="body_timeout: 1s, body_total_timeout: 1s")
    async with running_gateway(text) as gw:
        slow = await SlowBody.start(gw.url, "/public/upload", length=length, prefix=prefix)
        try:
            answer = await slow.connection.response(timeout=4)
            assert await slow.connection.closed_by_peer()
        finally:
            await slow.close()
        assert answer.status == 408
        assert answer.headers["Connection"] == "close"
        assert answer.json() == error_body(
            "request_timeout", "The request body did not arrive in time."
        )
        assert upstream.requests == []  # never a complete request upstream
        assert (await ordinary_request(gw.url)).status == 200


async def test_a_body_within_body_total_timeout_is_forwarded(issuer, upstream, client):
    text = config(issuer, upstream, limits="body_total_timeout: 5s")

    async def paced() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"b" * 30_000
            await asyncio.sleep(0.05)

    async with running_gateway(text) as gw, client.post(gw.url + "/public/up", data=paced()) as r:
        assert r.status == 200
        assert (await r.json())["body_size"] == 150_000


# ---------------------------------------------------------------------------- the pool


async def test_a_full_upstream_pool_answers_503_with_retry_after_after_pool_timeout(
    issuer, counting_upstream, client
):
    text = config(issuer, counting_upstream, pool="max_connections: 2, pool_timeout: 300ms")
    headers = {"Authorization": f"Bearer {issuer.token()}"}
    async with running_gateway(text) as gw:

        async def occupy() -> int:
            async with client.get(gw.url + "/_slow/1.5", headers=headers) as resp:
                await resp.read()
                return resp.status

        busy = [asyncio.create_task(occupy()) for _ in range(2)]
        await wait_for(lambda: len(counting_upstream.arrived) == 2, what="two slow requests")
        answer = await ordinary_request(gw.url)
        assert answer.status == 503
        assert answer.headers["Retry-After"] == "1"
        assert answer.json() == error_body(
            "unavailable", "The upstream service is busy; try again shortly."
        )
        assert await asyncio.gather(*busy) == [200, 200]
        assert (await ordinary_request(gw.url)).status == 200
        assert counting_upstream.arrived == ["/_slow/1.5", "/_slow/1.5", "/public/ordinary"]


async def test_requests_waiting_for_the_pool_are_served_when_a_connection_frees(
    issuer, counting_upstream, client
):
    text = config(issuer, counting_upstream, pool="max_connections: 1, pool_timeout: 3s")
    headers = {"Authorization": f"Bearer {issuer.token()}"}
    async with running_gateway(text) as gw:

        async def get(target: str) -> int:
            async with client.get(gw.url + target, headers=headers) as resp:
                await resp.read()
                return resp.status

        first = asyncio.create_task(get("/_slow/0.3"))
        await wait_for(lambda: len(counting_upstream.arrived) == 1, what="the slow request")
        waiting = [asyncio.create_task(get(f"/public/{n}")) for n in range(3)]
        assert await asyncio.gather(first, *waiting) == [200, 200, 200, 200]
    assert sorted(counting_upstream.arrived) == [
        "/_slow/0.3",
        "/public/0",
        "/public/1",
        "/public/2",
    ]


# ---------------------------------------------------------------------------- per client


async def test_bodies_in_flight_per_client_address_are_capped_with_429(issuer, upstream):
    text = config(issuer, upstream, limits="body_timeout: 2s, max_bodies_per_client: 2")
    small = raw_request("POST", "/public/third", [("Content-Length", "5")], b"hello")
    async with running_gateway(text) as gw, slow_bodies(gw.url, 2) as (first, _):
        bodies = gw.gateway.bodies_in_flight
        await wait_for(lambda: bodies.count("127.0.0.1") == 2, what="both slow bodies")
        refused = await raw_exchange(gw.url, small)
        assert refused.status == 429
        assert refused.headers["Retry-After"] == "1"
        assert refused.json() == error_body(
            "rate_limited",
            "Too many request bodies from this client are still arriving; try again shortly.",
        )
        # A request without a body is not held back.
        assert (await ordinary_request(gw.url)).status == 200
        # Once one body is complete, another may come.
        assert (await first.finish()).status == 200
        accepted = await raw_exchange(gw.url, small)
        assert accepted.status == 200
        assert accepted.json()["body_size"] == 5
    assert [seen["raw_path"] for seen in upstream.requests] == [
        "/public/ordinary",
        "/public/slow",
        "/public/third",
    ]


async def test_bodies_are_counted_per_client_behind_trusted_proxies(issuer, upstream):
    text = config(issuer, upstream, limits="body_timeout: 2s, max_bodies_per_client: 1")
    text += 'trusted_proxies: ["127.0.0.1/32"]\n'

    def body_from(client: str) -> bytes:
        headers = [("Content-Length", "2"), ("X-Forwarded-For", client)]
        return raw_request("POST", "/public/x", headers, b"hi")

    async with running_gateway(text) as gw:
        slow = await SlowBody.start(gw.url, headers=(("X-Forwarded-For", "203.0.113.1"),))
        try:
            bodies = gw.gateway.bodies_in_flight
            await wait_for(lambda: bodies.count("203.0.113.1") == 1, what="the slow body")
            assert (await raw_exchange(gw.url, body_from("203.0.113.2"))).status == 200
            assert (await raw_exchange(gw.url, body_from("203.0.113.1"))).status == 429
        finally:
            await slow.close()


# ---------------------------------------------------------------------------- connections


async def test_connections_over_max_connections_are_closed_and_open_ones_keep_working(
    issuer, upstream
):
    text = config(issuer, upstream, limits="max_connections: 4, idle_timeout: 5s")
    async with running_gateway(text) as gw:
        # Four half-sent request heads hold every connection the gateway takes.
        held = [await RawConnection.open(gw.url) for _ in range(4)]
        try:
            for n, connection in enumerate(held):
                await connection.send(f"GET /public/held-{n} HTTP/1.1\r\nHost: a\r\n".encode())
            extra = await RawConnection.open(gw.url)
            try:
                assert await extra.closed_by_peer(timeout=2)
            finally:
                extra.close()
            # The held connections are served as usual, and keep their keep-alive.
            for n, connection in enumerate(held):
                await connection.send(b"\r\n")
                answer = await connection.response()
                assert answer.status == 200
                assert answer.json()["raw_path"] == f"/public/held-{n}"
            await held[0].send(raw_request("GET", "/public/again"))
            assert (await held[0].response()).status == 200
        finally:
            for connection in held:
                connection.close()
        # Closed connections make room again (once the gateway has seen them close).
        assert await served_again(gw.url)


async def served_again(url: str, attempts: int = 50) -> bool:
    for _ in range(attempts):
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            if (await ordinary_request(url)).status == 200:
                return True
        await asyncio.sleep(0.02)
    return False


async def test_a_client_session_sees_the_refusal_as_a_failed_connection(issuer, upstream):
    text = config(issuer, upstream, limits="max_connections: 1, idle_timeout: 5s")
    async with running_gateway(text) as gw:
        held = await RawConnection.open(gw.url)
        try:
            await held.send(b"GET /public/x HTTP/1.1\r\n")
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.ClientError):
                    async with session.get(gw.url + "/public/y") as resp:
                        await resp.read()
        finally:
            held.close()


# ---------------------------------------------------------------------------- the counters


async def test_slots_go_to_waiting_requests_in_the_order_they_came():
    slots = Slots(1)
    assert slots.try_take()
    served: list[int] = []

    async def wait_then_hold(number: int) -> None:
        assert await slots.wait(5)
        served.append(number)

    waiters = [asyncio.create_task(wait_then_hold(n)) for n in range(3)]
    await asyncio.sleep(0)  # all three are queued
    # A newcomer does not jump the queue, even when a slot is being handed over.
    assert not slots.try_take()
    for expected in ([0], [0, 1], [0, 1, 2]):
        slots.give_back()
        await wait_for(lambda expected=expected: served == expected, what=f"{expected}")
    await asyncio.gather(*waiters)
    assert slots.held == 1
    slots.give_back()
    assert slots.held == 0
    assert slots.try_take()


async def test_a_request_that_waits_too_long_gets_no_slot_and_leaves_the_queue():
    slots = Slots(1)
    assert slots.try_take()
    assert not await slots.wait(0.05)
    assert slots.held == 1
    slots.give_back()
    assert slots.held == 0  # nobody was left waiting to be handed the slot


async def test_a_slot_handed_to_a_request_that_left_goes_to_the_next():
    slots = Slots(1)
    assert slots.try_take()
    gone = asyncio.create_task(slots.wait(5))
    next_in_line = asyncio.create_task(slots.wait(5))
    await asyncio.sleep(0)
    slots.give_back()  # handed to `gone`...
    gone.cancel()  # ...which is cancelled before it could use it
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await next_in_line
    assert slots.held == 1


def test_bodies_in_flight_are_capped_per_address_and_forgotten_at_zero():
    bodies = BodiesInFlight(2)
    assert bodies.enter("198.51.100.1") and bodies.enter("198.51.100.1")
    assert not bodies.enter("198.51.100.1")
    assert bodies.enter("198.51.100.2")
    bodies.leave("198.51.100.1")
    assert bodies.enter("198.51.100.1")
    for address in ("198.51.100.1", "198.51.100.1", "198.51.100.2"):
        bodies.leave(address)
    assert len(bodies) == 0


def test_bodies_in_flight_without_a_cap_count_but_never_refuse():
    bodies = BodiesInFlight(0)
    assert all(bodies.enter("198.51.100.1") for _ in range(1000))
    assert len(bodies) == 1
