"""HTTP face of the orders API: routes, content negotiation, caching and error bodies.

Who is calling comes from the headers the gateway sets (X-Auth-Subject, X-Auth-Client-Id,
X-Auth-Scopes); this API never sees or checks a token. It must therefore only be reachable
through the gateway, which removes any copies of those headers a client sends.

Every failure is `{"error": {"code", "message", "details": [{"field", "issue"}]}}` with the
matching status: 400 unreadable input, 401 no caller, 404, 405, 406, 409 state conflict,
413, 415, 422 validation_error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from aiohttp import web

from .orders import (
    BadQuery,
    Conflict,
    Invalid,
    NotFound,
    Order,
    OrderStore,
    page,
    parse_query,
    sample_orders,
    select_fields,
)

log = logging.getLogger("legacy_api")

SUBJECT = "X-Auth-Subject"
CLIENT_ID = "X-Auth-Client-Id"
SCOPES = "X-Auth-Scopes"
JSON = "application/json"
PRIVATE_REVALIDATE = "private, no-cache"  # per caller; may be kept but must be revalidated

STORE = web.AppKey("store", OrderStore)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
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
        self.headers = dict(headers or {})


def encode(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(body=encode(data), status=status, content_type=JSON, headers=headers)


def error_response(error: ApiError) -> web.Response:
    body = {
        "error": {
            "code": error.code,
            "message": error.message,
            "details": [{"field": f, "issue": i} for f, i in error.details],
        }
    }
    return json_response(body, error.status, error.headers)


# ---------------------------------------------------------------------------- negotiation


def accepts_json(accept: str | None) -> bool:
    """Whether an Accept header allows application/json (RFC 9110 §12.5.1).

    The most specific matching range decides, so `*/*, application/json;q=0` refuses JSON.
    """
    if accept is None or not accept.strip():
        return True
    best: tuple[int, float] | None = None
    for item in accept.split(","):
        media, *params = (p.strip() for p in item.split(";"))
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        kind, _, sub = media.lower().partition("/")
        if (kind, sub) == ("application", "json"):
            specificity = 2
        elif (kind, sub) == ("application", "*"):
            specificity = 1
        elif (kind, sub) == ("*", "*"):
            specificity = 0
        else:
            continue
        if best is None or specificity > best[0]:
            best = (specificity, quality)
    return best is not None and best[1] > 0


def _entity_tag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def _none_match(header: str | None, etag: str) -> bool:
    """True when If-None-Match lists the tag (weak comparison, RFC 9110 §13.1.2)."""
    if header is None:
        return False
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or etag in (t.removeprefix("W/") for t in tags)


def cacheable(request: web.Request, data: Any, status: int = 200, **headers: str) -> web.Response:
    """A representation with an ETag; a GET whose If-None-Match names it gets 304."""
    body = encode(data)
    etag = _entity_tag(body)
    fixed = {"ETag": etag, "Cache-Control": PRIVATE_REVALIDATE, **headers}
    safe = request.method in ("GET", "HEAD")
    if safe and _none_match(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers=fixed)
    return web.Response(body=body, status=status, content_type=JSON, headers=fixed)


# ---------------------------------------------------------------------------- middleware


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure in the resource error body, including the router's 404 and 405."""
    try:
        if not accepts_json(request.headers.get("Accept")):
            raise ApiError(
                406,
                "not_acceptable",
                "This API answers in application/json only.",
                [("Accept", "must allow application/json")],
            )
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(
            ApiError(
                405,
                "method_not_allowed",
                f"{request.method} is not supported here.",
                headers={"Allow": allowed},
            )
        )
    except web.HTTPNotFound:
        return error_response(ApiError(404, "not_found", "There is no such resource."))
    except web.HTTPRequestEntityTooLarge:
        return error_response(ApiError(413, "payload_too_large", "The request body is too large."))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, "http_error", exc.reason))
    except Exception:
        log.exception("request failed")
        return error_response(ApiError(500, "internal_error", "Something went wrong on our side."))


# ---------------------------------------------------------------------------- helpers


def caller(request: web.Request) -> str:
    subject = request.headers.get(SUBJECT, "").strip()
    if not subject:
        raise ApiError(
            401,
            "unauthenticated",
            "No caller identity: this API is meant to be reached through the gateway.",
            [(SUBJECT, "is missing")],
            {"WWW-Authenticate": 'Bearer realm="orders-api"'},
        )
    return subject


