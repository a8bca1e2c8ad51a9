"""A fast lane through aiohttp's server, for the few requests whose cost is worth a path of
their own (the token endpoint's POST above all).

A connection starts in the lane. While aiohttp's handler for it is idle, the bytes that
arrive are held here until a request is whole; a request whose line is one a `Lane` serves,
whose head is plain (below) and which that lane admits, is answered by the lane without
aiohttp's request, response, router or middleware objects. The first request that is not
is given to aiohttp with every byte held since its start, and the connection is aiohttp's to
its end: aiohttp never sees part of a request the lane read, and no answer overtakes
another (a request that arrives while the lane answers one is held until that answer is
written).

Plain, and anything else goes to aiohttp, which answers it as it always did:
- the request line is exactly one a lane serves (`POST /token HTTP/1.1`): no query, no
  other version;
- at most `MAX_FIELDS` header fields, the head within `MAX_HEAD` bytes; every name a token
  and every value printable ASCII (RFC 9110 §5.1, §5.5): no obs-fold, no obs-text, no
  control character, no whitespace before a colon; no field name twice;
- exactly one `Host` (RFC 9112 §3.2) and one `Content-Length` of digits, within the lane's
  `max_body`; no `Transfer-Encoding`, `Content-Encoding`, `Expect`, `Upgrade` or
  `Sec-WebSocket-Key1`; `Connection` absent or `keep-alive`.
So no request the parser of aiohttp would refuse, or read in another way, is read here:
framing (RFC 9112 §6.3) is the one `Content-Length`, and smuggling has nothing to work on.
Bytes that can no longer begin such a request (another request line, a bare LF, a control
character) go to aiohttp at once, before their head is complete, so that aiohttp answers
them as soon as it would have.

The connection's life stays aiohttp's: its count, its keep-alive timer (restarted after each
answer, as aiohttp does), the graceful shutdown, which waits for an answer in progress
(and cancels it when the wait runs out), and the flow control of writing: a lane answer
written to a client that reads nothing waits for the buffer to drain before the next
request is served, and no more than `MAX_HELD` bytes are held meanwhile.
The lane reaches into aiohttp's `RequestHandler` for that, in the attributes listed in
`PRIVATE_ATTRIBUTES` (and into `Server._loop`, `Server._kwargs` and
`AppRunner._make_server` to be built); tests/portcullis/test_lane.py fails by name when an
aiohttp release moves one.

An answer is `Lane.answer`'s status, fields and body, with `Content-Length`, `Date` and
`Server` last, as aiohttp writes them. A lane that raises gets aiohttp's own 500 answer,
and the connection is closed, as aiohttp does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, NamedTuple, Protocol

import httptools
from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE

log = logging.getLogger("portcullis.lane")

MAX_HEAD = 8 * 1024  # bytes of a request head, its final empty line included
MAX_FIELDS = 64
# What a connection may hold while a request of its is being answered (pipelined requests);
# past it, reading pauses until the answer is written.
MAX_HELD = 256 * 1024

# RFC 9110 §5.5: field-vchar, SP and HTAB, narrowed to ASCII (obs-text goes to aiohttp).
_VALUE_BYTES = bytes(range(0x20, 0x7F)) + b"\t"
# Fields whose presence sends a request to aiohttp: framing it does not read here
# (RFC 9112 §6.1), an interim answer it does not give (RFC 9110 §10.1.1), a protocol switch.
_NOT_IN_LANE = frozenset(
    {"transfer-encoding", "expect", "upgrade", "content-encoding", "sec-websocket-key1"}
)
# What a head that is not complete yet may hold, to be a plain one: printable ASCII, HTAB,
# and CR and LF as line ends (checked apart).
_HEAD_BYTES = _VALUE_BYTES + b"\r\n"
# Content-Length digits beyond these (leading zeros aside) exceed any max_body, and past
# 4,300 int() refuses them.
_MAX_LENGTH_DIGITS = 18

# aiohttp's RequestHandler attributes the lane relies on (see the module's docstring).
PRIVATE_ATTRIBUTES = (
    "_force_close",  # the connection is closing: nothing more is read
    "_close",  # likewise, once the answer in progress is written
    "_request_in_progress",  # shutdown waits for the answer in progress ...
    "_handler_waiter",  # ... on this future, which is set when it is written
    "_keepalive_timeout",
    "_next_keepalive_close_time",  # the idle deadline aiohttp's keep-alive timer checks
    "_keepalive_handle",
    "_process_keepalive",  # the timer's callback, deferred while the lane answers
    "_waiter",  # set while aiohttp's request loop is idle, which the timer checks
    "_loop",
    "_paused",  # the transport asked to stop writing (BaseProtocol) ...
    "_drain_helper",  # ... and this waits until it may go on
)


class LaneRequest:
    """A plain request the lane read whole: its fields by lower-case name, and its body."""

    __slots__ = ("body", "fields")

    def __init__(self, fields: dict[str, list[str]], body: bytes) -> None:
        self.fields = fields
        self.body = body

    def get(self, name: str) -> str | None:
        """The first value of the field `name` (lower case), as aiohttp's `headers.get`."""
        values = self.fields.get(name)
        return values[0] if values else None

    def getall(self, name: str) -> list[str]:
        return self.fields.get(name, [])


