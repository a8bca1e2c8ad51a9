"""The admin API's front: one handler for every path under `{issuer}/admin/v1`, which
authorises the caller, negotiates, routes to the resource's method and renders every
refusal with the resource error body.

Per request, in order: `openapi.json` is answered to anyone (it is documentation); the
caller is authorised (access.py); `Accept` must allow JSON (406); the path must be one of
the routes below (404), with one of its methods (405, with `Allow`). A store or hashing
pool that cannot serve gives 503 with `Retry-After`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import unquote

from aiohttp import web

from ..protocol.errors import TemporarilyUnavailable
from .access import AdminAccess, Caller
from .clients import Clients
from .context import Context
from .grants import Grants
from .http import ApiError, check_accept, json_answer
from .keys import Keys
from .openapi import document
from .users import Users

log = logging.getLogger("portcullis.authserver.admin")

PREFIX = "/admin/v1"
Operation = Callable[[web.Request, Caller, list[str]], Awaitable[web.StreamResponse]]
RETRY_AFTER = "1"


@dataclass(frozen=True)
class Route:
    pattern: tuple[str, ...]  # path segments; "*" is an id
    methods: dict[str, Operation]

    def match(self, segments: list[str]) -> list[str] | None:
        if len(segments) != len(self.pattern):
            return None
        ids = []
        for want, got in zip(self.pattern, segments, strict=True):
            if want == "*":
                if not got:
                    return None
                ids.append(got)
            elif want != got:
                return None
        return ids


class AdminApi:
    def __init__(self, context: Context, access: AdminAccess, path: str) -> None:
        self.access = access
        self.path = path  # the API's path on the server: the issuer's path and PREFIX
        clients, users = Clients(context), Users(context)
        grants, keys = Grants(context), Keys(context)
        self.routes = [
            Route(("clients",), {"GET": clients.index, "POST": clients.create}),
            Route(
                ("clients", "*"),
                {
                    "GET": clients.show,
                    "PUT": clients.replace,
                    "PATCH": clients.patch,
                    "DELETE": clients.delete,
                },
            ),
            Route(("clients", "*", "secret"), {"POST": clients.rotate_secret}),
            Route(("users",), {"GET": users.index, "POST": users.create}),
            Route(
                ("users", "*"),
                {
                    "GET": users.show,
                    "PUT": users.replace,
                    "PATCH": users.patch,
                    "DELETE": users.delete,
                },
            ),
            Route(("users", "*", "password"), {"POST": users.set_password}),
            Route(
                ("users", "*", "second-factor"),
                {"GET": users.second_factor, "DELETE": users.remove_second_factor},
            ),
            Route(("users", "*", "identities"), {"GET": users.identities}),
            Route(("users", "*", "passkeys"), {"GET": users.passkeys}),
            Route(("users", "*", "passkeys", "*"), {"DELETE": users.remove_passkey}),
            Route(("grants",), {"GET": grants.index}),
            Route(("grants", "*"), {"GET": grants.show, "DELETE": grants.delete}),
            Route(("keys",), {"GET": keys.index, "POST": keys.publish}),
            Route(("keys", "*"), {"GET": keys.show}),
        ]
        self.document = document(context.base_url)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._serve(request)
        except ApiError as exc:
            return exc.response()
        except TemporarilyUnavailable as exc:
            log.warning("admin request refused: unavailable", extra={"reason": str(exc)})
            return ApiError(
                503,
                "temporarily_unavailable",
                "the server cannot serve this now: try again shortly",
                headers={"Retry-After": RETRY_AFTER},
            ).response()
        except Exception:
            log.exception("admin request failed")
            return ApiError(500, "internal_error", "the server failed to serve this").response()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        # Ids are taken from the path as sent, each segment decoded once: an id may hold
        # an encoded "/".
        raw_tail = request.rel_url.raw_path[len(self.path) :]
        tail = raw_tail.removeprefix("/")
        segments = [unquote(s) for s in tail.split("/")] if tail else []
        method = "GET" if request.method == "HEAD" else request.method
        if segments == ["openapi.json"] and method == "GET":
            check_accept(request)
            return json_answer(self.document)
        # The URL the request was sent to, as a DPoP proof names it (RFC 9449 §4.3: query
        # and fragment left out): the API's URL under the issuer, and the path below it.
        caller = await self.access.caller(request, self.access.audience + raw_tail)
        check_accept(request)
        for route in self.routes:
            ids = route.match(segments)
            if ids is None:
                continue
            operation = route.methods.get(method)
            if operation is None:
                allowed = ", ".join(
                    sorted({*route.methods, "HEAD"} if "GET" in route.methods else route.methods)
                )
                raise ApiError(
                    405,
                    "method_not_allowed",
                    f"{request.method} is not allowed here",
                    headers={"Allow": allowed},
                )
            return await operation(request, caller, ids)
        raise ApiError(404, "not_found", "no such resource in this API")