def _store(request: web.Request) -> OrderStore:
    return request.app[STORE]


async def json_body(request: web.Request) -> Any:
    if request.content_type != JSON and not request.content_type.endswith("+json"):
        raise ApiError(
            415,
            "unsupported_media_type",
            "Send the order as application/json.",
            [("Content-Type", "must be application/json")],
        )
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(
            400, "bad_request", "The body is not valid JSON.", [("body", str(exc))]
        ) from None


def _invalid(exc: Invalid) -> ApiError:
    return ApiError(422, "validation_error", "Some fields are not valid.", exc.details)


def _bad_query(exc: BadQuery) -> ApiError:
    return ApiError(400, "bad_request", "Some query parameters cannot be used.", exc.details)


def _conflict(exc: Conflict) -> ApiError:
    return ApiError(409, "conflict", "The order's current state does not allow this.", exc.details)


def _not_found(order_id: str) -> ApiError:
    return ApiError(404, "not_found", f"There is no order {order_id}.")


def _find(request: web.Request, owner: str) -> Order:
    order_id = request.match_info["id"]
    try:
        return _store(request).get(owner, order_id)
    except NotFound:
        raise _not_found(order_id) from None


# ---------------------------------------------------------------------------- handlers


async def healthz(_: web.Request) -> web.Response:
    return json_response({"status": "ok"}, headers={"Cache-Control": "no-store"})


async def me(request: web.Request) -> web.Response:
    subject = caller(request)
    return json_response(
        {
            "subject": subject,
            "clientId": request.headers.get(CLIENT_ID),
            "scopes": request.headers.get(SCOPES, "").split(),
        },
        headers={"Cache-Control": "no-store"},
    )


async def list_orders(request: web.Request) -> web.Response:
    owner = caller(request)
    params = {name: request.query.getall(name) for name in request.query}
    try:
        result = page(_store(request).list(owner), parse_query(params))
    except BadQuery as exc:
        raise _bad_query(exc) from None
    return cacheable(request, result.to_json())


async def get_order(request: web.Request) -> web.Response:
    order = _find(request, caller(request))
    if set(request.query) - {"fields"} or len(request.query.getall("fields", ())) > 1:
        raise ApiError(
            400,
            "bad_request",
            "Some query parameters cannot be used.",
            [("query", "only fields is understood here, once")],
        )
    try:
        data = select_fields(order, request.query.get("fields"))
    except BadQuery as exc:
        raise _bad_query(exc) from None
    return cacheable(request, data)


async def create_order(request: web.Request) -> web.Response:
    owner = caller(request)
    body = await json_body(request)
    try:
        order = _store(request).create(owner, body)
    except Invalid as exc:
        raise _invalid(exc) from None
    return cacheable(request, order.to_json(), 201, Location=f"/orders/{order.id}")


async def replace_order(request: web.Request) -> web.Response:
    owner = caller(request)
    order_id = request.match_info["id"]
    body = await json_body(request)
    try:
        order = _store(request).replace(owner, order_id, body)
    except NotFound:
        raise _not_found(order_id) from None
    except Invalid as exc:
        raise _invalid(exc) from None
    except Conflict as exc:
        raise _conflict(exc) from None
    return cacheable(request, order.to_json())


async def delete_order(request: web.Request) -> web.Response:
    owner = caller(request)
    order_id = request.match_info["id"]
    try:
        _store(request).delete(owner, order_id)
    except NotFound:
        raise _not_found(order_id) from None
    except Conflict as exc:
        raise _conflict(exc) from None
    return web.Response(status=204)


def create_app(orders: Iterable[Order] | None = None) -> web.Application:
    """The API with `orders` (the sample orders when not given) in memory."""
    app = web.Application(middlewares=[errors_as_json], client_max_size=64 * 1024)
    app[STORE] = OrderStore(sample_orders() if orders is None else orders)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/me", me)
    app.router.add_get("/orders", list_orders)
    app.router.add_post("/orders", create_order)
    app.router.add_get("/orders/{id}", get_order)
    app.router.add_put("/orders/{id}", replace_order)
    app.router.add_delete("/orders/{id}", delete_order)
    return app
