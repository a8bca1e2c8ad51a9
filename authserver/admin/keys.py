"""/admin/v1/keys: the signing keys' public facts (never their private halves), and POST to
publish a successor for an algorithm's key. The key ring's rotation rules hold: the
successor is published at once and signs only once every verifier can have fetched it
(keys.publish_ahead); an algorithm whose successor is already waiting keeps it (409)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..audit import Event
from ..keys import KeyInfo
from .access import Caller
from .collection import Collection, page, parse_query
from .context import Context
from .http import (
    ApiError,
    conflict,
    etag_of,
    invalid,
    iso,
    json_answer,
    not_found,
    read_object,
    single,
)

RESOURCE = "key"
FIELDS = ("kid", "alg", "state", "createdAt", "activateAt", "retiredAt", "removeAfter")
COLLECTION = Collection(
    key="kid",
    fields=FIELDS,
    filters=frozenset({"kid", "alg", "state"}),
    sortable=frozenset({"kid", "alg", "state", "createdAt", "activateAt"}),
    search=("kid",),
)


def _when(seconds: float | None) -> str | None:
    return None if seconds is None else iso(seconds)


def represent(info: KeyInfo) -> dict[str, Any]:
    return {
        "kid": info.kid,
        "alg": info.alg,
        "state": info.state,
        "createdAt": iso(info.created_at),
        "activateAt": iso(info.active_from),
        "retiredAt": _when(info.retired_at),
        "removeAfter": _when(info.remove_after),
    }


class Keys:
    def __init__(self, context: Context) -> None:
        self.c = context

    def _view(self) -> list[KeyInfo]:
        return self.c.keyring.view(self.c.clock())

    async def index(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        query = parse_query(COLLECTION, request.query)
        return json_answer(page(COLLECTION, query, [represent(i) for i in self._view()]))

    async def show(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        for info in self._view():
            if info.kid == ids[0]:
                return single(request, represent(info))
        raise not_found(RESOURCE)

    async def publish(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        body = await read_object(request)
        algs = self.c.signing_algs
        problems = [(name, "unknown field; known: alg") for name in body if name != "alg"]
        alg = body.get("alg", self.c.access_token_alg)
        if alg not in algs:
            problems.append(("alg", f"must be one of the algorithms in use: {', '.join(algs)}"))
        if problems:
            raise invalid(problems)
        try:
            # The ring decides (the rotation rules hold) and writes the directory or the store.
            [rotation] = await self.c.keyring.rotate_keys([alg], self.c.clock())
        except OSError as exc:
            raise ApiError(
                503, "temporarily_unavailable", f"the key ring cannot be written: {exc.strerror}"
            ) from None
        shown = represent(rotation.info)
        if not rotation.created:
            raise conflict(f"a successor for {alg} is waiting already: {rotation.info.kid}")
        self.c.audit(caller, Event.KEY_PUBLISHED, kid=rotation.info.kid)
        return json_answer(
            shown,
            status=201,
            headers={
                "Location": self.c.location("keys", rotation.info.kid),
                "ETag": etag_of(shown),
            },
        )
