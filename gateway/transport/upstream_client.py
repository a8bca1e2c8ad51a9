"""An HTTP/1.1 client for the one upstream: keep-alive connections to one origin, no more.

What it is for. The forward path sends every plain HTTP request to the same origin, with
headers the forwarder has already decided, and relays what comes back; the gateway holds one
`UpstreamClient` per upstream for them (forward.py, `Upstream.client`). A general client
library builds a request object, adds headers of its own, looks up a connector per host and
arms timers per read; none of that is needed here. The forwarder hands over its fields as the
bytes they will be (`RequestFields`); this client puts the request line, Host and the framing
around them, writes the head in one go and parses the answer with llhttp (httptools), on
asyncio Protocols.

WebSocket upgrades keep aiohttp's client (forward.py: `Upstream.websockets`, and its
`upgrades` session, which hands a refusal back as an answer to relay). After its 101 the
connection carries WebSocket frames, not HTTP messages: aiohttp checks the upstream's
handshake (Sec-WebSocket-Accept against the key sent, the subprotocol and extensions agreed:
RFC 6455 §4.1) and reads and writes the frames (masking, fragments, control frames, close
codes: §5). This client implements neither, and takes a 101 for a switch of protocols
unasked: a broken exchange.

Phases. A connection is in one `Phase` at a time, and `TRANSITIONS` lists, for each phase, the
events (`Event`) that may happen in it and the phase each leads to; nothing else changes a
phase (`next_phase`). An event its phase does not list is a bug in this module when this side
caused it (LifecycleError), and a broken exchange when the upstream's bytes did: llhttp's
callback raises, the parser stops, the connection is closed. The usual path is OPENING →
READY → AWAITING_ANSWER → READING_HEAD → READING_BODY (or READING_UNTIL_CLOSE) → COMPLETE →
DONE → IDLE, and from IDLE, READY again. An exchange released before its answer was whole, or
with something against reuse, leaves its connection MUST_CLOSE, then CLOSED; the end of the
connection leads to UNANSWERED (before any byte of the answer), BROKEN (the answer not whole)
or CLOSED (nothing awaited, or the answer whole). A few facts stay beside the phase, because
they hold in several phases instead of being one: whether anything forbids reuse
(`reusable`: single use, the upstream's Connection: close, a timeout, a body not all sent; it
decides which release event ends the exchange, as h11's keep_alive does), whether the request
was HEAD (it decides which head event the final head is), whether llhttp's parser must be
replaced (an answer without a body left it expecting one), and flow control both ways.
Sending is no phase either: a streamed body goes out in a task beside the exchange while the
answer is awaited and read, since an upstream may answer before it has read all of it.

Connection lifecycle. A connection is opened when an exchange finds no idle one (within
`connect_timeout`), carries one exchange at a time, and afterwards either goes back to the
idle list or is closed. At most `max_connections` are open at once, idle or busy: the
forwarder's `Slots` already let no more exchanges run than that, and each exchange holds at
most one connection. The idle list is last in, first out, so the connections in use stay
warm and the others are the ones the upstream times out. A connection the upstream closes
while idle is taken off the list at once (connection_lost) and any byte it sends while idle
closes it: an answer to no request is never taken for the next one's.

Reuse. A connection goes back to the idle list only from DONE, which only a COMPLETE answer
released with nothing against reuse leads to; that is, only when all of these hold: the
request was sent whole; the answer was read whole; the request was not single-use (a body on
a method other than POST, PUT or PATCH: sent with `Connection: close`, see forward.py); the
upstream did not say `Connection: close`, nor answer in HTTP/1.0 without keep-alive (llhttp's
should_keep_alive); no byte came after the answer. Anything else — an error, a timeout, a
cancellation, an answer given before the request body was all sent, a body left unread —
closes it.

Framing. This client alone frames what it sends: the fields it is given never carry
`Content-Length` or `Transfer-Encoding` (`RequestFields` holds no framing line; the body's
length is a value beside them). A bytes body is sent with `Content-Length` of its own
length, in the same write as the head; a streamed body of a known length (the client's
Content-Length, which the listener's parser held the client to) with that length, and the
bytes written are counted against it: more or fewer than announced break the exchange and
close the connection, so the upstream can never read a body boundary other than the one
sent; a streamed body of no known length with `Transfer-Encoding: chunked`; no body on a
method that may carry one gets `Content-Length: 0` (RFC 9110 §8.6). `Host` is the URL's host[:port]
unless the fields name one (preserve_host). The answer's body is framed by
`Content-Length`, chunked coding or the end of the connection (a clean end: after a reset
the body may be cut short, and the exchange is broken); an answer to HEAD and a 204 or 304
have none whatever their fields say (RFC 9112 §6.3), and 1xx interim answers are skipped.
llhttp runs strict: an answer with both `Content-Length` and `Transfer-Encoding`, two
`Content-Length` fields, a bad chunk size or a malformed field is a broken exchange
(`UpstreamBroken`), never read one way here and another way by someone else.

Flow control. The answer's body is kept in a buffer of at most about `buffer_size` bytes:
over it, the socket stops being read (pause_reading) until the relay has taken what is
there. A streamed request body is written chunk by chunk, each write waiting while the
socket's send buffer is full (pause_writing/resume_writing). Before each chunk the event loop
is let read what the upstream has sent (a poll of the socket, which does not wait): an
upstream that answers early and resets the connection, a 413 say, has its answer in the
socket's buffer, and a write that met the reset first would close the connection with that
answer unread.

Timeouts. Connecting: `connect_timeout`. Reading: every wait for bytes of the answer (its
head, then each piece of its body) ends with TimeoutError after `read_timeout` without one.
One timer per connection serves all its waits: it is armed when a wait begins and none is
armed, and when it fires early for a later wait it re-arms itself for that wait's deadline.

Errors. `UpstreamRefused` when no connection could be opened (or the upstream closed it
before a request could go); `UpstreamBroken` when the connection failed or the answer could
not be read. An idempotent request (RFC 9110 §9.2.2: GET, HEAD, OPTIONS, TRACE, PUT, DELETE)
without a body, sent on an idle connection that the upstream closed just then (UNANSWERED:
the end of the connection before any byte of the answer; it timed the connection out as the
request went), is sent once more on a new connection, as nginx and HAProxy do: sending it
twice means what sending it once does, and it has no body that would have to be kept for a
second try. Any other failure is the caller's to report.

Cancellation. A cancelled exchange (the client gone, shutdown) closes its connection: it is
never put back half used. `close()` closes every connection, idle or busy; an exchange still
waiting on one fails at once (UpstreamBroken) instead of at its read timeout.
"""

