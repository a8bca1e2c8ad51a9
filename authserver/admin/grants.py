"""/admin/v1/grants: what users granted clients. A grant starts when a code or device code
is redeemed; it holds the refresh family and the access tokens issued under it. DELETE
revokes it: the family and those tokens end (introspection says inactive)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..audit import Event
from ..store.base import GrantSummary
from .access import Caller
from .collection import Collection, page, parse_query
from .context import Context
from .http import check_if_match, etag_of, iso, json_answer, no_content, not_found, single

RESOURCE = "grant"
FIELDS = (
    "id",
    "clientId",
    "subject",
    "scopes",
    "refreshFamily",
    "createdAt",
    "lastUsedAt",
    "expiresAt",
    "revokedAt",
)
COLLECTION = Collection(
    key="id",
    fields=FIELDS,
    filters=frozenset({"subject", "clientId"}),
    sortable=frozenset({"id", "clientId", "subject", "createdAt", "lastUsedAt", "expiresAt"}),
    search=("clientId", "subject"),
)


def represent(s: GrantSummary) -> dict[str, Any]:
    g = s.grant
    return {
        "id": g.grant_id,
        "clientId": g.client_id,
        "subject": g.subject,
        "scopes": s.scope.split(),
        # The refresh tokens of a grant are its family, named after it.
        "refreshFamily": g.grant_id if s.refresh_family else None,
        "createdAt": iso(g.created_at),
        "lastUsedAt": iso(s.last_used_at),
        "expiresAt": iso(g.expires_at),
        "revokedAt": None if g.revoked_at is None else iso(g.revoked_at),
    }


class Grants:
    def __init__(self, context: Context) -> None:
        self.c = context

    async def index(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        query = parse_query(COLLECTION, request.query)
        # One value of a filter narrows in the store; several (OR) are applied here.
        client = query.filters.get("clientId", ())
        subject = query.filters.get("subject", ())
        found = await self.c.store.list_grants(
            client_id=client[0] if len(client) == 1 else None,
            subject=subject[0] if len(subject) == 1 else None,
        )
        return json_answer(page(COLLECTION, query, [represent(s) for s in found]))

    async def show(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        return single(request, represent(await self._existing(ids[0])))

    async def delete(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        summary = await self._existing(ids[0])
        check_if_match(request, etag_of(represent(summary)))
        # Revoking a revoked grant changes nothing: DELETE is idempotent.
        await self.c.store.revoke_grant(summary.grant.grant_id, self.c.clock())
        grant = summary.grant
        self.c.audit(
            caller,
            Event.GRANT_REVOKED,
            grant_id=grant.grant_id,
            client_id=grant.client_id,
            subject=grant.subject,
        )
        return no_content()

    async def _existing(self, grant_id: str) -> GrantSummary:
        grant = await self.c.store.get_grant(grant_id)
        if grant is not None:
            for summary in await self.c.store.list_grants(grant.client_id, grant.subject):
                if summary.grant.grant_id == grant_id:
                    return summary
        raise not_found(RESOURCE)
