"""Forwarding an authorised request to the upstream and its answer back to the client.

- Method, path and query go upstream byte for byte.
- Hop-by-hop headers (RFC 9110 §7.6.1), and any header named in `Connection`, are dropped
  both ways.
- Identity headers are ALWAYS removed from the client's request first, on public routes
  too; then they are set from the verified principal only (and from the verified TLS client
  certificate, when identity headers for it are configured). Every header the gateway sets or
  drops is also dropped in the spellings with `_` for `-` that CGI-style servers fold into
  the same name. Method-override headers are dropped unless `strip_method_override: false`.
- `X-Forwarded-For` and `Forwarded` (RFC 7239) are appended to, `X-Forwarded-Proto/Host`
  are set from what this gateway saw, `Via` is added (RFC 9110 §7.6.3), and a request id is
  kept when well-formed or generated.
- Bodies stream both ways in constant memory. The first `forward.buffer_size` bytes of a
  request body (all of a small one) arrive before an upstream connection is taken, so a
  client sending slowly holds none meanwhile; a whole body must arrive within
  `limits.body_total_timeout`, each pause within `limits.body_timeout` (408); bodies arriving
  at once from one client address are capped (429).
- At most `upstream.max_connections` exchanges use the upstream at once; a request that
  finds none free for `upstream.pool_timeout` gets 503.
- An upstream connection is not reused after a request whose body the upstream may not have
  read as one: a body on a method other than POST, PUT or PATCH (sent with
  `Connection: close`), or an answer that came before the body was all sent.
- A W3C `traceparent` is sent upstream: the client's, continued, or a new one.
- The upstream's answer comes back as it was given: status, reason, end-to-end headers and
  body. `Content-Type` and `Server`, which aiohttp adds to an answer without them, are
  taken back out of an answer whose upstream did not send them (`LEFT_OUT`).
- Requests go over the gateway's own keep-alive HTTP/1.1 client (upstream_client.py), which
  reads answers strictly: one that could be read more than one way (Content-Length with
  Transfer-Encoding, two lengths, a bad chunk size, a malformed field) is a broken answer,
  and its connection is closed. An idempotent request without a body that meets a pooled
  connection the upstream closed as it went is sent once more, on a new connection.
- Upstream refused or broken → 502; not connected within `upstream.connect_timeout`, or
  silent for `upstream.read_timeout` → 504.
- WebSocket upgrades (on routes that allow them) are made to the upstream by the gateway,
  then the client's upgrade is accepted with the subprotocol the upstream chose, and
  messages flow both ways until either side closes; the other side is closed with the same
  code. An upstream that answers the upgrade with anything but 101 has that answer relayed
  to the client as it was given. With `close_on_token_expiry` the session is closed (1008,
  policy violation) when the token that opened it expires.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.client_middlewares import ClientHandlerType
from aiohttp.http import HttpProcessingError
from multidict import CIMultiDict, MultiMapping
from yarl import URL

from portcullis.addresses import ClientAddresses

from .core.clock import Now
from .core.exchange import Exchange
from .core.principal import Derived, Principal
from .core.records import Forwarding, WebSocket
from .steps import errors
from .transport import clientcert, tracecontext
from .transport.capacity import BodiesInFlight, Slots
from .transport.upstream_client import (
    RequestFields,
    UpstreamBroken,
    UpstreamClient,
    UpstreamRefused,
    field_lines,
)

log = logging.getLogger("portcullis.gateway.forward")

# RFC 9110 §7.6.1 plus the de-facto Keep-Alive / Proxy-Connection. `Expect` is answered by
# this gateway itself; `Host` is set for the upstream; `Content-Length` (like
# `Transfer-Encoding`) frames the message on one connection only: the upstream client frames
# the body it sends itself (upstream_client.RequestFields).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_DROP = HOP_BY_HOP | {"host", "expect", "content-length"}
# Headers some frameworks take as the method to run instead of the request's own.
_METHOD_OVERRIDE = frozenset({"x-http-method-override", "x-method-override", "x-http-method"})
# RFC 9110 §9.3: content has defined semantics on POST and PUT, and PATCH (RFC 5789); on any
# other method an upstream may not read a body at all, and take its bytes for the next
# request on the connection.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# What a Host header may hold (RFC 9110 §7.2: uri-host [":" port]), narrowed to the names and
# addresses in real use, so it can be written into Forwarded without breaking its syntax.
_HOST = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_NO_BODY_STATUS = frozenset({204, 304})
# What reading a client's body raises when the client broke it off: the connection lost or
# reset, a body shorter than announced, chunked coding or a length the parser refused.
# Anything else is a fault of the gateway's own, not a client gone, and is not hidden as one.
_BODY_BROKEN = (
    asyncio.IncompleteReadError,
    ConnectionError,
    aiohttp.ClientPayloadError,
    HttpProcessingError,
)
# Fields aiohttp puts on an answer's head when the answer has none. An upstream may leave
# them out: Content-Type when it does not know the media type (RFC 9110 §8.3), Server when
# it keeps its software to itself (§10.2.5). A relayed answer names the ones its upstream
# left out, and whoever writes the head takes them back out (app.settle_head).
LEFT_OUT: web.ResponseKey[tuple[str, ...]] = web.ResponseKey("left_out", tuple)
_LEFT_OUT_BY_PRESENCE: dict[tuple[bool, bool], tuple[str, ...]] = {
    (True, True): (),
    (True, False): ("Server",),
    (False, True): ("Content-Type",),
    (False, False): ("Content-Type", "Server"),
}
_NONE: frozenset[str] = frozenset()
# The client's credentials, which never go to an MCP server (the MCP authorization spec:
# a server that passed on the token it was given would be a confused deputy).
_CREDENTIALS = frozenset({"authorization", "dpop"})
_NO_NAMES: frozenset[bytes] = frozenset()
# The handshake headers of the client's upgrade: the gateway makes its own upstream.
_WEBSOCKET_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
    }
)
_EXPIRED_CLOSE = 1008  # RFC 6455 §7.4.1: policy violation
_WS_GOING_AWAY = 1001
_WS_INTERNAL_ERROR = 1011
_MEMO_LIMIT = 1024  # distinct header names or hosts remembered; clients choose them
# Principals whose identity headers are remembered at most, the most recently verified ones
# (fewer when fewer are alive: principal.Derived).
_IDENTITIES_REMEMBERED = 16_384
_SHARED_IDENTITY_BYTES = 1024  # the longest client id, scopes and issuer lines remembered
# A string an upstream cannot misread when it goes as it is: visible ASCII, inner spaces only
# (servers strip them at either end: RFC 9110 §5.5), not starting with `"` (the JSON form).
_BARE_STRING = re.compile(r"[\x21\x23-\x7E](?:[\x20-\x7E]*[\x21-\x7E])?")
# Strings a JSON reader would take for another kind of value: RFC 8259 §3 literals and §6
# numbers, and the NaN/Infinity that lenient readers (Python's json) accept.
_JSON_SCALAR = re.compile(
    r"true|false|null|NaN|-?Infinity|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
)


def header_value(value: Any) -> str:
    """A claim (any JSON value) as a header value that can be neither injected into nor misread.

    The value's compact JSON (RFC 8259) with everything but visible ASCII escaped, except a
    string no JSON reader could take for JSON — visible ASCII, no space at either end, not a
    number, `true`, `false` or `null`, not starting with `"`, `[` or `{` — which goes as it
    is. So the upstream reads every value back exactly: JSON when the header parses as JSON,
    else the text itself; `5` and `"5"`, `true` and `"true"`, `é` and `"\\u00e9"` stay apart.
    """
    if (
        isinstance(value, str)
        and _BARE_STRING.fullmatch(value)
        and value[0] not in "[{"
        and not _JSON_SCALAR.fullmatch(value)
    ):
        return value
    return _json_header_value(value)


def string_header_value(text: str) -> str:
    """A value that is always a string (subject, client id, issuer, scope) as a header value.

    As it is when visible ASCII with no space at either end and no leading `"`, else a JSON
    string: the upstream reads it back exactly (a JSON string when it starts with `"`, else
    the text itself), and a numeric subject stays `248289761001`.
    """
    if _BARE_STRING.fullmatch(text):
        return text
    return _json_header_value(text)


def _json_header_value(value: Any) -> str:
    # ensure_ascii escapes control characters and non-ASCII, so CR/LF and non-Latin-1 text
    # never reach the wire; DEL is ASCII yet no field-vchar (RFC 9110 §5.5), so it is escaped
    # too (it can only stand inside a JSON string).
    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).replace("\x7f", "\\u007f")


_CONNECTION_MEMO: dict[str, frozenset[str]] = {}


def _connection_tokens(headers: Any) -> frozenset[str]:
    """The lower-cased names a `Connection` header lists (remembered: the same few values,
    `keep-alive` above all, come on nearly every message)."""
    values = headers.getall("Connection", ())
    if not values:
        return _NONE
    value = values[0] if len(values) == 1 else ", ".join(values)
    tokens = _CONNECTION_MEMO.get(value)
    if tokens is None:
        tokens = frozenset(t.strip().lower() for t in value.split(",") if t.strip())
        if len(_CONNECTION_MEMO) < _MEMO_LIMIT:
            _CONNECTION_MEMO[value] = tokens
    return tokens


def _forwarded_node(address: str | None) -> str:
    """RFC 7239 §6: IPv6 addresses are bracketed and quoted; unknown peers are `unknown`."""
    if not address:
        return "unknown"
    if ":" not in address and address.replace(".", "").isdigit():
        return address  # IPv4 from the socket: the common case, no parsing needed
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return '"' + address.replace('"', "") + '"'
    return f'"[{ip}]"' if ip.version == 6 else str(ip)


def _fold(name: str) -> str:
    """A header name as CGI/WSGI servers see it: `X_Forwarded_Host` is `x-forwarded-host`."""
    return name.lower().replace("_", "-")


@functools.lru_cache(maxsize=256)
def _names_credential(name: bytes) -> bool:
    """Whether a header named `name` (as the client spelt it) carries its credentials, by
    any spelling a server behind might read as Authorization or DPoP. Remembered per
    spelling: a few on any route, and the cache's bound holds whatever clients send."""
    return _fold(name.decode("latin-1")) in _CREDENTIALS


