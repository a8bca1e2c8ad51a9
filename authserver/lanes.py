"""The token endpoint in the lane (portcullis/lane.py): `POST {base}/token` answered without
aiohttp's request, router, middleware and response objects, which cost as much as the
endpoint's own work on a client_credentials request.

The lane does what that path does, in the same order, and answers with the same bytes:
- the request is counted by status under the endpoint name `token` (app._counted);
- a 503 `temporarily_unavailable` while the store fails (endpoints/errors.json_errors_of);
- the CORS fields of an answer to a request without `Origin` (cors.middleware);
- TokenEndpoint.answer in between, given the body the lane read.
It takes only what it can answer alike: the lane admits a request with no `Origin` (a
browser's cross-origin request needs the CORS middleware's client check) whose
`Content-Type` is exactly the url-encoded form's. Everything else goes through aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import orjson

from portcullis.lane import LaneAnswer, LaneRequest

from .cors import FORM, MAX_FORM_BYTES
from .cors import endpoints as cors_endpoints
from .endpoints.errors import log_unavailable, unavailable_answer
from .endpoints.forms import body_form
from .endpoints.token import TokenEndpoint
from .metrics import Metrics
from .protocol.cors import CorsPolicy
from .protocol.errors import TemporarilyUnavailable

_JSON = ("Content-Type", "application/json")


class Serving(Protocol):
    """What the lane reads of the Components in force (app.Components)."""

    @property
    def token(self) -> TokenEndpoint: ...

    @property
    def cors(self) -> CorsPolicy: ...


class TokenLane:
    max_body = MAX_FORM_BYTES

    def __init__(self, current: Callable[[], Serving | None], metrics: Metrics, base: str) -> None:
        self._current = current
        self._metrics = metrics
        self.path = base + "/token"
        self.request_line = f"POST {self.path} HTTP/1.1".encode()
        self._endpoint = cors_endpoints(base)[self.path]

    def admits(self, request: LaneRequest) -> bool:
        if self._current() is None or "origin" in request.fields:
            return False
        content_type = request.fields.get("content-type")
        return (
            content_type is not None and len(content_type) == 1 and content_type[0].lower() == FORM
        )

    async def answer(self, request: LaneRequest) -> LaneAnswer:
        serving = self._current()
        assert serving is not None  # admitted
        status = 500
        try:
            try:
                answer = await serving.token.answer(
                    body_form(request.body), request.getall("dpop"), request.get("authorization")
                )
            except TemporarilyUnavailable as exc:
                log_unavailable(self.path, exc)
                answer = unavailable_answer(exc)
            status = answer.status
            return LaneAnswer(
                status,
                [*answer.headers.items(), _JSON, *serving.cors.actual(self._endpoint, None)],
                orjson.dumps(answer.data),
            )
        except asyncio.CancelledError:
            status = 499  # the server stopped waiting for it (a shutdown), as app._counted
            raise
        finally:
            self._metrics.request("token", status)