class LaneAnswer(NamedTuple):
    status: int
    headers: Sequence[tuple[str, str]]  # in order; Content-Length, Date and Server follow
    body: bytes


class Lane(Protocol):
    """What serves one request line in the lane."""

    max_body: int  # a longer body (by Content-Length) goes to aiohttp

    def admits(self, request: LaneRequest) -> bool:
        """Whether the lane answers this request; else aiohttp does."""

    async def answer(self, request: LaneRequest) -> LaneAnswer: ...


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


_STATUS_LINES = {status.value: _status_line(status.value) for status in HTTPStatus}
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()
_KEEP_OPEN = b"\r\n"
_CLOSE = b"Connection: close\r\n\r\n"

# aiohttp's answer to a handler that raised (RequestHandler.handle_error), for a client that
# does not ask for HTML (one that does gets the same in text: the lane has no HTML pages).
_INTERNAL_ERROR = LaneAnswer(
    500,
    (("Content-Type", "text/plain; charset=utf-8"),),
    b"500 Internal Server Error\n\nServer got itself in trouble",
)


def render(answer: LaneAnswer, close: bool = False) -> bytes:
    """The answer as it goes on the wire (`close`: the connection closes after it). A field
    name or value with CR or LF, which would end its line early, raises ValueError."""
    status, headers, body = answer
    line = _STATUS_LINES.get(status) or _status_line(status)
    head = "".join([f"{name}: {value}\r\n" for name, value in headers])
    if head.count("\n") != len(headers) or head.count("\r") != len(headers):
        raise ValueError("a field of the answer holds CR or LF")
    return b"".join(
        (
            line,
            head.encode("latin-1"),
            b"Content-Length: %d\r\nDate: " % len(body),
            rfc822_formatted_time().encode(),
            b"\r\n",
            _SERVER,
            _CLOSE if close else _KEEP_OPEN,
            body,
        )
    )


class PlainHead(NamedTuple):
    fields: dict[str, list[str]]
    content_length: int


class HeadReader:
    """A connection's reader of plain request heads: llhttp (httptools), strict as aiohttp's
    own parser is, reads the grammar (request line, field names as tokens, the colon, no
    whitespace before it, no obs-fold, Content-Length); the checks here add what makes a
    head plain beyond it. One parser serves every request of the connection in turn: it is
    given exactly one request's head, then exactly its body."""

    __slots__ = ("_complete", "_fields", "_parser", "_refused")

    def __init__(self) -> None:
        self._fields: dict[str, list[str]] = {}
        self._refused = False
        self._complete = False
        self._parser = httptools.HttpRequestParser(self)

    # llhttp's callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("ascii").lower()
        if key in self._fields:
            self._refused = True  # aiohttp refuses some fields twice (Host, Content-Type, ...)
        self._fields[key] = [value.decode("ascii").strip(" \t")]

    def on_message_complete(self) -> None:
        self._complete = True

    def head(self, head: bytes) -> PlainHead | None:
        """The fields of `head` (a request head, its empty line included) when it is plain
        as the module's docstring says; else None, and the reader is not to be used again."""
        fields: dict[str, list[str]] = {}
        self._fields = fields
        self._refused = self._complete = False
        # What llhttp lets through besides (obs-text, a bare LF) is not plain.
        if not _plain_bytes(head) or head.count(b"\r\n") > MAX_FIELDS + 2:
            return None
        try:
            self._parser.feed_data(head)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return None
        length = fields.get("content-length")
        if self._refused or length is None or "host" not in fields:
            return None
        if not _NOT_IN_LANE.isdisjoint(fields):
            return None
        digits = length[0]
        if not digits.isdigit() or len(digits.lstrip("0")) > _MAX_LENGTH_DIGITS:
            return None
        connection = fields.get("connection")
        if connection is not None and connection[0].lower() != "keep-alive":
            return None
        return PlainHead(fields, int(digits))

    def body(self, body: bytes) -> bool:
        """Whether `body`, all of the body the head announced, completes the request."""
        try:
            if body:
                self._parser.feed_data(body)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return False
        return self._complete