class BodyFailure(Exception):
    """The client's body could not be passed on: why, as an HTTP answer to give."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind  # too_large | timeout | client_gone


class _Upload:
    """A request body on its way: its deadline, whether it has all arrived, why it stopped.

    While it is arriving it counts against its client's address in `BodiesInFlight`.
    """

    __slots__ = ("bodies", "client", "complete", "counted", "deadline", "failure", "limit")

    def __init__(
        self, bodies: BodiesInFlight, client: str, deadline: float, limit: int | None
    ) -> None:
        self.bodies = bodies
        self.client = client
        self.deadline = deadline  # event-loop time by which the whole body must be in
        self.limit = limit  # the route's max_body_size
        self.complete = False
        self.counted = True
        self.failure: BodyFailure | None = None

    def stopped(self) -> None:
        """The body is no longer arriving (whole, cut short or abandoned): uncount it once."""
        if self.counted:
            self.counted = False
            self.bodies.leave(self.client)


class Upstream:
    """How requests reach the upstream, shared by every Forwarder built on the same pool."""

    def __init__(
        self, client: UpstreamClient, websockets: aiohttp.ClientSession, slots: Slots
    ) -> None:
        self.client = client  # every exchange but WebSocket upgrades
        self.websockets = websockets
        self.slots = slots  # exchanges using the upstream at once
        # WebSocket upgrades: a session of its own only so that an upstream's refusal comes
        # back as an answer to relay (`_refused_upgrade`).
        self.upgrades = aiohttp.ClientSession(
            connector=websockets.connector,
            connector_owner=False,
            timeout=websockets.timeout,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=websockets.skip_auto_headers,
            middlewares=(_refused_upgrade,),
        )

    async def close(self) -> None:
        await self.upgrades.close()
        await self.websockets.close()
        await self.client.close()


class _Answer(Protocol):
    """What `_relay` reads of an answer: the upstream client's, or aiohttp's (a refused
    WebSocket upgrade)."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> MultiMapping[str]: ...
    @property
    def content_length(self) -> int | None: ...

    async def read(self) -> bytes: ...

    async def readany(self) -> bytes: ...


