"""Composition root of the gateway: everything built once from settings, and the one handler.

`Gateway.handle` is the whole request path, read top to bottom:
 1. route = match(method, path)           unmatched → 404
 2. token = bearer.extract(headers)       unless the route is public
 3. principal = verifier.verify(token)    cache, then keys already in memory
 4. policy.decide(route, principal)       401 audience/issuer, 403 insufficient_scope
 5. forward.send(request, principal)      identity headers replaced, bodies streamed
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

import aiohttp
from aiohttp import web

from portcullis import runtime
from portcullis.http import json_response

from . import bearer, errors, policy, rules
from .forward import Forwarder
from .jwks import KeySet
from .settings import Settings
from .verifiers.base import InvalidToken, VerifierUnavailable
from .verifiers.cache import TokenCache
from .verifiers.jwt import JwtVerifier, TrustedIssuer

log = logging.getLogger("portcullis.gateway")

USER_AGENT = "portcullis-gateway"
_MAX_LINGERING = timedelta(seconds=10)


class Gateway:
    """The gateway's state for one process: routes, key sets, token cache, upstream pool."""

    def __init__(
        self,
        settings: Settings,
        upstream_session: aiohttp.ClientSession,
        keys_session: aiohttp.ClientSession,
    ) -> None:
        self.settings = settings
        self.realm = settings.realm
        self.router = rules.compile_rules(settings.routes, settings.issuers)
        self.keysets: Mapping[str, KeySet] = {
            issuer.issuer: KeySet(issuer, settings.jwks, keys_session)
            for issuer in settings.issuers
        }
        self.token_cache = TokenCache(settings.token_cache_size)
        self.verifier = JwtVerifier(
            {
                issuer.issuer: TrustedIssuer(
                    settings=issuer,
                    keys=self.keysets[issuer.issuer],
                    algorithms=frozenset(issuer.algorithms),
                    leeway=issuer.leeway.total_seconds(),
                )
                for issuer in settings.issuers
            },
            self.token_cache,
        )
        self.forwarder = Forwarder(settings, upstream_session)
        self._max_body = settings.limits.max_body_size
        self._request_id_header = settings.forward.request_id_header
        self.draining = False

    def start(self) -> None:
        for keyset in self.keysets.values():
            keyset.start()

    async def close(self) -> None:
        for keyset in self.keysets.values():
            await keyset.close()

    def not_ready(self) -> dict[str, str]:
        """Why this process should not get traffic yet; empty when ready."""
        reasons = {
            url: keyset.last_error or "keys not loaded yet"
            for url, keyset in self.keysets.items()
            if not keyset.loaded
        }
        if self.draining:
            reasons["gateway"] = "shutting down"
        return reasons

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        request_id = self.forwarder.request_id(request)
        response = await self._handle(request, request_id)
        if not response.prepared:
            response.headers[self._request_id_header] = request_id
        return response

    async def _handle(self, request: web.BaseRequest, request_id: str) -> web.StreamResponse:
        target = request.raw_path
        # RFC 9112 §3.2: a request target carries no fragment, yet the parser lets `#` through.
        # The upstream would be sent the URL without it while the rules saw it, so a public
        # `/docs/**` would carry `/docs/secret#` to a protected `/docs/secret`.
        if "#" in target:
            return errors.bad_request("The request target must not contain '#'.")
        path = target.partition("?")[0]
        try:
            segments = rules.split_path(path)
        except rules.BadPath as exc:
            return errors.bad_request(f"The request path is refused: {exc}.")
        rule = self.router.match(request.method, segments)
        if rule is None:
            return errors.not_found()

        principal = None
        if not rule.public:
            authorization = request.headers.getall("Authorization", ())
            # The common case first: one `Bearer <token>` header whose token was verified
            # before. A hit means this exact string passed every check below already.
            if len(authorization) == 1 and authorization[0].startswith("Bearer "):
                principal = self.verifier.cached(authorization[0][7:])
            if principal is None:
                try:
                    token = bearer.extract(authorization)
                except bearer.MalformedAuthorization as exc:
                    return errors.invalid_request(self.realm, str(exc))
                if token is None:
                    return errors.unauthorized(self.realm)
                try:
                    principal = await self.verifier.verify(token)
                except InvalidToken as exc:
                    return errors.invalid_token(self.realm, exc.description)
                except VerifierUnavailable:
                    return errors.unavailable(
                        5, "The gateway cannot verify tokens right now; try again shortly."
                    )
            decision = policy.decide(rule, principal)
            if isinstance(decision, policy.Deny):
                if decision.code == "insufficient_scope":
                    return errors.insufficient_scope(
                        self.realm, decision.reason, decision.scope or ""
                    )
                return errors.invalid_token(self.realm, decision.reason)

        max_body = rule.settings.max_body_size
        if max_body is None:
            max_body = self._max_body
        if max_body is not None:
            length = request.content_length
            if length is not None and length > max_body:
                return errors.payload_too_large(max_body)
        return await self.forwarder.send(request, principal, request_id, max_body)