def plain_head(head: bytes) -> PlainHead | None:
    """`HeadReader.head` of a reader of its own (for one head alone)."""
    return HeadReader().head(head)


def could_begin_plain(held: bytes | bytearray, lines: Iterable[bytes]) -> bool:
    """Whether `held`, a head not complete yet, may still turn out to be a plain request of
    one of the request `lines`: its request line is one of them (or the start of one), and
    nothing in it is a byte a plain head never holds, or a CR or LF that is not a line end."""
    line_end = held.find(b"\r\n")
    if line_end < 0:
        first = bytes(held[:-1] if held.endswith(b"\r") else held)
        return any(line.startswith(first) for line in lines)
    if bytes(held[:line_end]) not in lines:
        return False
    return _plain_bytes(bytes(held), partial=True)


def _plain_bytes(data: bytes, *, partial: bool = False) -> bool:
    """Whether `data` holds printable ASCII and HTAB only, with CR and LF only as CRLF line
    ends (`partial`: a CR may end it, its LF still to come)."""
    if data.translate(None, _HEAD_BYTES):
        return False
    ends = data.count(b"\r\n")
    cut_off = partial and data.endswith(b"\r")
    return data.count(b"\r") == ends + cut_off and data.count(b"\n") == ends


class _Pending(NamedTuple):
    """A plain head read whole, its body still to come."""

    lane: Lane
    head: PlainHead
    end: int  # where the body starts in the bytes held
    total: int  # where the request ends