class _AiohttpAnswer:
    """An aiohttp answer as `_relay` reads it."""

    __slots__ = ("_answer", "content_length", "headers", "reason", "status")

    def __init__(self, answer: aiohttp.ClientResponse) -> None:
        self._answer = answer
        self.status = answer.status
        self.reason = answer.reason
        self.headers = answer.headers
        self.content_length = answer.content_length

    async def read(self) -> bytes:
        return await self._answer.read()

    async def readany(self) -> bytes:
        return await self._answer.content.readany()


class RefusedUpgrade(Exception):
    """The upstream answered a WebSocket upgrade with something other than 101."""

    def __init__(self, answer: aiohttp.ClientResponse) -> None:
        super().__init__(answer.status)
        self.answer = answer  # headers read, body not yet: the caller relays and releases it


async def _refused_upgrade(
    request: aiohttp.ClientRequest, send: ClientHandlerType
) -> aiohttp.ClientResponse:
    """Hands an upgrade's answer other than 101 to the caller whole. The client library would
    close it and keep only the status and headers; its body is part of what the upstream
    said."""
    answer = await send(request)
    if answer.status != 101:
        raise RefusedUpgrade(answer)
    return answer


class Forwarder:
    def __init__(
        self,
        settings: Forwarding,
        upstream: Upstream,
        bodies: BodiesInFlight,
        now: Now = time.time,
    ) -> None:
        """`bodies` counts bodies arriving per client, for the whole process; `now` is the
        wall clock tokens expire by."""
        self._now = now
        self._upstream = upstream.client
        self._upgrades = upstream.upgrades
        self._slots = upstream.slots
        self._pool_timeout = settings.pool_timeout.total_seconds()
        self._bodies = bodies
        self._addresses = ClientAddresses(settings.trusted_proxies)
        url = urlsplit(settings.upstream_url)
        self._base = settings.upstream_url[: len(settings.upstream_url) - len(url.path)]
        self._prefix = url.path.rstrip("/")
        self._preserve_host = settings.preserve_host
        self._server_name = settings.server_name  # None: the URL's host
        self._strip_authorization = settings.strip_authorization
        self._buffer_size = settings.buffer_size
        self._body_timeout = settings.body_timeout.total_seconds()
        self._body_total_timeout = settings.body_total_timeout.total_seconds()
        self._request_id_header = settings.request_id_header
        self.request_id_header = self._request_id_header
        self._traceparent = settings.traceparent
        self.identity = settings.identity
        self._client_cert = settings.identity.client_cert
        dropped = (
            _REQUEST_DROP
            | set(self.identity.names())
            | {
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-forwarded-host",
                "forwarded",
                "via",
                self._request_id_header,
            }
            | ({"authorization"} if self._strip_authorization else set())
            | ({"traceparent"} if self._traceparent else set())
            | (_METHOD_OVERRIDE if settings.strip_method_override else set())
        )
        # Folded, so that one lookup also drops the `_` spellings of each: a CGI/WSGI
        # upstream would read `X_Forwarded_For` as the gateway's own `X-Forwarded-For`.
        self._drop = frozenset(_fold(name) for name in dropped)
        self.websockets_open = 0
        self._keep: dict[bytes, bool] = {}
        self._excluded: dict[tuple[frozenset[str], bool], frozenset[bytes]] = {}
        self._hosts: dict[str, bool] = {}
        # Each principal's identity headers as wire text, for as long as a cache keeps the
        # principal (never longer: the headers are part of what a cache entry holds).
        self._identities: Derived[bytes] = Derived(_IDENTITIES_REMEMBERED)
        self._last_identity: tuple[Principal | None, bytes] = (None, b"")
        # A principal serves more than one request only when a cache gives it out again: the
        # verified-token cache, or an introspection answer's. Without either, every request
        # brings a principal of its own, whose headers would be remembered for nothing.
        self._remember_identities = settings.principals_reused
        # (client_id, scopes, issuer) -> their identity header lines, checked: the same few
        # clients, scope sets and issuers come with principal after principal. Lines of up
        # to _SHARED_IDENTITY_BYTES are kept, so this holds 1 MiB at most.
        self._shared_identities: dict[tuple[str | None, frozenset[str], str], bytes] = {}

    # ------------------------------------------------------------------ headers

    def _keeps(self, name: bytes) -> bool:
        """Whether a client header may go upstream, whatever the request (remembered)."""
        kept = _fold(name.decode("utf-8", "surrogateescape")) not in self._drop
        if len(self._keep) < _MEMO_LIMIT:
            self._keep[name] = kept
        return kept

    def _excluded_names(self, incoming: Any, drop_tracestate: bool) -> frozenset[bytes]:
        """The client fields this request drops beyond those `_keeps` refuses, as lower-case
        names: those its `Connection` lists (RFC 9110 §7.6.1), and `tracestate` when its
        trace is not continued. Remembered: nearly every request says `keep-alive`, which
        names nothing that would be kept."""
        tokens = _connection_tokens(incoming)
        drop_tracestate = drop_tracestate and "tracestate" in incoming
        if not tokens and not drop_tracestate:
            return _NO_NAMES
        key = (tokens, drop_tracestate)
        excluded = self._excluded.get(key)
        if excluded is None:
            names = {t for t in tokens if _fold(t) not in self._drop}
            if drop_tracestate:
                names.add("tracestate")
            excluded = frozenset(n.encode("utf-8", "surrogateescape") for n in names)
            if len(self._excluded) < _MEMO_LIMIT:
                self._excluded[key] = excluded
        return excluded

    def _forwarded_host(self, host: str | None) -> str | None:
        """The Host if it is a plain host[:port], else None (remembered)."""
        if not host:
            return None
        valid = self._hosts.get(host)
        if valid is None:
            valid = _HOST.fullmatch(host) is not None
            if len(self._hosts) < _MEMO_LIMIT:
                self._hosts[host] = valid
        return host if valid else None

    def request_id(self, request: web.BaseRequest, fresh: str | None = None) -> str:
        """The client's request id when well-formed, else `fresh` or a random one."""
        given = request.headers.get(self._request_id_header)
        if given is not None and _REQUEST_ID.fullmatch(given):
            return given
        return fresh or tracecontext.RANDOM.take(16).hex()

    def upstream_fields(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        strip_credentials: bool = False,
    ) -> RequestFields:
        """The header fields the upstream gets, as wire bytes: the client's that may go on,
        in their order and as the bytes the client sent, then the gateway's own, then the
        identity headers.

        The client's names and values reach the wire unchecked: the listener's parser
        refuses CR, LF and NUL in any of them (tests/gateway/test_forward.py proves it of
        each kind of field), so none can end its line. Every line the gateway composes is
        checked (`field_lines`), per request or, for a principal's identity headers, once.
        """
        incoming = request.headers
        trace = self._traceparent and exchange.traceparent is not None
        excluded = self._excluded_names(incoming, trace and exchange.trace_restarted)
        keep = self._keep
        wire: list[bytes] = []
        for name, value in request.raw_headers:
            kept = keep.get(name)
            if kept is None:
                kept = self._keeps(name)
            if kept and (not excluded or name.lower() not in excluded):
                if strip_credentials and _names_credential(name):
                    continue
                wire += (name, b": ", value, b"\r\n")

        # Every header set below was dropped from the client's copy above (`_drop`), so it
        # is added, not replaced.
        request_host = request.host
        scheme = request.scheme
        peer = request.remote
        prior = ", ".join(incoming.getall("X-Forwarded-For", ()))
        forwarded_for = f"{prior}, {peer}" if prior else (peer or "unknown")
        # A Host such as `a";for=6.6.6.6` would add a forged element to Forwarded: a name
        # that is not a plain host[:port] is left out of both headers rather than escaped.
        host = self._forwarded_host(request_host)
        element = f"for={_forwarded_node(peer)};proto={scheme}"
        if host:
            element += f';host="{host}"'
        prior_fwd = ", ".join(incoming.getall("Forwarded", ()))
        forwarded = f"{prior_fwd}, {element}" if prior_fwd else element
        prior_via = ", ".join(incoming.getall("Via", ()))
        version = request.version
        via = "1.1 portcullis" if version == (1, 1) else f"{version[0]}.{version[1]} portcullis"
        if prior_via:
            via = f"{prior_via}, {via}"
        own = [f"X-Forwarded-For: {forwarded_for}", f"X-Forwarded-Proto: {scheme}"]
        if host:
            own.append(f"X-Forwarded-Host: {host}")
        own += (
            f"Forwarded: {forwarded}",
            f"Via: {via}",
            f"{self._request_id_header}: {exchange.request_id}",
        )
        if trace:
            own.append(f"traceparent: {exchange.traceparent}")
        wire.append(field_lines(own))

        if principal is not None:
            # A cached token is the same principal on every request: its headers are
            # computed and checked once. (A reload builds a new Forwarder, with new names,
            # and no memory.)
            # The last principal's come first: a client sends one token request after request.
            known = self._last_identity
            if known[0] is not principal:
                if self._remember_identities:
                    lines = self._identities.get(principal)
                    if lines is None:
                        lines = self.identity_fields(principal)
                        self._identities.put(principal, lines)
                else:
                    lines = self.identity_fields(principal)
                known = (principal, lines)
                self._last_identity = known
            wire.append(known[1])
        if self._client_cert:
            certificate = clientcert.of(request)
            if certificate is not None:
                cert_headers = self.client_cert_headers(certificate)
                wire.append(field_lines([f"{name}: {value}" for name, value in cert_headers]))
        kept_host = request_host if self._preserve_host and request_host else None
        # The length the listener's parser held the body to; the bytes are sent as they
        # came (the listener decodes no content coding: RFC 9110 §8.4 makes that the
        # upstream's business), so it is the length of what is sent.
        return RequestFields(wire, kept_host, request.content_length)

    def client_cert_headers(
        self, certificate: clientcert.ClientCertificate
    ) -> list[tuple[str, str]]:
        ids = self.identity
        headers = []
        if ids.client_cert_subject is not None:
            headers.append((ids.client_cert_subject, header_value(certificate.subject)))
        if ids.client_cert_san is not None and certificate.sans:
            headers.append((ids.client_cert_san, header_value(", ".join(certificate.sans))))
        return headers

    def identity_fields(self, principal: Principal) -> bytes:
        """The identity headers of a principal as wire text, checked as `field_lines`
        checks; computed once per verified token (the lines it shares with other principals,
        client id, scopes and issuer, once per distinct set of them)."""
        ids = self.identity
        lines = field_lines([f"{ids.subject}: {string_header_value(principal.subject)}"])
        shared_key = (principal.client_id, principal.scopes, principal.issuer)
        shared = self._shared_identities.get(shared_key)
        if shared is None:
            shared = self._shared_identity(principal)
            if len(self._shared_identities) < _MEMO_LIMIT and len(shared) <= _SHARED_IDENTITY_BYTES:
                self._shared_identities[shared_key] = shared
        lines += shared
        if ids.claims:
            claims = principal.claims
            lines += field_lines(
                [
                    f"{header}: {header_value(claims[claim])}"
                    for header, claim in ids.claims.items()
                    if claims.get(claim) is not None
                ]
            )
        return lines

    def _shared_identity(self, principal: Principal) -> bytes:
        """The client id, scopes and issuer lines of a principal's identity headers."""
        ids = self.identity
        shared = []
        if principal.client_id is not None:
            shared.append(f"{ids.client_id}: {string_header_value(principal.client_id)}")
        # Scopes are RFC 6749 §3.3 scope tokens (the verifiers refuse others): no spaces.
        scopes = " ".join(string_header_value(s) for s in sorted(principal.scopes))
        shared.append(f"{ids.scopes}: {scopes}")
        shared.append(f"{ids.issuer}: {string_header_value(principal.issuer)}")
        return field_lines(shared)

    def response_headers(
        self,
        upstream: _Answer,
        request_id: str,
        extra: Sequence[tuple[str, str]] = (),
        own_cors: bool = False,
    ) -> CIMultiDict[str]:
        """The upstream's headers minus hop-by-hop ones, plus the gateway's `extra` (rate
        limit, CORS). When the gateway answers CORS for the route, the upstream's own
        Access-Control-* headers are dropped: two answers would contradict each other."""
        named_in_connection = _connection_tokens(upstream.headers)
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in upstream.headers.items():
            low = name.lower()
            if low in HOP_BY_HOP or (named_in_connection and low in named_in_connection):
                continue
            if own_cors and low.startswith("access-control-"):
                continue
            out.add(name, value)
        out[self._request_id_header] = request_id
        if extra:
            out.extend(extra)
        return out

    # ------------------------------------------------------------------ bodies

    def _client(self, request: web.BaseRequest) -> str:
        """The client's address, as the per-client body cap counts it."""
        if self._addresses.uses_forwarded_for:
            return self._addresses.client(
                request.remote, request.headers.getall("X-Forwarded-For", ())
            )
        return request.remote or "unknown"

    async def _receive(
        self, request: web.BaseRequest, upload: _Upload
    ) -> bytes | AsyncIterator[bytes]:
        """The body, whole when it fits in `buffer_size`, else as a stream; either way up to
        `buffer_size` bytes have arrived when this returns, before any upstream connection
        is taken."""
        length = request.content_length
        if length is not None and length <= self._buffer_size:
            body = await self._read_small_body(request, length, upload.deadline)
            upload.complete = True
            return body
        start = await self._read_start(request, upload)
        if upload.complete:
            return start
        return self._stream_body(request, start, upload)

    async def _read_small_body(
        self, request: web.BaseRequest, length: int, deadline: float
    ) -> bytes:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(min(loop.time() + self._body_timeout, deadline)):
                return await request.content.readexactly(length)
        except TimeoutError:
            raise BodyFailure("timeout") from None
        except _BODY_BROKEN:
            raise BodyFailure("client_gone") from None

    async def _next_chunk(self, request: web.BaseRequest, deadline: float) -> bytes:
        """What has arrived of the body (b"" at its end), waiting at most `body_timeout` and
        never past the whole body's deadline."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(min(loop.time() + self._body_timeout, deadline)):
                return await request.content.readany()
        except TimeoutError:
            raise BodyFailure("timeout") from None
        except _BODY_BROKEN:
            raise BodyFailure("client_gone") from None

    async def _read_start(self, request: web.BaseRequest, upload: _Upload) -> bytes:
        """At least `buffer_size` bytes of a body, or all of a shorter one (then the upload
        is complete)."""
        content = request.content
        parts: list[bytes] = []
        received = 0
        while received < self._buffer_size:
            chunk = await self._next_chunk(request, upload.deadline)
            if chunk:
                received += len(chunk)
                if upload.limit is not None and received > upload.limit:
                    raise BodyFailure("too_large")
                parts.append(chunk)
            if not chunk or content.at_eof():
                upload.complete = True
                break
        return b"".join(parts)

    async def _stream_body(
        self, request: web.BaseRequest, start: bytes, upload: _Upload
    ) -> AsyncIterator[bytes]:
        """The body from `start` on, chunk by chunk; a failure is recorded on the upload
        before the upload aborts (the client library reports it only as a broken
        connection)."""
        received = len(start)
        yield start
        while True:
            try:
                chunk = await self._next_chunk(request, upload.deadline)
            except BodyFailure as exc:
                upload.failure = exc
                raise
            if not chunk:
                upload.complete = True
                upload.stopped()
                return
            received += len(chunk)
            if upload.limit is not None and received > upload.limit:
                upload.failure = BodyFailure("too_large")
                raise upload.failure
            yield chunk

    # ------------------------------------------------------------------ the exchange

    def send(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        max_body: int | None,
        extra: Sequence[tuple[str, str]] = (),
        own_cors: bool = False,
        *,
        body: bytes | None = None,
        strip_credentials: bool = False,
    ) -> Coroutine[Any, Any, web.StreamResponse]:
        """Forward the request and relay the answer; `extra` headers go on the answer.
        `body`: the whole body, already read (`read_whole`); `strip_credentials`: the
        client's Authorization and DPoP stay here. The time from sending upstream to the end
        of the answer is the exchange's upstream time.

        Not itself a coroutine: it hands back the one that does the work, so a request
        without a body (the common case) goes through one coroutine, not two.
        """
        fields = self.upstream_fields(request, principal, exchange, strip_credentials)
        if body is not None:
            return self._exchange(request, fields, body, None, exchange, extra, own_cors)
        if not request.body_exists:
            return self._exchange(request, fields, None, None, exchange, extra, own_cors)
        return self._send_with_body(request, fields, exchange, max_body, extra, own_cors)

    async def read_whole(self, request: web.BaseRequest, limit: int) -> bytes | web.Response:
        """The whole body of a request whose body the gateway must read before it decides
        (an MCP call), as long as it is at most `limit` bytes; else the answer refusing it
        (413, 408, 429). Counted against its client while it arrives, as any body is."""
        if not request.body_exists:
            return b""
        length = request.content_length
        if length is not None and length > limit:
            return errors.payload_too_large(limit)
        client = self._client(request)
        if not self._bodies.enter(client):
            return errors.too_many_bodies()
        deadline = asyncio.get_running_loop().time() + self._body_total_timeout
        upload = _Upload(self._bodies, client, deadline, limit)
        try:
            await self._continue(request)
            if length is not None:
                return await self._read_small_body(request, length, deadline)
            parts: list[bytes] = []
            received = 0
            while chunk := await self._next_chunk(request, deadline):
                received += len(chunk)
                if received > limit:
                    return errors.payload_too_large(limit)
                parts.append(chunk)
            return b"".join(parts)
        except BodyFailure as exc:
            return self._body_failure(exc, limit)
        finally:
            upload.stopped()

    async def _send_with_body(
        self,
        request: web.BaseRequest,
        fields: RequestFields,
        exchange: Exchange,
        max_body: int | None,
        extra: Sequence[tuple[str, str]],
        own_cors: bool,
    ) -> web.StreamResponse:
        """Count the body against its client, receive its start (all of a small one), then
        the exchange."""
        client = self._client(request)
        if not self._bodies.enter(client):
            return errors.too_many_bodies()
        deadline = asyncio.get_running_loop().time() + self._body_total_timeout
        upload = _Upload(self._bodies, client, deadline, max_body)
        try:
            if request.content_length != 0:
                await self._continue(request)
            try:
                data = await self._receive(request, upload)
            except BodyFailure as exc:
                return self._body_failure(exc, max_body)
            if upload.complete:
                upload.stopped()
            if request.method not in _BODY_METHODS:
                # RFC 9112 §9.6: the upstream handles no further request on this connection,
                # so body bytes it did not read as a body cannot become one.
                # (The client's own Connection field never goes upstream: this is the only one.)
                fields.add("Connection", "close")
            return await self._exchange(request, fields, data, upload, exchange, extra, own_cors)
        finally:
            upload.stopped()

    async def _exchange(
        self,
        request: web.BaseRequest,
        fields: RequestFields,
        data: bytes | AsyncIterator[bytes] | None,
        upload: _Upload | None,
        exchange: Exchange,
        extra: Sequence[tuple[str, str]],
        own_cors: bool,
    ) -> web.StreamResponse:
        """Take an upstream slot (waiting at most `pool_timeout`), send, relay the answer."""
        slots = self._slots
        if not slots.try_take() and not await slots.wait(self._pool_timeout):
            log.warning("upstream pool busy", extra={"request_id": exchange.request_id})
            exchange.upstream_error = "busy"
            busy = errors.upstream_busy()
            if upload is not None and not upload.complete:
                busy.force_close()  # the rest of the body is not read for this answer
            return busy
        started = time.perf_counter()
        try:  # from here on, the slot is given back whatever happens
            answer = await self._upstream.send(
                request.method,
                self._prefix + request.raw_path,
                fields,
                data,
                single_use=upload is not None and request.method not in _BODY_METHODS,
            )
            try:
                if upload is not None and not upload.complete:
                    # The answer came before the body was all sent: what the upstream makes
                    # of the rest of it is not known, so the connection is not used again.
                    answer.keep_out_of_pool()
                return await self._relay(request, answer, exchange, extra, own_cors)
            finally:
                answer.release()
        except BodyFailure as exc:
            return self._body_failure(exc, upload.limit if upload is not None else None)
        except TimeoutError:
            if upload is not None and upload.failure is not None:
                return self._body_failure(upload.failure, upload.limit)
            log.warning("upstream timed out", extra={"request_id": exchange.request_id})
            exchange.upstream_error = "timeout"
            return errors.gateway_timeout()
        except (UpstreamRefused, UpstreamBroken) as exc:
            if upload is not None and upload.failure is not None:
                return self._body_failure(upload.failure, upload.limit)
            log.warning(
                "upstream failed",
                extra={"request_id": exchange.request_id, "reason": str(exc)},
            )
            exchange.upstream_error = "connect" if isinstance(exc, UpstreamRefused) else "broken"
            return errors.bad_gateway()
        finally:
            exchange.upstream_seconds = time.perf_counter() - started
            slots.give_back()

    @staticmethod
    async def _continue(request: web.BaseRequest) -> None:
        """Answer `Expect: 100-continue` once the request is allowed (RFC 9110 §10.1.1).

        The low-level server leaves this to the handler; without it a client that waits for
        the interim answer before sending its body would stall until body_timeout.
        """
        expect = request.headers.get("Expect")
        if expect is None or expect.lower() != "100-continue" or request.version < (1, 1):
            return
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # The interim answer is not the response: the final one is still to be sent whole.
        request.writer.output_size = 0

    def _body_failure(self, exc: BodyFailure, max_body: int | None) -> web.Response:
        if exc.kind == "too_large":
            return errors.payload_too_large(max_body or 0)
        if exc.kind == "timeout":
            return errors.request_timeout()
        # The client is gone: this answer reaches nobody, it only ends the exchange quietly.
        return errors.bad_request("The request body was cut short.")

    async def _relay(
        self,
        request: web.BaseRequest,
        upstream: _Answer,
        exchange: Exchange,
        extra: Sequence[tuple[str, str]],
        own_cors: bool,
    ) -> web.StreamResponse:
        request_id = exchange.request_id
        headers = self.response_headers(upstream, request_id, extra, own_cors)
        sent = upstream.headers
        left_out = _LEFT_OUT_BY_PRESENCE[("Content-Type" in sent, "Server" in sent)]
        status = upstream.status
        length = upstream.content_length
        no_body = request.method == "HEAD" or status in _NO_BODY_STATUS or status < 200
        if not no_body and length is not None and length <= self._buffer_size:
            body = await upstream.read()
            del headers["Content-Length"]
            answer = web.Response(status=status, reason=upstream.reason, headers=headers, body=body)
            answer[LEFT_OUT] = left_out
            return answer

        response = web.StreamResponse(status=status, reason=upstream.reason, headers=headers)
        response[LEFT_OUT] = left_out
        await response.prepare(request)
        while not no_body:
            try:
                chunk = await upstream.readany()
            except (UpstreamBroken, aiohttp.ClientError, TimeoutError) as exc:
                # Headers are already sent: the only honest signal left is to cut the
                # connection, so the client cannot mistake a truncated body for a whole one.
                log.warning(
                    "upstream failed mid-body",
                    extra={"request_id": request_id, "reason": type(exc).__name__},
                )
                exchange.upstream_error = "broken"
                if request.transport is not None:
                    request.transport.abort()
                return response
            if not chunk:
                break
            try:
                await response.write(chunk)
            except ConnectionError:
                # The client went away; releasing the answer closes the upstream
                # connection, which is not reused with a body half read.
                log.info("client left mid-body", extra={"request_id": request_id})
                return response
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ WebSockets

    @staticmethod
    def is_websocket_upgrade(request: web.BaseRequest) -> bool:
        """RFC 6455 §4.1: a GET with `Upgrade: websocket` and `Connection: upgrade`."""
        upgrade = request.headers.get("Upgrade")
        return (
            upgrade is not None
            and upgrade.strip().lower() == "websocket"
            and "upgrade" in _connection_tokens(request.headers)
        )

    async def websocket(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        settings: WebSocket,
        extra: Sequence[tuple[str, str]] = (),
    ) -> web.StreamResponse:
        """Open the upstream WebSocket, then accept the client's and relay messages."""
        if not _client_websocket(settings).can_prepare(request).ok:
            return errors.bad_request("The WebSocket upgrade request is not valid (RFC 6455).")
        # aiohttp's client makes the upgrade, and takes the same fields as a multidict.
        headers = self.upstream_fields(request, principal, exchange).as_headers()
        for name in [n for n in headers if n.lower() in _WEBSOCKET_HANDSHAKE]:
            headers.popall(name, None)
        protocols = tuple(
            p.strip()
            for value in request.headers.getall("Sec-WebSocket-Protocol", ())
            for p in value.split(",")
            if p.strip()
        )
        # The upstream WebSocket holds a pooled connection for as long as it is open.
        slots = self._slots
        if not slots.try_take() and not await slots.wait(self._pool_timeout):
            log.warning("upstream pool busy", extra={"request_id": exchange.request_id})
            exchange.upstream_error = "busy"
            return errors.upstream_busy()
        try:
            started = time.perf_counter()
            upstream = await self._connect_websocket(
                request, headers, protocols, settings, exchange, extra
            )
            if isinstance(upstream, web.StreamResponse):
                exchange.upstream_seconds = time.perf_counter() - started
                return upstream
            try:
                # The client is answered with the subprotocol the upstream chose (RFC 6455
                # §4.2.2), now that it is known.
                client = _client_websocket(settings, upstream.protocol)
                client.headers[self._request_id_header] = exchange.request_id
                client.headers.extend(extra)
                await client.prepare(request)
                self.websockets_open += 1
                try:
                    await self._relay_websocket(client, upstream, principal, settings, exchange)
                finally:
                    self.websockets_open -= 1
            finally:
                await upstream.close()
                exchange.upstream_seconds = time.perf_counter() - started
            return client
        finally:
            slots.give_back()

    async def _connect_websocket(
        self,
        request: web.BaseRequest,
        headers: CIMultiDict[str],
        protocols: tuple[str, ...],
        settings: WebSocket,
        exchange: Exchange,
        extra: Sequence[tuple[str, str]],
    ) -> aiohttp.ClientWebSocketResponse | web.StreamResponse:
        """The upstream WebSocket, or the answer to give the client when it cannot be had."""
        url = URL(self._base + self._prefix + request.raw_path, encoded=True)
        try:
            return await self._upgrades.ws_connect(
                url,
                method="GET",
                headers=headers,
                protocols=protocols,
                server_hostname=self._server_name,
                max_msg_size=settings.max_message_size,
                heartbeat=settings.heartbeat.total_seconds() if settings.heartbeat else None,
            )
        except RefusedUpgrade as refusal:
            # RFC 6455 §4.1: a client handles an answer other than 101 as any HTTP answer, so
            # the upstream's refusal (a 401 with its challenge, a 404, ...) is what the
            # client gets. A 502 is for an answer the gateway cannot use (RFC 9110 §15.6.3).
            log.info(
                "upstream refused the websocket upgrade",
                extra={"request_id": exchange.request_id, "status": refusal.answer.status},
            )
            # The gateway's CORS fields, when it adds them, replace the upstream's.
            own_cors = any(name.lower().startswith("access-control-") for name, _ in extra)
            async with refusal.answer as answer:
                return await self._relay(request, _AiohttpAnswer(answer), exchange, extra, own_cors)
        except aiohttp.WSServerHandshakeError as exc:
            # A 101 whose handshake does not hold (RFC 6455 §4.1: a wrong accept key, ...).
            log.warning(
                "upstream gave an invalid websocket handshake",
                extra={"request_id": exchange.request_id, "status": exc.status},
            )
            exchange.upstream_error = "broken"
            return errors.bad_gateway()
        except (TimeoutError, aiohttp.ServerTimeoutError):
            exchange.upstream_error = "timeout"
            return errors.gateway_timeout()
        except aiohttp.ClientError as exc:
            log.warning(
                "upstream websocket failed",
                extra={"request_id": exchange.request_id, "reason": type(exc).__name__},
            )
            exchange.upstream_error = (
                "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "broken"
            )
            return errors.bad_gateway()

    async def _relay_websocket(
        self,
        client: web.WebSocketResponse,
        upstream: aiohttp.ClientWebSocketResponse,
        principal: Principal | None,
        settings: WebSocket,
        exchange: Exchange,
    ) -> None:
        tasks: dict[asyncio.Task[Any], str] = {
            asyncio.create_task(_pump(client, upstream)): "client",
            asyncio.create_task(_pump(upstream, client)): "upstream",
        }
        if settings.close_on_token_expiry and principal is not None:
            left = principal.expires_at - self._now()
            if left < float("inf"):
                tasks[asyncio.create_task(asyncio.sleep(max(0.0, left)))] = "expiry"
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            # Waited for, so that no pump outlives the exchange (and its sockets).
            await asyncio.wait(tasks)
        first = next(iter(done))
        ended_by = tasks[first]
        if ended_by == "expiry":
            code, reason = _EXPIRED_CLOSE, b"token expired"
            log.info("websocket closed: token expired", extra={"request_id": exchange.request_id})
        else:
            code, reason = first.result() if not first.cancelled() else (_WS_GOING_AWAY, b"")
        # Either side may be gone already: a failed close has nobody left to tell.
        await asyncio.gather(
            client.close(code=code, message=reason),
            upstream.close(code=code, message=reason),
            return_exceptions=True,
        )


