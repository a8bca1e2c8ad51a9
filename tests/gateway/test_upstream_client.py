"""gateway.transport.upstream_client: keep-alive reuse, framing both ways, strict parsing, flow
control, timeouts and cancellation, against upstreams written in bytes on 127.0.0.1 (and, for the
smuggling cases, through a running gateway); and the table of a connection's phases."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import uvloop
from multidict import CIMultiDict

from gateway.transport.upstream_client import (
    EVENTS,
    TRANSITIONS,
    Event,
    LifecycleError,
    Origin,
    Phase,
    RequestFields,
    UpstreamBroken,
    UpstreamClient,
    UpstreamRefused,
    next_phase,
)
from tests.support import gateway_yaml, raw_exchange, raw_request, running_gateway

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"


@dataclass
class Request:
    head: bytes
    body: bytes
    connection: int  # which connection (0, 1, ...) carried it

    @property
    def line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]


@dataclass
class RawUpstream:
    """An upstream that reads each request whole (Content-Length or chunked) and writes what
    `answer(request)` gives, byte for byte; None closes the connection without answering."""

    answer: Callable[[Request], bytes | None]
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    server: asyncio.Server | None = None

    async def start(self) -> RawUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request = Request(head, await _read_body(reader, head), number)
                self.requests.append(request)
                answer = self.answer(request)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    fields = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    }
    if fields.get(b"transfer-encoding") == b"chunked":
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readexactly(2)
        return b"".join(parts)
    return await reader.readexactly(int(fields.get(b"content-length", b"0")))


@contextlib.asynccontextmanager
async def upstream(answer: Callable[[Request], bytes | None]) -> AsyncIterator[RawUpstream]:
    server = await RawUpstream(answer).start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def client_for(
    port: int,
    *,
    max_connections: int = 4,
    read_timeout: float = 5.0,
    buffer_size: int = 65536,
) -> AsyncIterator[UpstreamClient]:
    client = UpstreamClient(
        Origin("127.0.0.1", port),
        max_connections=max_connections,
        connect_timeout=2.0,
        read_timeout=read_timeout,
        buffer_size=buffer_size,
    )
    try:
        yield client
    finally:
        await client.close()


async def fetch(
    client: UpstreamClient,
    method: str = "GET",
    target: str = "/",
    body: bytes | AsyncIterator[bytes] | None = None,
    headers: list[tuple[str, str]] | None = None,
    *,
    single_use: bool = False,
) -> tuple[int, CIMultiDict[str], bytes]:
    answer = await client.request(
        method, target, CIMultiDict(headers or []), body, single_use=single_use
    )
    try:
        return answer.status, answer.headers, await answer.read()
    finally:
        answer.release()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- reuse and the pool


async def test_sequential_requests_share_one_keep_alive_connection():
    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        for _ in range(5):
            assert await fetch(client) == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert up.connections == 1
        assert client.open_connections == client.idle_connections == 1


async def test_no_more_connections_open_than_the_limit_and_idle_ones_are_reused():
    async with upstream(lambda r: OK) as up, client_for(up.port, max_connections=3) as client:
        for _ in range(4):
            results = await asyncio.gather(*(fetch(client) for _ in range(3)))
            assert [status for status, _, _ in results] == [200, 200, 200]
            assert client.open_connections <= 3
        assert up.connections == 3
        assert client.idle_connections == 3


async def test_an_idle_connection_the_upstream_closed_is_dropped_and_a_fresh_one_used():
    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        assert (await fetch(client))[0] == 200
        for writer in up.writers:
            writer.close()  # the upstream's idle timeout
        await settle()
        assert client.idle_connections == 0
        assert (await fetch(client))[0] == 200
        assert up.connections == 2


async def test_a_request_without_body_is_sent_again_when_its_pooled_connection_closes_unanswered():
    # The upstream closes each connection on its second request without answering: the
    # race of an idle timeout with a request on its way.
    def answer(r: Request) -> bytes | None:
        return None if sum(q.connection == r.connection for q in up.requests) == 2 else OK

    async with upstream(answer) as up, client_for(up.port) as client:
        assert (await fetch(client))[0] == 200
        assert (await fetch(client, "GET", "/again"))[0] == 200
        assert [r.line for r in up.requests] == [
            b"GET / HTTP/1.1",
            b"GET /again HTTP/1.1",
            b"GET /again HTTP/1.1",
        ]
        assert up.connections == 2


@pytest.mark.parametrize(
    ("method", "body"), [("PUT", b"once"), ("POST", None)], ids=["with-a-body", "post"]
)
async def test_a_request_with_a_body_or_not_idempotent_is_not_sent_again(method, body):
    def answer(r: Request) -> bytes | None:
        return None if sum(q.connection == r.connection for q in up.requests) == 2 else OK

    async with upstream(answer) as up, client_for(up.port) as client:
        assert (await fetch(client))[0] == 200
        with pytest.raises(UpstreamBroken):
            await fetch(client, method, "/", body)
        assert len(up.requests) == 2


async def test_a_single_use_request_and_a_connection_close_answer_close_the_connection():
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    http10 = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"
    answers = iter([OK, closing, http10, OK])
    async with upstream(lambda r: next(answers)) as up, client_for(up.port) as client:
        headers = [("Connection", "close")]
        await fetch(client, "DELETE", "/", b"x", headers, single_use=True)
        await fetch(client)
        await fetch(client)
        await fetch(client)
        await settle()
        assert up.connections == 4
        assert client.open_connections == 1


# ---------------------------------------------------------------------- the request on the wire


async def test_the_request_head_carries_host_the_headers_in_order_and_the_body_framing():
    async def streamed() -> AsyncIterator[bytes]:
        yield b"abc"
        yield b"defg"

    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        port = up.port
        await fetch(client, "GET", "/a?b=c", None, [("X-One", "1"), ("x-two", "2")])
        await fetch(client, "POST", "/p", b"hello")
        await fetch(client, "POST", "/s", streamed())
        await fetch(client, "PUT", "/n")
        await fetch(client, "POST", "/l", streamed(), [("Content-Length", "7")])
        await fetch(client, "GET", "/h", None, [("Host", "api.example")])
    heads = [r.head.decode() for r in up.requests]
    assert heads[0] == (
        f"GET /a?b=c HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-One: 1\r\nx-two: 2\r\n\r\n"
    )
    assert heads[1].endswith("\r\nContent-Length: 5\r\n\r\n")
    assert heads[2].endswith("\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert heads[3].endswith("\r\nContent-Length: 0\r\n\r\n")
    assert heads[4].endswith("\r\nContent-Length: 7\r\n\r\n")
    assert "Transfer-Encoding" not in heads[4]
    assert heads[5] == "GET /h HTTP/1.1\r\nHost: api.example\r\n\r\n"
    assert [r.body for r in up.requests] == [b"", b"hello", b"abcdefg", b"", b"abcdefg", b""]


async def test_a_header_value_holding_cr_or_lf_is_never_written():
    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        with pytest.raises(ValueError):
            await fetch(client, headers=[("X-A", "a\r\nX-Injected: b")])
        assert up.requests == []


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        ("/a\r\nX-Injected: b", []),
        ("/a\x00", []),
        ("/", [("Host", "a\nX-Injected: b")]),
        ("/", [("X-A\r\nX-Injected", "b")]),
        ("/", [("X-A", "a\x00")]),
    ],
    ids=["crlf-in-target", "nul-in-target", "lf-in-host", "crlf-in-name", "nul-in-value"],
)
async def test_a_request_line_host_or_field_holding_cr_lf_or_nul_is_never_written(target, headers):
    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        with pytest.raises(ValueError):
            await fetch(client, "GET", target, None, headers)
        assert up.requests == []


@pytest.mark.parametrize(
    ("name", "value"), [("X-A", "a\r\nX-B: b"), ("X-A", "a\rb"), ("X-A", "a\x00"), ("X\nA", "a")]
)
def test_a_field_added_holding_cr_lf_or_nul_is_refused(name, value):
    fields = RequestFields([b"X-Z: z\r\n"])
    with pytest.raises(ValueError):
        fields.add(name, value)
    assert fields.wire == [b"X-Z: z\r\n"]


def test_fields_read_back_as_a_multidict_are_the_same_fields_in_order_host_first():
    headers = CIMultiDict(
        [("X-A", "caf\udce9"), ("Host", "api.example"), ("x-a", "2"), ("X-Empty", "")]
    )
    fields = RequestFields.from_headers(headers)
    fields.add("Connection", "close")
    assert fields.wire[0] == b"X-A: caf\xe9\r\nx-a: 2\r\nX-Empty: \r\n"
    assert list(fields.as_headers().items()) == [
        ("Host", "api.example"),
        ("X-A", "caf\udce9"),
        ("x-a", "2"),
        ("X-Empty", ""),
        ("Connection", "close"),
    ]


# ---------------------------------------------------------------------- answers and their bodies


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello"),
        (
            CHUNKED + b"\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n",
            b"hello",
        ),
        (b"HTTP/1.1 200 OK\r\n\r\nhello", b"hello"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello", b"hello"),
    ],
    ids=["content-length", "chunked", "until-close", "not-chunked-coding"],
)
async def test_a_body_is_read_by_length_chunks_or_until_the_connection_ends(raw, body):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1]) as client:
            assert (await fetch(client))[2] == body
    finally:
        server.close()


async def test_headers_keep_their_case_order_and_repetitions_and_the_reason_its_words():
    raw = (
        b"HTTP/1.1 201 Made It\r\nX-b: 1\r\nSet-Cookie: a=1\r\nset-cookie: b=2\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    async with upstream(lambda r: raw) as up, client_for(up.port) as client:
        answer = await client.request("GET", "/", CIMultiDict(), None)
        answer.release()
    assert (answer.status, answer.reason) == (201, "Made It")
    assert list(answer.headers.items()) == [
        ("X-b", "1"),
        ("Set-Cookie", "a=1"),
        ("set-cookie", "b=2"),
        ("Content-Length", "0"),
    ]


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n"),
        ("HEAD", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
        ("GET", b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n"),
        ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n"),
    ],
    ids=["head-length", "head-chunked", "204", "304-with-length"],
)
async def test_head_204_and_304_answers_have_no_body_and_the_connection_carries_on(method, raw):
    answers = iter([raw, OK])
    async with upstream(lambda r: next(answers)) as up, client_for(up.port) as client:
        status, _, body = await fetch(client, method)
        assert body == b""
        assert await fetch(client) == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert status in (200, 204, 304)
        assert up.connections == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\n",
    ],
    ids=["connection-close", "http-1.0"],
)
async def test_a_head_answer_that_ends_the_connection_is_not_pooled(raw):
    answers = iter([raw, OK])
    async with upstream(lambda r: next(answers)) as up, client_for(up.port) as client:
        assert (await fetch(client, "HEAD"))[0] == 200
        assert client.idle_connections == 0
        assert (await fetch(client))[2] == b"ok"
        assert up.connections == 2


async def test_bytes_after_a_head_answer_close_the_connection():
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    async with upstream(lambda r: raw) as up, client_for(up.port) as client:
        assert (await fetch(client, "HEAD"))[2] == b""
        await settle()
        assert client.open_connections == 0


async def test_bytes_from_the_upstream_while_idle_close_the_connection():
    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        assert (await fetch(client))[0] == 200
        up.writers[0].write(OK)  # an answer to no request
        await settle()
        assert client.open_connections == client.idle_connections == 0
        assert (await fetch(client))[0] == 200
        assert up.connections == 2


async def test_a_body_until_close_cut_by_a_reset_is_broken_not_whole():
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart of it")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1]) as client:
            with pytest.raises(UpstreamBroken):
                await fetch(client)
    finally:
        server.close()


async def test_interim_answers_are_skipped():
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    async with upstream(lambda r: raw) as up, client_for(up.port) as client:
        assert await fetch(client) == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert await fetch(client) == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert up.connections == 1


SMUGGLING = {
    "length-and-chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "chunked-and-length": CHUNKED + b"Content-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "same-length-twice": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    "length-list": b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc",
    "bad-chunk-size": CHUNKED + b"\r\nzz\r\nabc\r\n0\r\n\r\n",
    "chunk-size-overflow": CHUNKED + b"\r\nfffffffffffffffffff\r\nabc\r\n",
    "bare-lf-in-field": b"HTTP/1.1 200 OK\r\nX-A: a\nSet-Cookie: injected=1\r\n"
    b"Content-Length: 0\r\n\r\n",
    "space-before-colon": b"HTTP/1.1 200 OK\r\nContent-Length : 3\r\n\r\nabc",
    "folded-field": b"HTTP/1.1 200 OK\r\nX-A: a\r\n Set-Cookie: injected=1\r\n"
    b"Content-Length: 0\r\n\r\n",
    "nul-in-field": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n",
}


@pytest.mark.parametrize("raw", SMUGGLING.values(), ids=SMUGGLING.keys())
async def test_an_answer_that_could_be_read_two_ways_is_refused_and_its_connection_closed(raw):
    async with upstream(lambda r: raw) as up, client_for(up.port) as client:
        with pytest.raises(UpstreamBroken):
            await fetch(client)
        await settle()
        assert client.open_connections == 0


@pytest.mark.parametrize("raw", SMUGGLING.values(), ids=SMUGGLING.keys())
async def test_through_the_gateway_such_an_answer_is_a_502(issuer, raw):
    async with (
        upstream(lambda r: raw) as up,
        running_gateway(gateway_yaml(issuer.url, f"http://127.0.0.1:{up.port}")) as gw,
    ):
        answer = await raw_exchange(gw.url, raw_request("GET", "/public/x"))
    assert answer.status == 502
    assert b"injected" not in answer.body
    assert "injected" not in str(answer.headers)


async def test_a_reload_that_changes_only_the_upstream_url_sends_requests_to_the_new_one(
    issuer, tmp_path
):
    async with upstream(lambda r: OK) as old, upstream(lambda r: OK) as new:
        old_url, new_url = f"http://127.0.0.1:{old.port}", f"http://127.0.0.1:{new.port}"
        path = tmp_path / "gateway.yaml"
        async with running_gateway(gateway_yaml(issuer.url, old_url), config_file=path) as gw:
            assert (await raw_exchange(gw.url, raw_request("GET", "/public/a"))).status == 200
            path.write_text(gateway_yaml(issuer.url, new_url))
            assert await gw.gateway.reload()
            assert (await raw_exchange(gw.url, raw_request("GET", "/public/b"))).status == 200
        assert [r.line for r in old.requests] == [b"GET /public/a HTTP/1.1"]
        assert [r.line for r in new.requests] == [b"GET /public/b HTTP/1.1"]


# ---------------------------------------------------------------------- failures and timeouts


async def test_a_refused_connection_is_upstream_refused():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with client_for(port) as client:
        with pytest.raises(UpstreamRefused):
            await fetch(client)
        assert client.open_connections == 0


async def test_silence_longer_than_read_timeout_is_a_timeout_and_closes_the_connection():
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    server = await asyncio.start_server(never, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1], read_timeout=0.2) as client:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError):
                await fetch(client)
            assert 0.2 <= loop.time() - started < 1.5
            assert client.open_connections == 0
    finally:
        server.close()


async def test_read_timeout_counts_from_the_last_byte_not_from_the_request():
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
        for byte in b"slowly":
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1], read_timeout=0.3) as client:
            assert (await fetch(client))[2] == b"slowly"  # 0.6 s in all, 0.1 s between bytes
    finally:
        server.close()


async def test_an_answer_given_before_the_body_was_all_sent_is_read_and_the_connection_closed():
    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 8\r\n\r\ntoo much")
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.close()

    sent = []

    async def body() -> AsyncIterator[bytes]:
        for _ in range(200):
            sent.append(1)
            yield b"z" * 65536
            await asyncio.sleep(0.01)

    server = await asyncio.start_server(early, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1]) as client:
            status, _, got = await fetch(client, "POST", "/", body())
            assert (status, got) == (413, b"too much")
            await settle()
            assert client.open_connections == 0
            assert len(sent) < 200
    finally:
        server.close()


def _answer_early_and_reset(listener: socket.socket, go: threading.Event) -> None:
    """An upstream in a thread of its own: it reads the request's head and, once told to
    (`go`), answers 413 and resets the connection, the body unread."""
    connection, _ = listener.accept()
    with connection:
        head = b""
        while b"\r\n\r\n" not in head:
            head += connection.recv(65536)
        assert go.wait(5)
        connection.sendall(b"HTTP/1.1 413 Too Large\r\nContent-Length: 8\r\n\r\ntoo much")
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _until_reset(sock: socket.socket) -> None:
    """Block until the kernel holds the upstream's reset for `sock` (poll reports POLLERR
    or POLLHUP whatever is asked)."""
    poll = select.poll()
    poll.register(sock.fileno(), 0)
    assert poll.poll(5000)


@pytest.mark.parametrize(
    "loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_an_early_answer_and_a_reset_met_while_the_body_goes_out_is_read_not_lost(loop):
    # The upstream answers and resets while the body's writer runs, and the writer holds
    # the loop until both are in the kernel: the next chunk is written before the loop could
    # read them. Written without a look at the socket first, the chunk meets the reset and
    # the transport closes with the answer unread: UpstreamBroken, not the 413.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    go = threading.Event()
    upstream = threading.Thread(target=_answer_early_and_reset, args=(listener, go))
    upstream.start()

    async def exchange() -> tuple[int, bytes]:
        async with client_for(listener.getsockname()[1]) as client:

            async def body() -> AsyncIterator[bytes]:
                (connection,) = client._open
                assert connection.transport is not None
                go.set()
                _until_reset(connection.transport.get_extra_info("socket"))
                for _ in range(64):
                    yield b"z" * 65536

            status, _, got = await fetch(client, "POST", "/", body())
            return status, got

    try:
        with asyncio.Runner(loop_factory=loop) as runner:
            assert runner.run(exchange()) == (413, b"too much")
    finally:
        upstream.join(5)
        listener.close()


async def test_a_cancelled_exchange_closes_its_connection():
    answered, ended = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()
        answered.set()
        await reader.read()  # b"" once the client closes
        ended.set()

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1]) as client:
            task = asyncio.create_task(fetch(client))
            await asyncio.wait_for(answered.wait(), 2)  # the exchange is in the middle
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(ended.wait(), 2)
            assert client.open_connections == client.idle_connections == 0
    finally:
        server.close()


async def test_closing_the_client_fails_the_exchanges_waiting_on_it_at_once():
    asked = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        asked.set()
        await reader.read()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1], read_timeout=30) as client:
            waiting = asyncio.create_task(fetch(client))
            await asyncio.wait_for(asked.wait(), 2)  # the exchange waits for its answer
            await client.close()
            with pytest.raises(UpstreamBroken):
                await asyncio.wait_for(waiting, 2)
            with pytest.raises(UpstreamRefused):
                await fetch(client)
    finally:
        server.close()


# ---------------------------------------------------------------------- flow control


async def test_a_large_answer_is_read_as_the_reader_takes_it_and_the_upstream_held_back():
    size = 16 * 1024 * 1024
    held_back = []

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        block = b"b" * 65536
        for _ in range(size // len(block)):
            writer.write(block)
            held_back.append(writer.transport.get_write_buffer_size())
            await writer.drain()
        await reader.read()

    server = await asyncio.start_server(big, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1], buffer_size=65536) as client:
            answer = await client.request("GET", "/", CIMultiDict(), None)
            try:
                await asyncio.sleep(0.3)  # the reader is slow to start: the upstream waits
                assert len(held_back) < size // 65536
                assert max(held_back) > 0
                received, largest = 0, 0
                while chunk := await answer.readany():
                    received += len(chunk)
                    largest = max(largest, len(chunk))
            finally:
                answer.release()
        assert received == size
        assert largest <= 4 * 65536
    finally:
        server.close()


async def test_a_large_streamed_body_goes_out_as_fast_as_the_upstream_reads_it():
    size = 16 * 1024 * 1024
    written: list[int] = []
    client_ref: list[UpstreamClient] = []

    async def slow_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        received = 0
        while received < size:
            line = await reader.readuntil(b"\r\n")
            length = int(line.strip(), 16)
            received += len(await reader.readexactly(length + 2)) - 2
            await asyncio.sleep(0)
        await reader.readuntil(b"0\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(str(received)))
        writer.write(str(received).encode())
        await writer.drain()

    async def body() -> AsyncIterator[bytes]:
        block = b"u" * 65536
        for _ in range(size // len(block)):
            yield block
            connection = next(iter(client_ref[0]._open))
            assert connection.transport is not None
            written.append(connection.transport.get_write_buffer_size())

    server = await asyncio.start_server(slow_reader, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1]) as client:
            client_ref.append(client)
            assert (await fetch(client, "POST", "/", body()))[2] == str(size).encode()
        # The client's send buffer never held much more than one block beyond the
        # transport's high-water mark: the body waited for the upstream.
        assert max(written) <= 1024 * 1024
    finally:
        server.close()


async def test_an_answer_held_back_while_the_body_still_goes_out_costs_no_cpu():
    size = 8 * 1024 * 1024

    async def duplex(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers at once, and reads the request body meanwhile, as fast as it comes.
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"a" * size)
        while length := int((await reader.readuntil(b"\r\n")).strip(), 16):
            await reader.readexactly(length + 2)
        await reader.readexactly(2)
        await writer.drain()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(size // 65536):
            yield b"e" * 65536
            await asyncio.sleep(0.002)

    server = await asyncio.start_server(duplex, "127.0.0.1", 0)
    try:
        async with client_for(server.sockets[0].getsockname()[1]) as client:
            cpu, wall = time.process_time(), time.perf_counter()
            answer = await client.request("POST", "/", CIMultiDict(), body())
            try:
                received = 0
                while chunk := await answer.readany():
                    received += len(chunk)
                    await asyncio.sleep(0.01)  # a slow reader: the answer is held back
            finally:
                answer.release()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert received == size
        # While the answer waits for its reader, the body's writer does not spin.
        assert cpu < 0.6 * wall
    finally:
        server.close()


async def test_an_answer_released_with_its_body_unread_closes_its_connection():
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n" + b"b" * 300000
    answers = iter([big, OK])
    async with upstream(lambda r: next(answers)) as up, client_for(up.port) as client:
        answer = await client.request("GET", "/", CIMultiDict(), None)
        answer.release()
        assert client.open_connections == client.idle_connections == 0
        assert (await fetch(client))[2] == b"ok"
        assert up.connections == 2


async def test_a_second_answer_in_the_bytes_of_the_first_is_not_read_and_closes_the_connection():
    async with upstream(lambda r: OK + OK) as up, client_for(up.port) as client:
        assert await fetch(client) == (200, CIMultiDict({"Content-Length": "2"}), b"ok")
        assert client.open_connections == client.idle_connections == 0
        assert (await fetch(client))[2] == b"ok"
        assert up.connections == 2


# ---------------------------------------------------------------------- the phases' table


def test_every_event_a_phase_does_not_list_is_refused_and_every_listed_one_leads_where_listed():
    assert set(TRANSITIONS) == set(Phase)
    for phase in Phase:
        for event in EVENTS:
            listed = TRANSITIONS[phase].get(event)
            if listed is None:
                with pytest.raises(LifecycleError):
                    next_phase(phase, event)
            else:
                assert next_phase(phase, event) is listed


def _leading_to(target: Phase) -> set[tuple[Phase, Event]]:
    return {
        (phase, event)
        for phase, events in TRANSITIONS.items()
        for event, then in events.items()
        if then is target and phase is not target
    }


def test_a_connection_is_pooled_only_from_done_and_done_only_follows_a_whole_answer_released():
    assert _leading_to(Phase.IDLE) == {(Phase.DONE, "pooled")}
    assert _leading_to(Phase.DONE) == {(Phase.COMPLETE, "released")}
    for phase in set(Phase) - {Phase.DONE}:
        with pytest.raises(LifecycleError):
            next_phase(phase, "pooled")


CLOSED = {Phase.UNANSWERED, Phase.BROKEN, Phase.CLOSED}


def test_a_closed_connection_stays_closed_and_every_phase_the_loop_sees_may_end():
    for phase in CLOSED:
        assert {then for then in TRANSITIONS[phase].values()} <= CLOSED
    # DONE and MUST_CLOSE last only while `_release` runs; before OPENING ends, the loop
    # reports no end of the connection, and an abort has no transport to close.
    for phase in set(Phase) - {Phase.OPENING, Phase.DONE, Phase.MUST_CLOSE}:
        assert next_phase(phase, "ended") in CLOSED
        assert next_phase(phase, "reset") in CLOSED
    for phase in set(Phase) - {Phase.OPENING}:
        assert next_phase(phase, "aborted") in CLOSED
    assert next_phase(Phase.OPENING, "aborted") is Phase.OPENING


def test_only_an_exchange_awaiting_its_answer_takes_bytes_and_only_before_its_end():
    assert {phase for phase in Phase if "bytes" in TRANSITIONS[phase]} == {
        Phase.AWAITING_ANSWER,
        Phase.READING_HEAD,
        Phase.READING_BODY,
        Phase.READING_UNTIL_CLOSE,
    }
    # RFC 9112 §9.3.2: nothing may follow the answer, not even in the bytes that ended it.
    for event in ("bytes", "message_begin", "body"):
        with pytest.raises(LifecycleError):
            next_phase(Phase.COMPLETE, event)


def test_the_end_of_the_connection_ends_only_a_body_read_until_close_and_only_cleanly():
    assert next_phase(Phase.READING_UNTIL_CLOSE, "ended") is Phase.CLOSED
    assert next_phase(Phase.READING_UNTIL_CLOSE, "reset") is Phase.BROKEN
    for phase in (Phase.READING_HEAD, Phase.READING_BODY):
        assert next_phase(phase, "ended") is Phase.BROKEN
    assert next_phase(Phase.AWAITING_ANSWER, "ended") is Phase.UNANSWERED


def test_a_body_released_unread_never_leaves_the_connection_reusable():
    for phase in (Phase.READING_BODY, Phase.READING_UNTIL_CLOSE):
        assert next_phase(phase, "released") is Phase.MUST_CLOSE
    assert next_phase(Phase.COMPLETE, "released_closing") is Phase.MUST_CLOSE


async def test_a_connection_follows_the_table_and_an_event_out_of_turn_is_a_bug_that_raises():
    async with upstream(lambda r: OK) as up, client_for(up.port) as client:
        assert (await fetch(client))[0] == 200
        (connection,) = client._idle
        assert connection.phase is Phase.IDLE
        with pytest.raises(LifecycleError):
            connection.begin(head_only=False)  # an exchange on a connection still pooled
        with pytest.raises(LifecycleError):
            connection.pool()  # pooled twice
        assert connection.phase is Phase.IDLE
        assert (await fetch(client))[0] == 200
        assert up.connections == 1
    assert connection.phase is Phase.CLOSED
