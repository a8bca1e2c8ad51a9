"""Errors as the JSON endpoints answer them: RFC 6749 §5.2 bodies, never cached, and 503
`temporarily_unavailable` with Retry-After while the server cannot do its work (its store
failing, every password-hashing slot taken), whatever the handler was doing."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from ..clients import ClientAuthError
from ..protocol.errors import ErrorCode, OAuthError, TemporarilyUnavailable

log = logging.getLogger("portcullis.authserver")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_no_store(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    all_headers = {"Cache-Control": "no-store", "Pragma": "no-cache", **(headers or {})}
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=all_headers
    )


def oauth_json_error(error: OAuthError) -> web.Response:
    """RFC 6749 §5.2 error body; invalid_client after Basic gets a Basic challenge."""
    headers = {"Cache-Control": "no-store", "Pragma": "no-cache"}
    if isinstance(error, ClientAuthError) and error.basic:
        headers["WWW-Authenticate"] = 'Basic realm="portcullis", charset="UTF-8"'
    return json_no_store(error.body(), status=error.status, headers=headers)


def unavailable_json(exc: TemporarilyUnavailable) -> web.Response:
    error = OAuthError(ErrorCode.TEMPORARILY_UNAVAILABLE, "try again in a moment")
    return json_no_store(
        error.body(), status=error.status, headers={"Retry-After": str(exc.retry_after)}
    )


def log_unavailable(request: web.Request, exc: TemporarilyUnavailable) -> None:
    log.warning("temporarily unavailable", extra={"path": request.path, "reason": str(exc)})


def json_errors(handler: Handler) -> Handler:
    """`handler`, answering 503 JSON while the server is temporarily unavailable."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except TemporarilyUnavailable as exc:
            log_unavailable(request, exc)
            return unavailable_json(exc)

    return guarded
