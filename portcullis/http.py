"""HTTP helpers shared by both services: JSON responses and the resource error body.

The resource error body is `{"error": {"code", "message", "details": [{"field", "issue"}]}}`;
it is what the gateway and any admin API answer on failure, never a 200 with a failure inside.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from aiohttp import web

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