def admin_app(gateway: Gateway) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        reasons = gateway.not_ready()
        if reasons:
            return json_response({"status": "not_ready", "reasons": reasons}, status=503)
        return json_response({"status": "ready"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def upstream_session(settings: Settings) -> aiohttp.ClientSession:
    """One pooled keep-alive session to the upstream; bytes pass through untouched."""
    up = settings.upstream
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=up.max_connections, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(
            total=None,
            sock_connect=up.connect_timeout.total_seconds(),
            sock_read=up.read_timeout.total_seconds(),
        ),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        read_bufsize=settings.forward.buffer_size,
    )


def keys_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), headers={"User-Agent": USER_AGENT}
    )


class _Connection(web.RequestHandler):
    """aiohttp's per-connection protocol, answering requests it cannot parse (a header too
    long, too many headers, a broken request line) with the resource error body instead of a
    text page that echoes the request, and logging them without a traceback: they are the
    client's mistake, and a flood of them must not flood the log."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.info(
            "unparsable request refused",
            extra={"status": status, "reason": type(exc).__name__ if exc else "-"},
        )
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent on this connection")
        response = errors.bad_request(
            "The request could not be parsed (see the limits of this API)."
        )
        response.set_status(status)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


def public_server(gateway: Gateway) -> web.Server:
    """A low-level server: no router or middleware between the socket and `handle`."""
    limits = gateway.settings.limits
    return _Server(
        gateway.handle,
        # Bounds both an idle keep-alive connection and the time a client has to finish
        # sending a request head (the slowloris case).
        keepalive_timeout=limits.idle_timeout.total_seconds(),
        # After refusing a body (408, 413) the rest of it is read and dropped before the
        # connection closes, so the client sees the answer rather than a reset (RFC 9112
        # §9.6); a client that sends nothing for body_timeout meanwhile is not waited for.
        lingering_time=min(limits.body_timeout, _MAX_LINGERING).total_seconds(),
        max_line_size=limits.max_line_size,
        max_field_size=limits.max_field_size,
        max_headers=limits.max_headers,
        access_log=None,
    )


async def _settle() -> None:
    runtime.settle_memory()


async def serve(settings: Settings, *, reuse_port: bool = False) -> None:
    """Run one gateway process until SIGTERM, then drain."""
    async with upstream_session(settings) as up, keys_session() as keys:
        gateway = Gateway(settings, up, keys)
        gateway.start()
        try:
            await runtime.serve(
                [
                    runtime.Listener(
                        public_server(gateway),
                        settings.listen.host,
                        settings.listen.port,
                        "public",
                    ),
                    runtime.Listener(
                        admin_app(gateway),
                        settings.admin_listen.host,
                        settings.admin_listen.port,
                        "admin",
                    ),
                ],
                grace=settings.shutdown_grace,
                reuse_port=reuse_port,
                on_draining=lambda: setattr(gateway, "draining", True),
                started=_settle,
            )
        finally:
            await gateway.close()