def _client_websocket(settings: WebSocket, protocol: str | None = None) -> web.WebSocketResponse:
    return web.WebSocketResponse(
        protocols=(protocol,) if protocol else (),
        max_msg_size=settings.max_message_size,
        heartbeat=settings.heartbeat.total_seconds() if settings.heartbeat else None,
    )


async def _pump(
    source: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
    sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
) -> tuple[int, bytes]:
    """Messages from `source` to `sink` until `source` closes; its close code and reason."""
    while True:
        message = await source.receive()
        kind = message.type
        try:
            if kind is aiohttp.WSMsgType.TEXT:
                await sink.send_str(message.data)
                continue
            if kind is aiohttp.WSMsgType.BINARY:
                await sink.send_bytes(message.data)
                continue
        except ConnectionError:
            return _WS_GOING_AWAY, b""
        if kind is aiohttp.WSMsgType.CLOSE:
            return _sendable_close(message.data), (message.extra or "").encode()
        if kind is aiohttp.WSMsgType.ERROR:
            return _WS_INTERNAL_ERROR, b""
        if kind in (aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return _sendable_close(source.close_code), b""


def _sendable_close(code: int | None) -> int:
    """A code that may be sent in a close frame (RFC 6455 §7.4.1: 1005, 1006 and 1015 are
    never sent); the relay passes on what one side said to the other."""
    if code is None or code == 1005:
        return 1000
    if code in (1006, 1015) or not (1000 <= code < 5000):
        return _WS_GOING_AWAY
    return code
