"""The HTTP conventions of the admin API, once for every resource.

- Errors: `ApiError` carries a status and the resource error body
  `{"error": {"code", "message", "details": [{"field", "issue"}]}}`; `field` is a JSON path
  into the request (`redirectUris[0]`) or a query parameter's name.
- Content negotiation: answers are JSON; a request whose `Accept` rules JSON out gets 406.
- Bodies: JSON objects only; malformed JSON is 400, anything but an object 422. PATCH takes
  `application/merge-patch+json` (RFC 7396), PUT and POST `application/json`; another media
  type is 415.
- Validators: a single resource's ETag is a digest of its representation (strong: the same
  bytes give the same tag). `If-None-Match` on a GET answers 304 when it matches; `If-Match`
  on a change answers 412 when it does not (RFC 9110 §13.1.1, §13.1.2).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from portcullis.http import error_body

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
# Answers that change with the caller's token are never stored by shared caches.
CACHE_CONTROL = "private, no-cache"


class ApiError(Exception):
    """A refusal, with its status and error body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Iterable[tuple[str, str]] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = list(details)
        # A multidict: a challenge may offer two schemes (RFC 9110 §11.6.1).
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})

    def response(self) -> web.Response:
        return web.Response(
            body=error_body(self.code, self.message, self.details),
            status=self.status,
            content_type=JSON,
            headers=self.headers,
        )


def invalid(
    details: Iterable[tuple[str, str]], message: str = "the request is invalid"
) -> ApiError:
    """422 validation_error, one detail per problem."""
    return ApiError(422, "validation_error", message, details)


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"no such {what}")


def conflict(message: str, code: str = "conflict") -> ApiError:
    return ApiError(409, code, message)


def managed_by_config(what: str) -> ApiError:
    return ApiError(
        409,
        "managed_by_config",
        f"this {what} is defined in the configuration file: change it there",
    )


def json_answer(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data),
        status=status,
        content_type=JSON,
        headers={"Cache-Control": CACHE_CONTROL, **(headers or {})},
    )


def no_content() -> web.Response:
    return web.Response(status=204, headers={"Cache-Control": CACHE_CONTROL})


# ---------------------------------------------------------------------------- negotiation


def check_accept(request: web.Request) -> None:
    """406 unless the client accepts JSON (RFC 9110 §12.5.1); no Accept accepts anything."""
    header = ",".join(request.headers.getall("Accept", []))
    if not header.strip():
        return
    for part in header.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        media = media.lower()
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0 and media in (JSON, "application/*", "*/*"):
            return
    raise ApiError(406, "not_acceptable", "this API answers application/json only")


async def read_object(request: web.Request, media_type: str = JSON) -> dict[str, Any]:
    """The request's JSON object."""
    if request.content_type != media_type:
        raise ApiError(415, "unsupported_media_type", f"send the body as {media_type}")
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "bad_request", f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid([("", "the body must be a JSON object")])
    return body


# ---------------------------------------------------------------------------- validators


def etag_of(representation: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(orjson.dumps(representation, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f'"{digest[:32]}"'


def _tags(header: str) -> list[str]:
    return [t.strip().removeprefix("W/") for t in header.split(",") if t.strip()]


def not_modified(request: web.Request, etag: str) -> bool:
    """If-None-Match on a GET: True when the client's copy is current (answer 304).
    Weak comparison, as RFC 9110 §13.1.2 asks."""
    header = request.headers.get("If-None-Match")
    if header is None:
        return False
    tags = _tags(header)
    return "*" in tags or etag in tags


def check_if_match(request: web.Request, etag: str) -> None:
    """If-Match on a change: 412 unless it names the current representation (RFC 9110
    §13.1.1: strong comparison, so a weak tag never matches)."""
    header = request.headers.get("If-Match")
    if header is None:
        return
    tags = [t.strip() for t in header.split(",") if t.strip()]
    if "*" in tags or etag in tags:
        return
    raise ApiError(
        412, "precondition_failed", "the resource changed since it was read: read it again"
    )


def single(request: web.Request, representation: Mapping[str, Any]) -> web.Response:
    """A single resource, with its ETag; 304 when the client has it already."""
    etag = etag_of(representation)
    if not_modified(request, etag):
        return web.Response(status=304, headers={"ETag": etag, "Cache-Control": CACHE_CONTROL})
    return json_answer(representation, headers={"ETag": etag})


# ---------------------------------------------------------------------------- merge patch


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 §2: a patch object changes the members it names (null removes one); any
    other patch value replaces the target whole."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = merge_patch(result.get(name), value)
    return result


# ---------------------------------------------------------------------------- names


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def iso(seconds: float) -> str:
    """ISO 8601 in UTC, to the millisecond."""
    from datetime import UTC, datetime

    return (
        datetime.fromtimestamp(seconds, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )
