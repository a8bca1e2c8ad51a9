"""/admin/v1/clients: the clients of the server, with RFC 7591 metadata in camelCase.

A confidential client's secret is generated here, never chosen by the caller, and shown
once: in the answer that created it (or made the client confidential) and in the answer of
`POST /clients/{id}/secret`, which replaces it. The store keeps only its digest. Rotating
the secret, changing its `tokenEndpointAuthMethod` or deleting the client cuts it off
(events.Revocations). Clients of the configuration file are listed but read-only (409
`managed_by_config`). Clients that registered themselves (`managedBy: dynamic`, RFC 7591)
are listed and may be deleted, which cuts them off; their registration is theirs to change
(409 `managed_by_registration`). Clients described by their metadata document
(`managedBy: metadata_document`, their clientId the document's URL) are listed as last
fetched; only `blocked` may be set (PUT or PATCH): a blocked one is refused wherever it is
named and nothing is fetched for it, and blocking cuts off its tokens. Deleting one forgets
it until it is next used.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from aiohttp import web

from .. import registry
from ..audit import Event
from ..declarations import DeclaredClient, unknown_scopes
from ..events import Reason
from ..store.base import (
    MANAGED_BY_API,
    MANAGED_BY_CONFIG,
    MANAGED_BY_DYNAMIC,
    MANAGED_BY_METADATA_DOCUMENT,
    AlreadyExists,
    ClientRecord,
)
from . import validation
from .access import Caller
from .collection import Collection, page, parse_query
from .context import Context
from .http import (
    MERGE_PATCH,
    ApiError,
    camel,
    check_if_match,
    conflict,
    etag_of,
    invalid,
    iso,
    json_answer,
    managed_by_config,
    merge_patch,
    no_content,
    not_found,
    read_object,
    single,
    snake,
)

RESOURCE = "client"
WRITABLE = tuple(camel(name) for name in registry.CLIENT_METADATA)
READ_ONLY = ("clientId", "managedBy", "blocked", "createdAt", "updatedAt")
FIELDS = ("clientId", *WRITABLE, "managedBy", "blocked", "createdAt", "updatedAt")
_SECRET_METHODS = ("client_secret_basic", "client_secret_post")
# RFC 7591 §2: a client registered without a method authenticates with client_secret_basic.
DEFAULT_METHOD = "client_secret_basic"

COLLECTION = Collection(
    key="clientId",
    fields=FIELDS,
    filters=frozenset(
        {"clientId", "tokenEndpointAuthMethod", "grantTypes", "managedBy", "applicationType"}
    ),
    sortable=frozenset({"clientId", "clientName", "createdAt", "updatedAt", "managedBy"}),
    search=("clientId", "clientName"),
)


def represent(r: ClientRecord) -> dict[str, Any]:
    client = registry.client_from_record(r)
    values = {name: r.metadata.get(name) for name in registry.CLIENT_METADATA}
    values["client_name"] = client.client_name
    return {
        "clientId": r.client_id,
        **{camel(name): value for name, value in values.items()},
        "managedBy": r.managed_by,
        "blocked": r.blocked,
        "createdAt": iso(r.created_at),
        "updatedAt": iso(r.updated_at),
    }


class Clients:
    def __init__(self, context: Context) -> None:
        self.c = context

    # ------------------------------------------------------------------ reading

    async def index(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        query = parse_query(COLLECTION, request.query)
        records = await self.c.store.list_clients()
        return json_answer(page(COLLECTION, query, [represent(r) for r in records]))

    async def show(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        return single(request, represent(await self._existing(ids[0])))

    # ------------------------------------------------------------------ changing

    async def create(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        body = await read_object(request)
        client_id = body.pop("clientId", None)
        if client_id is None:
            client_id = secrets.token_urlsafe(12)
        elif not isinstance(client_id, str):
            raise invalid([("clientId", "must be a string")])
        fields = self._writable(body, {})
        secret = secrets.token_urlsafe(32)
        checked = self._check(client_id, fields, secret)
        needs_secret = checked.token_endpoint_auth_method in _SECRET_METHODS
        now = self.c.clock()
        record = registry.client_record(
            checked,
            MANAGED_BY_API,
            now,
            secret_sha256=registry.secret_digest(secret) if needs_secret else None,
        )
        if not needs_secret:
            record = replace(record, secret_sha256=None)
        try:
            await self.c.store.save_client(record, None)
        except AlreadyExists:
            raise conflict(f"a client {client_id!r} exists already") from None
        self.c.audit(caller, Event.CLIENT_CREATED, client_id=client_id)
        shown = represent(record)
        answer = {**shown, "clientSecret": secret} if needs_secret else shown
        return json_answer(
            answer,
            status=201,
            headers={"Location": self.c.location("clients", client_id), "ETag": etag_of(shown)},
        )

    async def replace(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        body = await read_object(request)
        return await self._update(request, caller, ids[0], lambda current: body)

    async def patch(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        patch = await read_object(request, MERGE_PATCH)
        return await self._update(
            request, caller, ids[0], lambda current: merge_patch(current, patch)
        )

    async def _update(
        self, request: web.Request, caller: Caller, client_id: str, change: Any
    ) -> web.Response:
        old = await self._changeable(request, client_id, documents=True)
        current = represent(old)
        if old.managed_by == MANAGED_BY_METADATA_DOCUMENT:
            return await self._block(request, caller, old, change(current))
        fields = self._writable(change(current), current)
        secret = secrets.token_urlsafe(32)
        checked = self._check(client_id, fields, secret)
        now = self.c.clock()
        needs_secret = checked.token_endpoint_auth_method in _SECRET_METHODS
        new_secret = needs_secret and old.secret_sha256 is None
        digest = old.secret_sha256 if needs_secret else None
        if new_secret:
            digest = registry.secret_digest(secret)
        # What was obtained under one way of authenticating must not outlive it: made
        # public, the client's refresh tokens would be redeemed with its client_id alone
        # (RFC 9700 §4.14.2). Any change of method cuts the client off, as a new secret does.
        method_changed = (
            registry.client_from_record(old).token_endpoint_auth_method
            != checked.token_endpoint_auth_method
        )
        record = replace(
            registry.client_record(checked, MANAGED_BY_API, now, secret_sha256=digest),
            secret_sha256=digest,
            created_at=old.created_at,
            tokens_valid_from=now if method_changed else old.tokens_valid_from,
        )
        await self._save(request, record, old.version)
        if method_changed:
            await self.c.revocations.cut_off_client(client_id, Reason.CLIENT_AUTH_METHOD_CHANGED)
        self.c.audit(caller, Event.CLIENT_UPDATED, client_id=client_id)
        shown = represent(record)
        answer = {**shown, "clientSecret": secret} if new_secret else shown
        return json_answer(answer, headers={"ETag": etag_of(shown)})

    async def _block(
        self, request: web.Request, caller: Caller, old: ClientRecord, body: Any
    ) -> web.Response:
        """A metadata document's client: `blocked` set, nothing else changed."""
        current = represent(old)
        if not isinstance(body, dict):
            raise invalid([("", "the body must be a JSON object")])
        changed = sorted(k for k in set(body) | set(current) if body.get(k) != current.get(k))
        if changed != ["blocked"] and changed:
            raise conflict(
                "this client is described by its metadata document: only blocked may be set",
                "managed_by_metadata_document",
            )
        blocked = body.get("blocked", old.blocked)
        if not isinstance(blocked, bool):
            raise invalid([("blocked", "must be true or false")])
        record = replace(old, blocked=blocked, updated_at=self.c.clock())
        await self._save(request, record, old.version)
        if blocked and not old.blocked:
            await self.c.revocations.cut_off_client(old.client_id, Reason.CLIENT_BLOCKED)
        self.c.audit(
            caller,
            Event.CLIENT_BLOCKED if blocked else Event.CLIENT_UNBLOCKED,
            client_id=old.client_id,
        )
        shown = represent(replace(record, version=old.version + 1))
        return json_answer(shown, headers={"ETag": etag_of(shown)})

    async def rotate_secret(
        self, request: web.Request, caller: Caller, ids: list[str]
    ) -> web.Response:
        old = await self._changeable(request, ids[0])
        if old.metadata.get("token_endpoint_auth_method") not in _SECRET_METHODS:
            raise conflict("this client authenticates without a secret")
        secret = secrets.token_urlsafe(32)
        now = self.c.clock()
        record = replace(
            old,
            secret_sha256=registry.secret_digest(secret),
            updated_at=now,
            tokens_valid_from=now,
        )
        await self._save(request, record, old.version)
        # The old secret is refused from now on; what was obtained with it ends too.
        await self.c.revocations.cut_off_client(old.client_id, Reason.CLIENT_SECRET_ROTATED)
        self.c.audit(caller, Event.CLIENT_SECRET_ROTATED, client_id=old.client_id)
        shown = represent(record)
        return json_answer({**shown, "clientSecret": secret}, headers={"ETag": etag_of(shown)})

    async def delete(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        old = await self._changeable(request, ids[0], deleting=True)
        if not await self.c.store.delete_client(old.client_id):
            raise not_found(RESOURCE)
        await self.c.revocations.cut_off_client(old.client_id, Reason.CLIENT_DELETED)
        self.c.audit(caller, Event.CLIENT_DELETED, client_id=old.client_id)
        return no_content()

    # ------------------------------------------------------------------ steps

    async def _existing(self, client_id: str) -> ClientRecord:
        record = await self.c.store.get_client(client_id)
        if record is None:
            raise not_found(RESOURCE)
        return record

    async def _changeable(
        self,
        request: web.Request,
        client_id: str,
        *,
        deleting: bool = False,
        documents: bool = False,
    ) -> ClientRecord:
        """The client, if this request may change it: `deleting` it, or setting what a
        metadata document's client lets be set (`documents`)."""
        record = await self._existing(client_id)
        check_if_match(request, etag_of(represent(record)))
        if record.managed_by == MANAGED_BY_CONFIG:
            raise managed_by_config(RESOURCE)
        if record.managed_by == MANAGED_BY_METADATA_DOCUMENT and not (deleting or documents):
            raise conflict(
                "this client is described by its metadata document: only blocked may be set",
                "managed_by_metadata_document",
            )
        if record.managed_by == MANAGED_BY_DYNAMIC and not deleting:
            raise conflict(
                "this client registered itself (RFC 7591) and changes its own registration:"
                " it can only be deleted here",
                "managed_by_registration",
            )
        return record

    async def _save(self, request: web.Request, record: ClientRecord, version: int) -> None:
        if not await self.c.store.save_client(record, version):
            raise ApiError(
                412 if "If-Match" in request.headers else 409,
                "precondition_failed" if "If-Match" in request.headers else "conflict",
                "the client changed while this request was served: read it again",
            )

    def _writable(self, body: Any, current: dict[str, Any]) -> dict[str, Any]:
        """The writable fields of a body, snake_case; 422 for unknown fields and changed
        read-only ones."""
        if not isinstance(body, dict):
            raise invalid([("", "the body must be a JSON object")])
        problems = []
        fields: dict[str, Any] = {}
        for name, value in body.items():
            if name in READ_ONLY:
                if value != current.get(name):
                    problems.append((name, "is read-only"))
            elif name == "clientSecret":
                problems.append((name, "is generated: rotate it with POST .../secret"))
            elif name not in WRITABLE:
                problems.append((name, f"unknown field; known: {', '.join(FIELDS)}"))
            elif value is not None:
                fields[snake(name)] = value
        if problems:
            raise invalid(problems)
        return fields

    def _check(self, client_id: str, fields: dict[str, Any], secret: str) -> DeclaredClient:
        """The client as the configuration file's rules read it (declarations.py); 422
        otherwise."""
        data = {"client_id": client_id, **fields}
        data.setdefault("token_endpoint_auth_method", DEFAULT_METHOD)
        if data["token_endpoint_auth_method"] in _SECRET_METHODS:
            data["client_secret"] = secret  # generated: satisfies the rules on secrets
        checked = validation.build(DeclaredClient, data)
        unknown = unknown_scopes(checked.scope, self.c.known_scopes)
        if unknown:
            raise invalid(
                [("scope", f"{token!r} is not a scope of this server") for token in unknown]
            )
        return checked
