"""Forwarding an authorised request to the upstream and its answer back to the client.

- Method, path and query go upstream byte for byte.
- Hop-by-hop headers (RFC 9110 §7.6.1), and any header named in `Connection`, are dropped
  both ways.
- Identity headers are ALWAYS removed from the client's request first, on public routes
  too, including spellings with `_` for `-` that CGI-style servers fold into the same name;
  then they are set from the verified principal only.
- `X-Forwarded-For` and `Forwarded` (RFC 7239) are appended to, `X-Forwarded-Proto/Host`
  are set from what this gateway saw, `Via` is added (RFC 9110 §7.6.3), and a request id is
  kept when well-formed or generated.
- Bodies stream both ways in constant memory; small bodies with a known length (up to
  `forward.buffer_size`) are moved in one piece, which is faster.
- A W3C `traceparent` is sent upstream: the client's, continued, or a new one.
- Upstream refused or broken → 502; no answer in time → 504.
- WebSocket upgrades (on routes that allow them) are made to the upstream by the gateway,
  then the client's upgrade is accepted with the subprotocol the upstream chose, and
  messages flow both ways until either side closes; the other side is closed with the same
  code. With `close_on_token_expiry` the session is closed (1008, policy violation) when the
  token that opened it expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from . import errors
from .exchange import Exchange
from .principal import Principal
from .settings import Settings, WebSocketSettings

log = logging.getLogger("portcullis.gateway.forward")

# RFC 9110 §7.6.1 plus the de-facto Keep-Alive / Proxy-Connection. `Expect` is answered by
# this gateway itself; `Host` is set for the upstream.
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
_REQUEST_DROP = HOP_BY_HOP | {"host", "expect"}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
_VISIBLE_ASCII = re.compile(r"[\x20-\x7E]*")
# What a Host header may hold (RFC 9110 §7.2: uri-host [":" port]), narrowed to the names and
# addresses in real use, so it can be written into Forwarded without breaking its syntax.
_HOST = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_NO_BODY_STATUS = frozenset({204, 304})
_NONE: frozenset[str] = frozenset()
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


def header_value(value: Any) -> str:
    """A claim as a header value that can be neither injected into nor misread.

    Printable ASCII strings pass as they are; other strings, numbers, booleans, arrays and
    objects are JSON with non-ASCII escaped, so CR/LF and non-Latin-1 text never reach the wire.
    The whole string must be printable: `re.match` with `$` would let a trailing newline by.
    """
    if isinstance(value, str) and _VISIBLE_ASCII.fullmatch(value):
        return value
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


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


class BodyFailure(Exception):
    """The client's body could not be passed on: why, as an HTTP answer to give."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind  # too_large | timeout | client_gone