from __future__ import annotations

import asyncio
import enum
import select
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

import httptools
from multidict import CIMultiDict, MultiMapping


class UpstreamRefused(Exception):
    """No connection could be opened to the upstream."""


class UpstreamBroken(Exception):
    """The connection failed, or the answer could not be read as HTTP/1.1."""


@dataclass(frozen=True)
class Origin:
    """Where the upstream is (host and port), and how TLS is spoken to it (None: not)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    server_hostname: str | None = None  # SNI and the name checked; None: `host`
    host_header: str = ""  # the Host field sent unless the request has one; "": host[:port]


def field_lines(lines: Sequence[str]) -> bytes:
    """`Name: value` lines (without their line ends) as they go on the wire, each ended by
    CRLF. ValueError when any holds CR, LF or NUL: a name or value that could end its line
    could add a field of its own, or end the head (RFC 9112 §2.2, §5)."""
    if not lines:
        return b""
    # Searched joined: one fast scan per character for all the lines at once.
    probe = "".join(lines)
    if "\r" in probe or "\n" in probe or "\0" in probe:
        raise ValueError("a request line or header field holds CR, LF or NUL")
    return ("\r\n".join(lines) + "\r\n").encode("utf-8", "surrogateescape")


# Fields that frame a message (RFC 9112 §6): the client that writes the body writes them.
_FRAMING = frozenset({"content-length", "transfer-encoding"})


class RequestFields:
    """A request's header fields as the bytes that go on the wire, Host and framing apart.

    `wire` holds whole `Name: value` CRLF lines, in order, in pieces of any size. No name
    or value in them may hold CR, LF or NUL: `from_headers` and `add` check it (see
    `field_lines`), and whoever appends to `wire` directly answers for it; none of them is
    `Content-Length` or `Transfer-Encoding` (`add` refuses them, `from_headers` takes them
    out): the body is framed by `UpstreamClient`, from what it sends. `host` is the Host
    field's value (None: the origin's); `body_length` is the length of a streamed body when
    it is known (None: sent chunked). Text is encoded as UTF-8 with surrogates escaped, so
    that a value decoded the same way from a client's bytes goes out as those bytes.
    """

    __slots__ = ("body_length", "host", "wire")

    def __init__(
        self, wire: list[bytes], host: str | None = None, body_length: int | None = None
    ) -> None:
        self.wire = wire
        self.host = host
        self.body_length = body_length

    @classmethod
    def from_headers(cls, headers: MultiMapping[str]) -> RequestFields:
        """The fields of a multidict, in its order; its first Host, if any, is the Host, and
        its Content-Length the length of a streamed body."""
        host = headers.getall("Host", None)
        lines = [
            f"{name}: {value}"
            for name, value in headers.items()
            if name.lower() != "host" and name.lower() not in _FRAMING
        ]
        length = headers.get("Content-Length")
        return cls(
            [field_lines(lines)],
            host[0] if host else None,
            int(length) if length is not None and length.isdigit() else None,
        )

    def add(self, name: str, value: str) -> None:
        """One more field, last (checked as `field_lines` checks; never a framing field)."""
        if name.lower() in _FRAMING:
            raise ValueError(f"{name} is written by the upstream client alone")
        self.wire.append(field_lines((f"{name}: {value}",)))

    def as_headers(self) -> CIMultiDict[str]:
        """The same fields as a multidict, Host first, for a client library that takes one."""
        headers: CIMultiDict[str] = CIMultiDict()
        if self.host is not None:
            headers.add("Host", self.host)
        text = b"".join(self.wire).decode("utf-8", "surrogateescape")
        for line in text.split("\r\n")[:-1]:
            name, _, value = line.partition(": ")
            headers.add(name, value)
        return headers


# RFC 9110 §8.6: methods a body is expected on, or may be; the others get no Content-Length
# when they have none (the same set aiohttp leaves alone).
_NO_LENGTH_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# RFC 9110 §9.2.2: the methods a client may send again without asking whether the first
# attempt took effect.
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
_FINAL = 200
_NO_BODY_STATUS = frozenset({204, 304})
_SMALL_BODY = 16 * 1024  # a body up to this size goes in the head's write


# ---------------------------------------------------------------------- phases and their table


class Phase(enum.Enum):
    """Where a connection is, in its own life and in the exchange it carries."""

    # Members are compared by identity: hashed by it too (Enum's own hash of the name runs
    # in Python, at every look-up in the table and in the sets below).
    __hash__ = object.__hash__

    OPENING = enum.auto()  # being connected: no transport yet
    READY = enum.auto()  # open, carrying nothing, not on the idle list (just opened or taken)
    IDLE = enum.auto()  # on the client's idle list
    AWAITING_ANSWER = enum.auto()  # the request is going or gone; no byte of the answer yet
    READING_HEAD = enum.auto()  # bytes of the answer came; its final head is not whole
    READING_BODY = enum.auto()  # the final head read; a body framed by length or chunks follows
    READING_UNTIL_CLOSE = enum.auto()  # the final head read; its body ends with the connection
    COMPLETE = enum.auto()  # the answer read whole (the caller may not have taken all of it)
    DONE = enum.auto()  # released, and the connection may carry another exchange
    MUST_CLOSE = enum.auto()  # released, and it may not
    UNANSWERED = enum.auto()  # closed before any byte of the answer (`_failure` says how)
    BROKEN = enum.auto()  # closed with the answer not whole (`_failure` says why)
    CLOSED = enum.auto()  # closed; an answer being read when it closed is whole


# What happens to a connection, as the table names it. Strings rather than an Enum's
# members: one is named at every event, and a string constant costs nothing to name, where
# an Enum member is looked up through its class each time. mypy holds each to this list.
Event = Literal[
    # This side.
    "connected",  # the transport is up
    "taken",  # taken off the idle list
    "request",  # an exchange starts: its request goes out
    "released",  # the exchange is over, and nothing is against reuse (`finish`)
    "released_closing",  # the exchange is over, and something is
    "pooled",  # put on the idle list
    "aborted",  # closed by this side: a failure, a timeout, cancellation, shutdown
    # The upstream: bytes, as llhttp reads them, and the end of the connection.
    "bytes",  # bytes arrived
    "message_begin",  # a message starts
    "interim_head",  # the head of a 1xx answer: skipped, the final one follows
    "head",  # the final head; a body framed by Content-Length or chunked follows
    "head_until_close",  # the final head; its body ends with the connection
    "head_no_body",  # the final head of an answer to HEAD, or a 204 or 304
    "body",  # bytes of the body
    "message_end",  # the message ended where its framing said
    "ended",  # the upstream closed the connection cleanly
    "reset",  # the connection failed: a reset, or any other error
]
EVENTS: tuple[Event, ...] = get_args(Event)


class LifecycleError(RuntimeError):
    """An event the connection's phase does not allow: a bug in this module, or, inside
    llhttp's callbacks, an upstream's bytes where no answer may have them."""


def _ending_in(phase: Phase) -> dict[Event, Phase]:
    return {"ended": phase, "reset": phase, "aborted": phase}


class _Moves(dict[Event, Phase]):
    """One phase's rules. An event it does not list raises LifecycleError, so the hot path
    looks a move up inline (`TRANSITIONS[phase][event]`), with no call to `next_phase`."""

    __slots__ = ("phase",)

    def __init__(self, phase: Phase, moves: Mapping[Event, Phase]) -> None:
        super().__init__(moves)
        self.phase = phase

    def __missing__(self, event: Event) -> Phase:
        raise LifecycleError(f"{event!r} in {self.phase.name}")


# Every rule that moves a connection from one phase to another. What is not here may not
# happen: looking it up raises LifecycleError. "bytes" is missing wherever no answer is
# awaited (idle, ready, after the answer): `data_received` closes the connection then (RFC
# 9112 §9.3.2: nothing may follow the answer to the last request sent). "ended" and "reset"
# are missing in DONE and MUST_CLOSE, which last no longer than the synchronous `_release`,
# and in OPENING: the loop reports the end only of a connection it has reported made.
_RULES: Mapping[Phase, Mapping[Event, Phase]] = {
    Phase.OPENING: {
        "connected": Phase.READY,
        # No transport to close yet: the client is closed by then, and `_connect` closes the
        # connection once it is made.
        "aborted": Phase.OPENING,
    },
    # Between the end of connecting and the request, the upstream may already close it.
    Phase.READY: {"request": Phase.AWAITING_ANSWER, **_ending_in(Phase.CLOSED)},
    Phase.IDLE: {"taken": Phase.READY, **_ending_in(Phase.CLOSED)},
    Phase.AWAITING_ANSWER: {
        "bytes": Phase.READING_HEAD,
        # What an idle timeout meeting the request looks like (see `UpstreamClient.send`).
        **_ending_in(Phase.UNANSWERED),
    },
    Phase.READING_HEAD: {
        "bytes": Phase.READING_HEAD,
        "message_begin": Phase.READING_HEAD,
        "interim_head": Phase.READING_HEAD,
        # An interim answer ended: a final head has left this phase before its message ends.
        "message_end": Phase.READING_HEAD,
        "head": Phase.READING_BODY,
        "head_until_close": Phase.READING_UNTIL_CLOSE,
        "head_no_body": Phase.COMPLETE,
        **_ending_in(Phase.BROKEN),
    },
    Phase.READING_BODY: {
        "bytes": Phase.READING_BODY,
        "body": Phase.READING_BODY,
        "message_end": Phase.COMPLETE,
        **_ending_in(Phase.BROKEN),
        # Released with its body unread: what comes next on the connection is the rest of it.
        "released": Phase.MUST_CLOSE,
        "released_closing": Phase.MUST_CLOSE,
    },
    Phase.READING_UNTIL_CLOSE: {
        "bytes": Phase.READING_UNTIL_CLOSE,
        "body": Phase.READING_UNTIL_CLOSE,
        "ended": Phase.CLOSED,  # RFC 9112 §6.3 (8): the body ends with the connection
        "reset": Phase.BROKEN,  # a reset is no end: the body may be cut short
        "aborted": Phase.BROKEN,
        "released": Phase.MUST_CLOSE,
        "released_closing": Phase.MUST_CLOSE,
    },
    Phase.COMPLETE: {
        # llhttp ending an answer that ended at its head here (a 204, a 304).
        "message_end": Phase.COMPLETE,
        **_ending_in(Phase.CLOSED),  # the answer stands
        "released": Phase.DONE,
        "released_closing": Phase.MUST_CLOSE,
    },
    # Aborted when the client was closed meanwhile.
    Phase.DONE: {"pooled": Phase.IDLE, "aborted": Phase.CLOSED},
    Phase.MUST_CLOSE: {"aborted": Phase.CLOSED},
    # Closed: the loop still reports the end of a connection this side aborted, and a failed
    # exchange is released like any other.
    Phase.UNANSWERED: {
        **_ending_in(Phase.UNANSWERED),
        "released": Phase.CLOSED,
        "released_closing": Phase.CLOSED,
    },
    Phase.BROKEN: {
        **_ending_in(Phase.BROKEN),
        "released": Phase.CLOSED,
        "released_closing": Phase.CLOSED,
    },
    Phase.CLOSED: {
        **_ending_in(Phase.CLOSED),
        "released": Phase.CLOSED,
        "released_closing": Phase.CLOSED,
    },
}
TRANSITIONS: Mapping[Phase, Mapping[Event, Phase]] = {
    phase: _Moves(phase, moves) for phase, moves in _RULES.items()
}


def next_phase(phase: Phase, event: Event) -> Phase:
    """The phase `event` leads to from `phase` (LifecycleError: it may not happen there)."""
    return TRANSITIONS[phase][event]


# What the code asks of a phase (these sets say what the phases are; they move nothing).
# An exchange waits for bytes of its answer:
_UNDER_WAY = frozenset(
    {Phase.AWAITING_ANSWER, Phase.READING_HEAD, Phase.READING_BODY, Phase.READING_UNTIL_CLOSE}
)
# The transport is open:
_OPEN = _UNDER_WAY | {Phase.READY, Phase.IDLE, Phase.COMPLETE, Phase.DONE, Phase.MUST_CLOSE}
_FAILED = frozenset({Phase.UNANSWERED, Phase.BROKEN})  # `_failure` says why
_CLOSED = _FAILED | {Phase.CLOSED}
# In an exchange, its answer's final head was read (CLOSED: the answer ended whole):
_HEAD_READ = frozenset(
    {Phase.READING_BODY, Phase.READING_UNTIL_CLOSE, Phase.COMPLETE, Phase.CLOSED}
)
# In an exchange, its answer was read to its end:
_ANSWER_WHOLE = frozenset({Phase.COMPLETE, Phase.CLOSED})


class Answer:
    """The upstream's answer: status, reason and headers read, the body still to read.

    `release()` must be called once the caller is done with it (in a `finally`): it puts
    the connection back when everything allows it, else closes it."""

    __slots__ = (
        "_client",
        "_connection",
        "_released",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, client: UpstreamClient, connection: _Connection) -> None:
        self._client = client
        self._connection = connection
        self._released = False
        self.status = connection.status
        self.reason = connection.reason
        self.headers = connection.headers
        self.content_length = connection.content_length

    async def readany(self) -> bytes:
        """What has arrived of the body; b"" at its end."""
        return await self._connection.read_body()

    async def read(self) -> bytes:
        """The whole body."""
        connection = self._connection
        parts = []
        while chunk := await connection.read_body():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def keep_out_of_pool(self) -> None:
        """Close the connection at release, whatever else holds."""
        self._connection.reusable = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._client._release(self._connection)


class _Connection(asyncio.Protocol):
    """One connection to the upstream and the exchange it is carrying."""

    def __init__(self, client: UpstreamClient) -> None:
        self._client = client
        self._loop = client._loop
        self._read_timeout = client._read_timeout
        self._high_water = client._high_water
        self.transport: asyncio.Transport | None = None
        self._poll: select.poll | None = None  # whether answer bytes wait (`_let_answer_in`)
        self._phase = Phase.OPENING
        self._failure: UpstreamBroken | None = None  # why, in UNANSWERED and BROKEN
        # Facts beside the phase, each true in several phases (see the module's docstring).
        # Cleared by anything that forbids reuse, never set again: chooses the release event.
        self.reusable = True
        # The request was HEAD: its answer has no body (chooses the head event).
        self._head_only = False
        # llhttp's parser still expects a body the last answer did not have: the next
        # exchange needs a new one.
        self._fresh_parser = False
        # Flow control: the socket is not read until the caller takes the body; the body's
        # writer waits until the socket takes more.
        self._reading_paused = False
        self._writing_paused = False
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._wait_started = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._drain: asyncio.Future[None] | None = None
        self.writer: asyncio.Task[None] | None = None
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None

    @property
    def phase(self) -> Phase:
        return self._phase

    # ------------------------------------------------------------------ the transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._phase = TRANSITIONS[self._phase]["connected"]
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(
            "ended" if exc is None else "reset",
            "connection closed before any answer"
            if self._phase is Phase.AWAITING_ANSWER
            else "connection closed before the answer was complete",
        )

    def data_received(self, data: bytes) -> None:
        phase = TRANSITIONS[self._phase].get("bytes")
        if phase is None:
            # While idle, or after the answer: no answer to any request we will send.
            self.abort()
            return
        self._phase = phase
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.abort("the upstream switched protocols unasked")
        except httptools.HttpParserError as exc:
            # Malformed, or an event the phase does not allow (a callback raised
            # LifecycleError). After a whole answer, the answer stands: what followed is no
            # part of it, and the connection cannot be trusted again (RFC 9112 §9.3.2).
            self.abort(f"unreadable answer: {exc}")
        self._wake()

    def eof_received(self) -> bool:
        return False  # close; connection_lost decides what the end means

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        drain = self._drain
        if drain is not None:
            self._drain = None
            if not drain.done():
                drain.set_result(None)

    # ------------------------------------------------------------------ llhttp callbacks
    # An event the phase does not allow raises here; llhttp stops, and `data_received` closes
    # the connection (a second message after the answer, body bytes where it has none).

    def on_message_begin(self) -> None:
        self._phase = TRANSITIONS[self._phase]["message_begin"]

    def on_status(self, status: bytes) -> None:
        self.reason = status.decode("utf-8", "surrogateescape")

    def on_header(self, name: bytes, value: bytes) -> None:
        # As the server side decodes a client's fields, so that the bytes go on unchanged.
        self.headers.add(
            name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if status < _FINAL:
            self._phase = TRANSITIONS[self._phase]["interim_head"]
            self.headers = CIMultiDict()  # 1xx: skipped, the final answer follows
            return
        headers = self.headers
        if self._head_only or status in _NO_BODY_STATUS:
            # RFC 9112 §6.3 (1): no body, whatever the fields say. llhttp does not know the
            # request was HEAD, so its state is dropped with its parser, and so is its view
            # of keep-alive (it may expect a body until the end of the connection).
            self._phase = TRANSITIONS[self._phase]["head_no_body"]
            self.status = status
            self.content_length = None
            self._fresh_parser = True
            if not _keeps_alive(parser.get_http_version(), headers):
                self.reusable = False
            return
        event: Event
        length = headers.get("Content-Length")
        if length is not None:
            event = "head"
            self.content_length = int(length)  # llhttp has checked the digits
        else:
            # RFC 9112 §6.3 (4, 8): chunked when it is the last coding, else until the end.
            codings = ",".join(headers.getall("Transfer-Encoding", ())).rstrip().lower()
            event = "head" if codings.endswith("chunked") else "head_until_close"
        self._phase = TRANSITIONS[self._phase][event]
        self.status = status
        if not parser.should_keep_alive():
            self.reusable = False

    def on_body(self, body: bytes) -> None:
        self._phase = TRANSITIONS[self._phase]["body"]
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > self._high_water and not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        phase = self._phase
        self._phase = TRANSITIONS[phase]["message_end"]
        if phase is Phase.READING_BODY and not self._parser.should_keep_alive():
            self.reusable = False

    # ------------------------------------------------------------------ the exchange

    def begin(self, head_only: bool) -> None:
        self._phase = TRANSITIONS[self._phase]["request"]
        if self._fresh_parser:
            self._parser = httptools.HttpResponseParser(self)
            self._fresh_parser = False
        self._head_only = head_only
        self.status = 0
        self.reason = ""
        self.headers = CIMultiDict()
        self.content_length = None

    def finish(self) -> bool:
        """The exchange is over; whether the connection may carry another (DONE)."""
        writer = self.writer
        if writer is not None:
            self.writer = None
            if not writer.done():
                writer.cancel()
                self.reusable = False
            elif writer.cancelled() or writer.exception() is not None:
                self.reusable = False
        # Whether the answer was read whole is the phase's to say (the table).
        released = self.reusable and not self._body and not self._reading_paused
        phase = TRANSITIONS[self._phase]["released" if released else "released_closing"]
        self._phase = phase
        return phase is Phase.DONE

    def pool(self) -> None:
        self._phase = TRANSITIONS[self._phase]["pooled"]

    def take(self) -> None:
        self._phase = TRANSITIONS[self._phase]["taken"]

    async def send_body(self, chunks: AsyncIterator[bytes], length: int | None) -> None:
        """Write a streamed body, each chunk once the socket can take it: chunked when its
        `length` is not known, else as it is, and exactly `length` bytes of it."""
        transport = self.transport
        assert transport is not None
        sent = 0
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                await self._let_answer_in()
                if self._phase not in _UNDER_WAY:
                    self.reusable = False  # answered already, or gone: the rest is not sent
                    return
                if length is None:
                    transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                else:
                    sent += len(chunk)
                    if sent > length:
                        # The rest would be read upstream as the start of another request.
                        raise UpstreamBroken("the body is longer than its Content-Length")
                    transport.write(chunk)
                if self._writing_paused and self._phase not in _CLOSED:
                    await self._drained()
            if self._phase in _CLOSED:
                return
            if length is None:
                transport.write(b"0\r\n\r\n")
            elif sent != length:
                raise UpstreamBroken("the body is shorter than its Content-Length")
        except BaseException as exc:
            # The body cannot be finished: the upstream must not take what it got for a
            # whole request, and whoever waits for the answer learns why it will not come.
            self.reusable = False
            if isinstance(exc, asyncio.CancelledError):
                self.abort()
            else:
                self.abort("the request body could not be sent")
            raise

    async def _let_answer_in(self) -> None:
        """Let the event loop read what the upstream has sent before writing more.

        An upstream that answers early and closes with the body unread resets the
        connection; a write that meets the reset closes the transport before its answer,
        already in the socket's buffer, is read. While bytes wait, the loop is given a turn.
        """
        poll = self._poll
        if poll is None:
            return
        # A turn of the loop is what is waited for: no event stands for it. Not while reading
        # is paused: the bytes would stay where they are.
        while poll.poll(0) and self._phase in _UNDER_WAY and not self._reading_paused:  # noqa: ASYNC110
            await asyncio.sleep(0)

    async def _drained(self) -> None:
        drain = self._drain = self._loop.create_future()
        await drain

    async def head(self) -> None:
        """Wait for the answer's head (a failure or a timeout raises)."""
        while self._phase not in _HEAD_READ:
            await self._wait()

    async def read_body(self) -> bytes:
        body = self._body
        while not body:
            if self._phase in _ANSWER_WHOLE:
                return b""
            await self._wait()
        if len(body) == 1:
            chunk = body.popleft()
        else:
            chunk = b"".join(body)
            body.clear()
        self._buffered = 0
        if self._reading_paused and self._phase not in _CLOSED:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return chunk

    async def _wait(self) -> None:
        phase = self._phase
        if phase not in _UNDER_WAY:
            # A failed exchange raises why; any other phase awaits no bytes.
            raise self._failure or LifecycleError(f"an answer awaited in {phase.name}")
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        self._wait_started = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._wait_started + self._read_timeout, self._check_timer)
        try:
            await waiter
        finally:
            self._waiter = None
        failure = self._failure
        if failure is not None:
            raise failure

    def _check_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        deadline = self._wait_started + self._read_timeout
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_timer)
            return
        self.reusable = False
        waiter.set_exception(TimeoutError())

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self, reason: str = "the connection was closed") -> None:
        """Close the connection now; an exchange still waiting on it fails (`reason`)."""
        self._end("aborted", reason)

    def _end(self, event: Event, reason: str) -> None:
        """The end of the connection ("ended", "reset": the upstream's; "aborted": this side's).
        An exchange it leaves failed (UNANSWERED, BROKEN) fails with `reason`."""
        phase = self._phase
        ended = self._phase = TRANSITIONS[phase][event]
        if phase in _OPEN:  # else: not open yet, or closed already (and reported since)
            if ended in _FAILED:
                self._failure = UpstreamBroken(reason)
            self._client._forget(self, phase is Phase.IDLE)
            self._stop_timer()
            if event == "aborted":
                assert self.transport is not None
                self.transport.abort()
        self._wake()
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(UpstreamBroken("connection closed while sending"))
            drain.exception()  # retrieved: the writer may be gone already

    def _stop_timer(self) -> None:
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()