class LaneConnection(web.RequestHandler):
    """aiohttp's per-connection protocol, with the lane in front of it."""

    def __init__(self, server: LaneServer, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._lane_server = server
        self._lanes = server.lanes
        self._held = bytearray()
        self._reader = HeadReader()
        self._pending: _Pending | None = None
        self._answering = False  # a lane request is being answered
        self._answering_task: asyncio.Task[None] | None = None
        self._handed_over = False  # aiohttp reads the connection from now on
        self._lane_paused_reading = False

    def data_received(self, data: bytes) -> None:
        if self._handed_over:
            super().data_received(data)
            return
        if self._force_close or self._close:
            return  # as aiohttp: a closing connection reads nothing more
        self._held += data
        if not self._answering:
            self._serve_held()
        elif len(self._held) > MAX_HELD and not self._lane_paused_reading:
            self._pause_lane_reading()

    def _serve_held(self) -> None:
        """Answer the request held, if it is whole and the lane's; hand the connection to
        aiohttp at the first request that is not."""
        held = self._held
        try:
            pending = self._pending or self._read_head()
            if pending is None:
                return
            if len(held) < pending.total:
                self._pending = pending  # the rest of the body is still to come
                return
            self._pending = None
            lane = pending.lane
            body = bytes(held[pending.end : pending.total])
            request = LaneRequest(pending.head.fields, body)
            admitted = self._reader.body(body) and lane.admits(request)
        except Exception:  # a fault of ours: aiohttp reads the request instead
            log.exception("lane could not read a request")
            admitted = False
        if not admitted:
            if not self._handed_over:
                self._hand_over()
            return
        assert pending is not None  # admitted
        del held[: pending.total]
        self._answering = True
        self._request_in_progress = True
        server = self._lane_server
        server.requests_count += 1
        server.lane_requests += 1
        # Held here: the loop keeps only a weak reference to a task.
        self._answering_task = self._loop.create_task(self._answer(lane, request))

    def _read_head(self) -> _Pending | None:
        """The plain head held, once whole; None while it may still become one, or once the
        connection was handed to aiohttp."""
        held = self._held
        if not held:
            return None
        end = held.find(b"\r\n\r\n")
        if end < 0:
            if len(held) > MAX_HEAD or not could_begin_plain(held, self._lanes):
                self._hand_over()
            return None
        line_end = held.find(b"\r\n")
        lane = self._lanes.get(bytes(held[:line_end])) if end + 4 <= MAX_HEAD else None
        head = self._reader.head(bytes(held[: end + 4])) if lane is not None else None
        if lane is None or head is None or head.content_length > lane.max_body:
            self._hand_over()
            return None
        return _Pending(lane, head, end + 4, end + 4 + head.content_length)

    def _hand_over(self) -> None:
        self._handed_over = True
        self._pending = None
        held = bytes(self._held)
        self._held = bytearray()
        if self._lane_paused_reading:
            self._resume_lane_reading()
        super().data_received(held)

    async def _answer(self, lane: Lane, request: LaneRequest) -> None:
        close = False
        try:
            try:
                wire = render(await lane.answer(request))
            except Exception:
                log.exception("lane request failed")
                wire, close = render(_INTERNAL_ERROR, close=True), True
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(wire)
                if self._paused and not close:
                    # Flow control, as aiohttp's writer: the client is not reading its
                    # answers; the next request waits until they drain.
                    await self._drain_helper()
        except (ConnectionError, asyncio.CancelledError):
            close = True  # the client left, or the server stopped waiting
        finally:
            self._answering = False
            self._answering_task = None
            self._request_in_progress = False
            waiter = self._handler_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)  # a shutdown waiting for this answer goes on
            self._done(close)

    def _done(self, close: bool) -> None:
        if self.transport is None:
            return  # the client left
        if close:
            self.force_close()
            return
        # As aiohttp after an answer: the connection may now stay idle for keepalive_timeout.
        loop = self._loop
        self._next_keepalive_close_time = loop.time() + self._keepalive_timeout
        if self._keepalive_handle is None:
            self._keepalive_handle = loop.call_at(
                self._next_keepalive_close_time, self._process_keepalive
            )
        if self._lane_paused_reading:
            self._resume_lane_reading()
        if not (self._force_close or self._close):
            self._serve_held()

    def _pause_lane_reading(self) -> None:
        if self.transport is not None:
            self._lane_paused_reading = True
            self.transport.pause_reading()

    def _resume_lane_reading(self) -> None:
        self._lane_paused_reading = False
        if self.transport is not None:
            self.transport.resume_reading()

    def _process_keepalive(self) -> None:
        if self._answering:
            # Not idle: the lane is answering. Checked again once the answer is written.
            self._keepalive_handle = None
            return
        super()._process_keepalive()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """aiohttp's, which waits `timeout` for the answer in progress; a lane answer still
        running then is cancelled, as aiohttp cancels its handler."""
        await super().shutdown(timeout)
        task = self._answering_task
        if task is not None and not task.done():
            task.cancel()


class LaneServer(web.Server):
    """aiohttp's Server whose connections start in the lane."""

    def __init__(self, lanes: Mapping[bytes, Lane], plain: web.Server) -> None:
        super().__init__(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **plain._kwargs,
        )
        self.lanes = lanes
        self.lane_requests = 0  # requests the lane took

    def __call__(self) -> web.RequestHandler:
        return LaneConnection(self, loop=self._loop, **self._kwargs)


LANES = web.AppKey("lanes", Mapping[bytes, Lane])


class LaneAppRunner(web.AppRunner):
    """An AppRunner serving `app[LANES]` in the lane."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return LaneServer(self.app[LANES], plain)


def app_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The runner for `app`: one with the lane when the app has lanes."""
    if app.get(LANES):
        return LaneAppRunner(app, **kwargs)
    return web.AppRunner(app, **kwargs)
