"""HTTP helpers shared by both services: JSON responses and the resource error body.

The resource error body is `{"error": {"code", "message", "details": [{"field", "issue"}]}}`;
it is what the gateway and any admin API answer on failure, never a 200 with a failure inside.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

JSON = "application/json"


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type=JSON, headers=headers)


def error_body(code: str, message: str, details: Iterable[tuple[str, str]] = ()) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "code": code,
                "message": message,
                "details": [{"field": field, "issue": issue} for field, issue in details],
            }
        }
    )


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    details: Iterable[tuple[str, str]] = (),
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=error_body(code, message, details),
        status=status,
        content_type=JSON,
        headers=headers,
    )


def unparsable_status(exc: BaseException | None, request_line_limit: int) -> int:
    """The status for a request the parser refused: 414 for a request line over its limit
    (RFC 9112 §3), 431 for a header field over its limit or too many fields (RFC 6585 §5),
    else 400. aiohttp reports both lines too long alike, with the limit they broke: the
    field limit must differ from the request-line limit (`field_limit`)."""
    if isinstance(exc, LineTooLong):
        return 414 if exc.args[1] == request_line_limit else 431
    if isinstance(exc, BadHttpMessage) and exc.message == _TOO_MANY_HEADERS:
        return 431
    return 400


def field_limit(max_field_size: int, max_line_size: int) -> int:
    """The header field limit to give aiohttp's parser: one byte more than configured when
    it equals the request line's, so that `unparsable_status` tells the two apart."""
    return max_field_size + (max_field_size == max_line_size)


def unparsable(status: int) -> web.Response:
    """A request the server could not read: 414 for a request line over the limit (RFC 9112
    §3), 431 for header fields over theirs (RFC 6585 §5), 400 for anything else. The body
    never echoes what was sent, and the connection closes: where the next request would
    begin is not known."""
    code, message = _UNPARSABLE.get(
        status, ("bad_request", "The request could not be parsed (see the limits of this API).")
    )
    response = error_response(status, code, message)
    response.force_close()
    return response


_TOO_MANY_HEADERS = "Too many headers received"  # aiohttp's parser, past max_headers
_UNPARSABLE = {
    414: ("uri_too_long", "The request line is longer than this API accepts."),
    431: (
        "header_fields_too_large",
        "The request's header fields are larger, or more, than this API accepts.",
    ),
}