class UpstreamClient:
    """Keep-alive connections to one origin, at most `max_connections` open."""

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        buffer_size: int,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._origin = origin
        self._max = max_connections
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._high_water = buffer_size
        host = origin.host_header or _host_port(origin)
        self._host = host
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def request(
        self,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterator[bytes] | None,
        *,
        single_use: bool = False,
    ) -> Answer:
        """`send` with the fields of a multidict (see `RequestFields.from_headers`)."""
        fields = RequestFields.from_headers(headers)
        return await self.send(method, target, fields, body, single_use=single_use)

    async def send(
        self,
        method: str,
        target: str,
        fields: RequestFields,
        body: bytes | AsyncIterator[bytes] | None,
        *,
        single_use: bool = False,
    ) -> Answer:
        """Send a request and read the answer's head. `target` is the request-target as it
        goes on the wire; `fields` are sent as they are, after the Host field and before
        the body's framing. The caller releases the answer."""
        head, length = self._head(method, target, fields, body)
        head_only = method == "HEAD"
        # A request that may be sent again if its pooled connection turns out to be closed.
        retry = body is None and method in _IDEMPOTENT
        while True:
            connection, pooled = await self._take()
            try:
                connection.begin(head_only)
                if single_use:
                    connection.reusable = False
                self._write(connection, head, body, length)
                await connection.head()
            except BaseException as exc:
                connection.abort()
                again = (
                    retry
                    and pooled
                    and isinstance(exc, UpstreamBroken)
                    and connection.phase is Phase.UNANSWERED
                )
                connection.finish()
                if again:
                    retry = False
                    continue
                raise
            return Answer(self, connection)

    def _write(
        self,
        connection: _Connection,
        head: bytes,
        body: bytes | AsyncIterator[bytes] | None,
        length: int | None,
    ) -> None:
        transport = connection.transport
        assert transport is not None
        if body is None:
            transport.write(head)
        elif isinstance(body, bytes):
            if len(body) <= _SMALL_BODY:
                transport.write(head + body)
            else:
                transport.writelines((head, body))
        else:
            transport.write(head)
            connection.writer = self._loop.create_task(connection.send_body(body, length))

    def _head(
        self,
        method: str,
        target: str,
        fields: RequestFields,
        body: bytes | AsyncIterator[bytes] | None,
    ) -> tuple[bytes, int | None]:
        """The request head as bytes, framing the body this client sends (RFC 9112 §6.2,
        §6.3), and the length a streamed body is held to (None: it goes chunked)."""
        host = self._host if fields.host is None else fields.host
        start = field_lines((f"{method} {target} HTTP/1.1", f"Host: {host}"))
        length = None
        if body is None:
            framing = b"" if method in _NO_LENGTH_METHODS else b"Content-Length: 0\r\n"
        elif isinstance(body, bytes):
            framing = b"Content-Length: %d\r\n" % len(body)
        elif fields.body_length is not None:
            length = fields.body_length
            framing = b"Content-Length: %d\r\n" % length
        else:
            framing = b"Transfer-Encoding: chunked\r\n"
        return b"".join((start, *fields.wire, framing, b"\r\n")), length

    async def _take(self) -> tuple[_Connection, bool]:
        """An idle connection (True) or a new one (False)."""
        if self._closed:
            raise UpstreamRefused("the client is closed")
        idle = self._idle
        if idle:
            connection = idle.pop()
            connection.take()
            return connection, True
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        if len(self._open) >= self._max:
            # The forwarder's Slots keep exchanges within the limit; this would be a bug.
            raise UpstreamRefused("connection limit reached")
        origin = self._origin
        connection = _Connection(self)
        self._open.add(connection)
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._loop.create_connection(
                    lambda: connection,
                    origin.host,
                    origin.port,
                    ssl=origin.tls,
                    server_hostname=(origin.server_hostname or origin.host)
                    if origin.tls is not None
                    else None,
                )
        except TimeoutError:
            self._open.discard(connection)
            raise
        except (OSError, ssl.SSLError) as exc:
            self._open.discard(connection)
            raise UpstreamRefused(str(exc) or type(exc).__name__) from exc
        except BaseException:
            self._open.discard(connection)
            raise
        if self._closed:
            connection.abort()
            raise UpstreamRefused("the client is closed")
        if connection.phase is not Phase.READY:
            # Closed before a request could go: by the upstream, or for bytes it sent unasked.
            raise UpstreamRefused("the connection was closed as soon as it was opened")
        return connection

    def _release(self, connection: _Connection) -> None:
        if connection.finish() and not self._closed:
            connection.pool()
            self._idle.append(connection)
        else:
            connection.abort()

    def _forget(self, connection: _Connection, idle: bool) -> None:
        """`connection` is closed (`idle`: it was on the idle list)."""
        self._open.discard(connection)
        if idle:
            self._idle.remove(connection)  # closed while idle: rare, and the list is short

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
        idle = self._idle
        while idle:
            idle.pop().take()  # off the list; closed below with the others
        for connection in list(self._open):
            connection.abort()
        await asyncio.sleep(0)  # let the transports finish closing


def _keeps_alive(version: str, headers: CIMultiDict[str]) -> bool:
    """RFC 9112 §9.3: whether the connection stays open after an answer, by its version and
    its Connection field."""
    tokens = {
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
    }
    if "close" in tokens:
        return False
    return version != "1.0" or "keep-alive" in tokens


def _host_port(origin: Origin) -> str:
    host = f"[{origin.host}]" if ":" in origin.host else origin.host
    default = 443 if origin.tls is not None else 80
    return host if origin.port == default else f"{host}:{origin.port}"