class Forwarder:
    def __init__(self, settings: Settings, session: aiohttp.ClientSession) -> None:
        self._session = session
        upstream = urlsplit(settings.upstream.url)
        self._base = settings.upstream.url[: len(settings.upstream.url) - len(upstream.path)]
        self._prefix = upstream.path.rstrip("/")
        self._preserve_host = settings.upstream.preserve_host
        self._strip_authorization = settings.forward.strip_authorization
        self._buffer_size = settings.forward.buffer_size
        self._body_timeout = settings.limits.body_timeout.total_seconds()
        self._request_id_header = settings.forward.request_id_header
        self.request_id_header = self._request_id_header
        self._traceparent = settings.forward.traceparent
        self.identity = settings.identity_headers
        self._identity_names = frozenset(
            name.lower().replace("_", "-") for name in self.identity.names()
        )
        self._drop = (
            _REQUEST_DROP
            | self._identity_names
            | {
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-forwarded-host",
                "forwarded",
                "via",
                self._request_id_header.lower(),
            }
            | ({"authorization"} if self._strip_authorization else set())
            | ({"traceparent"} if self._traceparent else set())
        )
        self.websockets_open = 0
        self._keep: dict[str, bool] = {}
        self._hosts: dict[str, bool] = {}

    # ------------------------------------------------------------------ headers

    def _keeps(self, name: str) -> bool:
        """Whether a client header may go upstream, whatever the request (remembered)."""
        low = name.lower()
        # X_Auth_Subject is X-Auth-Subject to a CGI/WSGI upstream.
        kept = low not in self._drop and low.replace("_", "-") not in self._identity_names
        if len(self._keep) < _MEMO_LIMIT:
            self._keep[name] = kept
        return kept

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
        return fresh or os.urandom(16).hex()

    def upstream_headers(
        self, request: web.BaseRequest, principal: Principal | None, exchange: Exchange
    ) -> CIMultiDict[str]:
        incoming = request.headers
        named_in_connection = _connection_tokens(incoming)
        keep = self._keep
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in incoming.items():
            kept = keep.get(name)
            if kept is None:
                kept = self._keeps(name)
            if kept and (not named_in_connection or name.lower() not in named_in_connection):
                out.add(name, value)

        # Every header set below was dropped from the client's copy above (`_drop`), so it
        # is added, not replaced: no search through the headers already there.
        add = out.add
        request_host = request.host
        scheme = request.scheme
        if self._preserve_host and request_host:
            add("Host", request_host)
        peer = request.remote
        prior = ", ".join(incoming.getall("X-Forwarded-For", ()))
        add("X-Forwarded-For", f"{prior}, {peer}" if prior else (peer or "unknown"))
        add("X-Forwarded-Proto", scheme)
        # A Host such as `a";for=6.6.6.6` would add a forged element to Forwarded: a name
        # that is not a plain host[:port] is left out of both headers rather than escaped.
        host = self._forwarded_host(request_host)
        if host:
            add("X-Forwarded-Host", host)
        element = f"for={_forwarded_node(peer)};proto={scheme}"
        if host:
            element += f';host="{host}"'
        prior_fwd = ", ".join(incoming.getall("Forwarded", ()))
        add("Forwarded", f"{prior_fwd}, {element}" if prior_fwd else element)
        prior_via = ", ".join(incoming.getall("Via", ()))
        version = request.version
        via = "1.1 portcullis" if version == (1, 1) else f"{version[0]}.{version[1]} portcullis"
        add("Via", f"{prior_via}, {via}" if prior_via else via)
        add(self._request_id_header, exchange.request_id)
        if self._traceparent and exchange.traceparent is not None:
            add("traceparent", exchange.traceparent)
            if exchange.trace_restarted and "tracestate" in out:
                del out["tracestate"]

        if principal is not None:
            # Keyed by the header settings, so a principal cached across a config change is
            # never sent with the names of the old one.
            identity = principal.memo.get(self.identity)
            if identity is None:
                identity = principal.memo[self.identity] = self.identity_headers(principal)
            out.extend(identity)
        return out

    def identity_headers(self, principal: Principal) -> tuple[tuple[str, str], ...]:
        """The identity headers of a principal; computed once per verified token."""
        ids = self.identity
        headers = [(ids.subject, header_value(principal.subject))]
        if principal.client_id is not None:
            headers.append((ids.client_id, header_value(principal.client_id)))
        headers.append((ids.scopes, " ".join(header_value(s) for s in sorted(principal.scopes))))
        headers.append((ids.issuer, header_value(principal.issuer)))
        for header, claim in ids.claims:
            claim_value = principal.claims.get(claim)
            if claim_value is not None:
                headers.append((header, header_value(claim_value)))
        return tuple(headers)

    def response_headers(
        self,
        upstream: aiohttp.ClientResponse,
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

    async def _read_small_body(self, request: web.BaseRequest, length: int) -> bytes:
        try:
            async with asyncio.timeout(self._body_timeout):
                return await request.content.readexactly(length)
        except TimeoutError:
            raise BodyFailure("timeout") from None
        except (asyncio.IncompleteReadError, ConnectionError, aiohttp.ClientPayloadError):
            raise BodyFailure("client_gone") from None

    async def _stream_body(
        self, request: web.BaseRequest, limit: int | None, failure: list[BodyFailure]
    ) -> AsyncIterator[bytes]:
        """The client's body chunk by chunk; a failure is recorded before the upload aborts."""
        received = 0
        content = request.content
        while True:
            try:
                async with asyncio.timeout(self._body_timeout):
                    chunk = await content.readany()
            except TimeoutError:
                failure.append(BodyFailure("timeout"))
                raise failure[-1] from None
            except Exception:
                failure.append(BodyFailure("client_gone"))
                raise failure[-1] from None
            if not chunk:
                return
            received += len(chunk)
            if limit is not None and received > limit:
                failure.append(BodyFailure("too_large"))
                raise failure[-1]
            yield chunk

    # ------------------------------------------------------------------ the exchange

    async def send(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        max_body: int | None,
        extra: Sequence[tuple[str, str]] = (),
        own_cors: bool = False,
    ) -> web.StreamResponse:
        """Forward the request and relay the answer; `extra` headers go on the answer.
        The time from sending upstream to the end of the answer is the exchange's
        upstream time."""
        request_id = exchange.request_id
        url = URL(self._base + self._prefix + request.raw_path, encoded=True)
        headers = self.upstream_headers(request, principal, exchange)
        failure: list[BodyFailure] = []
        data: bytes | AsyncIterator[bytes] | None = None
        length = request.content_length
        if length != 0 and request.body_exists:
            await self._continue(request)
        try:
            if length is not None and length <= self._buffer_size:
                data = await self._read_small_body(request, length) if length else None
            elif request.body_exists:
                data = self._stream_body(request, max_body, failure)
        except BodyFailure as exc:
            return self._body_failure(exc, max_body)
        started = time.perf_counter()
        try:
            async with self._session.request(
                request.method, url, headers=headers, data=data, allow_redirects=False
            ) as upstream:
                return await self._relay(request, upstream, exchange, extra, own_cors)
        except BodyFailure as exc:
            return self._body_failure(exc, max_body)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            if failure:
                return self._body_failure(failure[0], max_body)
            log.warning("upstream timed out", extra={"request_id": request_id})
            exchange.upstream_error = "timeout"
            return errors.gateway_timeout()
        except aiohttp.ClientError as exc:
            if failure:
                return self._body_failure(failure[0], max_body)
            log.warning(
                "upstream failed",
                extra={"request_id": request_id, "reason": type(exc).__name__},
            )
            exchange.upstream_error = (
                "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "broken"
            )
            return errors.bad_gateway()
        finally:
            exchange.upstream_seconds = time.perf_counter() - started

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

    def _body_failure(self, exc: BodyFailure, max_body: int | None) -> web.StreamResponse:
        if exc.kind == "too_large":
            return errors.payload_too_large(max_body or 0)
        if exc.kind == "timeout":
            return errors.request_timeout()
        # The client is gone: this answer reaches nobody, it only ends the exchange quietly.
        return errors.bad_request("The request body was cut short.")

    async def _relay(
        self,
        request: web.BaseRequest,
        upstream: aiohttp.ClientResponse,
        exchange: Exchange,
        extra: Sequence[tuple[str, str]],
        own_cors: bool,
    ) -> web.StreamResponse:
        request_id = exchange.request_id
        headers = self.response_headers(upstream, request_id, extra, own_cors)
        status = upstream.status
        length = upstream.content_length
        no_body = request.method == "HEAD" or status in _NO_BODY_STATUS or status < 200
        if (
            not no_body
            and length is not None
            and length <= self._buffer_size
            and "Content-Type" in headers
        ):
            body = await upstream.read()
            del headers["Content-Length"]
            return web.Response(status=status, reason=upstream.reason, headers=headers, body=body)

        response = web.StreamResponse(status=status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        while not no_body:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
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
                # The client went away; leaving the `async with` drops the upstream
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
        settings: WebSocketSettings,
        extra: Sequence[tuple[str, str]] = (),
    ) -> web.StreamResponse:
        """Open the upstream WebSocket, then accept the client's and relay messages."""
        client = web.WebSocketResponse(
            max_msg_size=settings.max_message_size,
            heartbeat=settings.heartbeat.total_seconds() if settings.heartbeat else None,
        )
        if not client.can_prepare(request).ok:
            return errors.bad_request("The WebSocket upgrade request is not valid (RFC 6455).")
        headers = self.upstream_headers(request, principal, exchange)
        for name in [n for n in headers if n.lower() in _WEBSOCKET_HANDSHAKE]:
            headers.popall(name, None)
        protocols = tuple(
            p.strip()
            for value in request.headers.getall("Sec-WebSocket-Protocol", ())
            for p in value.split(",")
            if p.strip()
        )
        url = URL(self._base + self._prefix + request.raw_path, encoded=True)
        started = time.perf_counter()
        try:
            upstream = await self._session.ws_connect(
                url,
                method="GET",
                headers=headers,
                protocols=protocols,
                max_msg_size=settings.max_message_size,
                heartbeat=settings.heartbeat.total_seconds() if settings.heartbeat else None,
            )
        except aiohttp.WSServerHandshakeError as exc:
            log.warning(
                "upstream refused the websocket upgrade",
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
        try:
            client._protocols = (upstream.protocol,) if upstream.protocol else ()
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

    async def _relay_websocket(
        self,
        client: web.WebSocketResponse,
        upstream: aiohttp.ClientWebSocketResponse,
        principal: Principal | None,
        settings: WebSocketSettings,
        exchange: Exchange,
    ) -> None:
        tasks: dict[asyncio.Task[Any], str] = {
            asyncio.create_task(_pump(client, upstream)): "client",
            asyncio.create_task(_pump(upstream, client)): "upstream",
        }
        if settings.close_on_token_expiry and principal is not None:
            left = principal.expires_at - time.time()
            if left < float("inf"):
                tasks[asyncio.create_task(asyncio.sleep(max(0.0, left)))] = "expiry"
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
        first = next(iter(done))
        ended_by = tasks[first]
        if ended_by == "expiry":
            code, reason = _EXPIRED_CLOSE, b"token expired"
            log.info("websocket closed: token expired", extra={"request_id": exchange.request_id})
        else:
            code, reason = first.result() if not first.cancelled() else (_WS_GOING_AWAY, b"")
        with contextlib.suppress(Exception):
            await asyncio.gather(
                client.close(code=code, message=reason),
                upstream.close(code=code, message=reason),
                return_exceptions=True,
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
