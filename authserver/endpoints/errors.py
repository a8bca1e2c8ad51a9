"""Errors as the JSON endpoints answer them: RFC 6749 §5.2 bodies, never cached, and 503
`temporarily_unavailable` with Retry-After while the server cannot do its work (its store
failing, every password-hashing slot taken), whatever the handler was doing."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from ..clients import ClientAuthError
from ..protocol.errors import ErrorCode, OAuthError, TemporarilyUnavailable

log = logging.getLogger("portcullis.authserver")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# While the store is down every request fails alike: one line this often says so (with how
# many were not logged since), rather than a line per request flooding the log when it is
# read most. Each answer is still counted in the requests metric by status.
UNAVAILABLE_LOG_EVERY = timedelta(seconds=10)


class LogPace:
    """Whether a repeated line is due: at most one per `every`, counting those held back."""

    def __init__(self, every: timedelta, now: Callable[[], float] = time.monotonic) -> None:
        self.every = every.total_seconds()
        self.now = now
        self.last = -math.inf
        self.held_back = 0

    def due(self) -> int | None:
        """The number of lines held back since the last one when a line is due, else None."""
        now = self.now()
        if now - self.last < self.every:
            self.held_back += 1
            return None
        self.last, held, self.held_back = now, self.held_back, 0
        return held


_UNAVAILABLE_PACE = LogPace(UNAVAILABLE_LOG_EVERY)


# RFC 6749 §5.1: token responses, and every other answer of these endpoints, are not cached.
# aiohttp copies the fields it is given, so this dict is never changed.
_NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}


class JsonAnswer(NamedTuple):
    """A JSON answer before it is written: its status, its fields in order (Content-Type
    follows them) and what its body holds, written by `json_response_of`."""

    status: int
    headers: Mapping[str, str]
    data: Any


def json_answer(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> JsonAnswer:
    return JsonAnswer(status, {**_NO_STORE, **headers} if headers else _NO_STORE, data)


def json_response_of(answer: JsonAnswer) -> web.Response:
    return web.Response(
        body=orjson.dumps(answer.data),
        status=answer.status,
        content_type="application/json",
        headers=answer.headers,
    )


def json_no_store(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return json_response_of(json_answer(data, status, headers))


def oauth_error_answer(error: OAuthError, extra: Mapping[str, str] | None = None) -> JsonAnswer:
    """RFC 6749 §5.2 error body; invalid_client after Basic gets a Basic challenge."""
    headers = dict(extra or {})  # json_answer puts the no-store fields first
    if isinstance(error, ClientAuthError) and error.basic:
        headers["WWW-Authenticate"] = 'Basic realm="portcullis", charset="UTF-8"'
    return json_answer(error.body(), status=error.status, headers=headers)


def oauth_json_error(error: OAuthError, extra: Mapping[str, str] | None = None) -> web.Response:
    return json_response_of(oauth_error_answer(error, extra))


def unavailable_answer(exc: TemporarilyUnavailable) -> JsonAnswer:
    error = OAuthError(ErrorCode.TEMPORARILY_UNAVAILABLE, "try again in a moment")
    return json_answer(
        error.body(), status=error.status, headers={"Retry-After": str(exc.retry_after)}
    )


def unavailable_json(exc: TemporarilyUnavailable) -> web.Response:
    return json_response_of(unavailable_answer(exc))


def log_unavailable(path: str, exc: TemporarilyUnavailable) -> None:
    held_back = _UNAVAILABLE_PACE.due()
    if held_back is not None:
        log.warning(
            "temporarily unavailable",
            extra={"path": path, "reason": str(exc), "held_back": held_back},
        )


def json_errors_of(current: Callable[[], Handler]) -> Handler:
    """The handler `current()` gives when a request starts, answering 503 JSON while the
    server is temporarily unavailable. Choosing the handler and guarding it are one step:
    each step is a coroutine every request goes through."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await current()(request)
        except TemporarilyUnavailable as exc:
            log_unavailable(request.path, exc)
            return unavailable_json(exc)

    return guarded
