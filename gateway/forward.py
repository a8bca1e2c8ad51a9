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
- Upstream refused or broken → 502; no answer in time → 504.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from . import errors
from .principal import Principal
from .settings import Settings

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


def _connection_tokens(headers: Any) -> frozenset[str]:
    values = headers.getall("Connection", ())
    if not values:
        return _NONE
    return frozenset(t.strip().lower() for v in values for t in v.split(",") if t.strip())


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
        )
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

    def request_id(self, request: web.BaseRequest) -> str:
        given = request.headers.get(self._request_id_header)
        if given is not None and _REQUEST_ID.fullmatch(given):
            return given
        return os.urandom(16).hex()

    def upstream_headers(
        self, request: web.BaseRequest, principal: Principal | None, request_id: str
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

        if self._preserve_host and request.host:
            out["Host"] = request.host
        peer = request.remote
        prior = ", ".join(incoming.getall("X-Forwarded-For", ()))
        out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else (peer or "unknown")
        out["X-Forwarded-Proto"] = request.scheme
        # A Host such as `a";for=6.6.6.6` would add a forged element to Forwarded: a name
        # that is not a plain host[:port] is left out of both headers rather than escaped.
        host = self._forwarded_host(request.host)
        if host:
            out["X-Forwarded-Host"] = host
        element = f"for={_forwarded_node(peer)};proto={request.scheme}"
        if host:
            element += f';host="{host}"'
        prior_fwd = ", ".join(incoming.getall("Forwarded", ()))
        out["Forwarded"] = f"{prior_fwd}, {element}" if prior_fwd else element
        prior_via = ", ".join(incoming.getall("Via", ()))
        version = request.version
        via = "1.1 portcullis" if version == (1, 1) else f"{version[0]}.{version[1]} portcullis"
        out["Via"] = f"{prior_via}, {via}" if prior_via else via
        out[self._request_id_header] = request_id

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
        self, upstream: aiohttp.ClientResponse, request_id: str
    ) -> CIMultiDict[str]:
        named_in_connection = _connection_tokens(upstream.headers)
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in upstream.headers.items():
            low = name.lower()
            if low in HOP_BY_HOP or (named_in_connection and low in named_in_connection):
                continue
            out.add(name, value)
        out[self._request_id_header] = request_id
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
        request_id: str,
        max_body: int | None,
    ) -> web.StreamResponse:
        url = URL(self._base + self._prefix + request.raw_path, encoded=True)
        headers = self.upstream_headers(request, principal, request_id)
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
        try:
            async with self._session.request(
                request.method, url, headers=headers, data=data, allow_redirects=False
            ) as upstream:
                return await self._relay(request, upstream, request_id)
        except BodyFailure as exc:
            return self._body_failure(exc, max_body)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            if failure:
                return self._body_failure(failure[0], max_body)
            log.warning("upstream timed out", extra={"request_id": request_id})
            return errors.gateway_timeout()
        except aiohttp.ClientError as exc:
            if failure:
                return self._body_failure(failure[0], max_body)
            log.warning(
                "upstream failed",
                extra={"request_id": request_id, "reason": type(exc).__name__},
            )
            return errors.bad_gateway()

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
        self, request: web.BaseRequest, upstream: aiohttp.ClientResponse, request_id: str
    ) -> web.StreamResponse:
        headers = self.response_headers(upstream, request_id)
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
