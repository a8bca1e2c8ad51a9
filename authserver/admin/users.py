"""/admin/v1/users: the people who sign in, their OpenID Connect claims and roles.

`id` is the user's `sub`: stable for the life of the account, generated unless given at
creation. The password is write-only: never echoed, never logged, hashed with scrypt on the
server's bounded hashing pool; it has at least 8 characters and is not the username.
Disabling a user (`"disabled": true`) or deleting them cuts them off (events.Revocations): their
sessions end, their grants are revoked, and they cannot sign in. Users of the
configuration file are listed but read-only (409 `managed_by_config`).

/admin/v1/users/{id}/second-factor: whether the user has an authenticator app (and how many
recovery codes are left); DELETE removes it with its recovery codes, for a user who lost
both: they sign in with the password alone again (or are led to set an app up again where
one is required). The secret itself is never shown. Users of the configuration file have
theirs too: a factor is the user's, not the file's.

/admin/v1/users/{id}/passkeys: the user's passkeys (name, when added and last used, whether
synced; never the key); DELETE /admin/v1/users/{id}/passkeys/{passkeyId} removes one, for a
user who lost the device that held it. `passkeyId` is the credential id, base64url.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from dataclasses import replace
from typing import Any

from aiohttp import web

from .. import users as passwords
from ..audit import Event
from ..declarations import DeclaredUser, claim_names
from ..events import Reason
from ..protocol import webauthn
from ..registry import plain
from ..store.base import (
    MANAGED_BY_API,
    MANAGED_BY_CONFIG,
    AlreadyExists,
    IdentityLink,
    PasskeyRecord,
    UserRecord,
)
from ..users import password_problems
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

RESOURCE = "user"
CLAIMS = tuple(camel(name) for name in claim_names())
WRITABLE = ("username", *CLAIMS, "roles", "disabled")
READ_ONLY = ("id", "managedBy", "createdAt", "updatedAt")
FIELDS = ("id", *WRITABLE, "managedBy", "createdAt", "updatedAt")

COLLECTION = Collection(
    key="id",
    fields=FIELDS,
    filters=frozenset({"id", "username", "email", "roles", "disabled", "managedBy"}),
    sortable=frozenset({"id", "username", "email", "name", "createdAt", "updatedAt"}),
    search=("username", "email", "name"),
)


def represent(r: UserRecord) -> dict[str, Any]:
    return {
        "id": r.subject,
        "username": r.username,
        **{camel(name): r.claims.get(name) for name in claim_names()},
        "roles": list(r.roles),
        "disabled": r.disabled,
        "managedBy": r.managed_by,
        "createdAt": iso(r.created_at),
        "updatedAt": iso(r.updated_at),
    }


# The identities at upstream OpenID Connect providers a user signs in with (read-only:
# made by the user's own sign-ins, removed with the user): /users/{id}/identities.
IDENTITIES = Collection(
    key="id",
    fields=("id", "issuer", "subject", "linkedAt"),
    filters=frozenset({"issuer"}),
    sortable=frozenset({"issuer", "subject", "linkedAt"}),
    search=("issuer", "subject"),
)


PASSKEYS = Collection(
    key="id",
    fields=("id", "name", "createdAt", "lastUsedAt", "backupEligible", "transports"),
    filters=frozenset({"backupEligible"}),
    sortable=frozenset({"name", "createdAt", "lastUsedAt"}),
    search=("name",),
)


def represent_passkey(record: PasskeyRecord) -> dict[str, Any]:
    return {
        "id": base64.urlsafe_b64encode(record.credential_id).rstrip(b"=").decode(),
        "name": record.name,
        "createdAt": iso(record.created_at),
        "lastUsedAt": None if record.last_used_at is None else iso(record.last_used_at),
        "backupEligible": record.backup_eligible,
        "transports": list(record.transports),
    }


def represent_identity(link: IdentityLink) -> dict[str, Any]:
    """`id` names the link without spelling out the provider's subject twice; `subject` is
    the provider's `sub`, as its ID tokens say it."""
    digest = hashlib.sha256(f"{link.issuer}\x00{link.provider_subject}".encode()).digest()
    return {
        "id": base64.urlsafe_b64encode(digest[:12]).decode(),
        "issuer": link.issuer,
        "subject": link.provider_subject,
        "linkedAt": iso(link.created_at),
    }


def new_user_id() -> str:
    """A random id for a user created without one: 128 bits, base64url, never starting with
    `-` (one in 64 would), which a command line would read as an option
    (`portcullis-authserver users delete ID`)."""
    while True:
        subject = secrets.token_urlsafe(16)
        if not subject.startswith("-"):
            return subject


class Users:
    def __init__(self, context: Context) -> None:
        self.c = context

    # ------------------------------------------------------------------ reading

    async def index(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        query = parse_query(COLLECTION, request.query)
        records = await self.c.store.list_users()
        return json_answer(page(COLLECTION, query, [represent(r) for r in records]))

    async def show(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        return single(request, represent(await self._existing(ids[0])))

    async def identities(
        self, request: web.Request, caller: Caller, ids: list[str]
    ) -> web.Response:
        query = parse_query(IDENTITIES, request.query)
        record = await self._existing(ids[0])
        links = await self.c.store.identity_links(record.subject)
        return json_answer(page(IDENTITIES, query, [represent_identity(k) for k in links]))

    async def passkeys(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        query = parse_query(PASSKEYS, request.query)
        record = await self._existing(ids[0])
        found = await self.c.store.passkeys_of(record.subject)
        return json_answer(page(PASSKEYS, query, [represent_passkey(p) for p in found]))

    async def remove_passkey(
        self, request: web.Request, caller: Caller, ids: list[str]
    ) -> web.Response:
        old = await self._existing(ids[0])
        credential_id = webauthn.base64url(ids[1], webauthn.MAX_CREDENTIAL_ID)
        if credential_id is None or not await self.c.store.delete_passkey(
            old.subject, credential_id
        ):
            raise not_found("passkey")
        if self.c.metrics is not None:
            self.c.metrics.factor_changed("passkey", "removed")
        self.c.audit(caller, Event.FACTOR_REMOVED, subject=old.subject, factor="passkey")
        return no_content()

    # ------------------------------------------------------------------ changing

    async def create(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        body = await read_object(request)
        subject = body.pop("id", None)
        if subject is None:
            subject = new_user_id()
        elif not isinstance(subject, str) or not subject:
            raise invalid([("id", "must be a non-empty string")])
        password = body.pop("password", None)
        fields, disabled, problems = self._writable(body, {})
        checked = self._check(subject, fields, password, problems, required=True)
        password_hash = await self.c.hasher.hash(password)
        now = self.c.clock()
        record = UserRecord(
            subject=subject,
            username=checked.username,
            password_hash=password_hash,
            claims=plain(checked.claims),
            roles=checked.roles,
            disabled=disabled,
            managed_by=MANAGED_BY_API,
            created_at=now,
            updated_at=now,
        )
        try:
            await self.c.store.save_user(record, None)
        except AlreadyExists:
            raise conflict("a user with this id or username exists already") from None
        self.c.audit(caller, Event.USER_CREATED, subject=subject)
        shown = represent(record)
        return json_answer(
            shown,
            status=201,
            headers={"Location": self.c.location("users", subject), "ETag": etag_of(shown)},
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
        self, request: web.Request, caller: Caller, subject: str, change: Any
    ) -> web.Response:
        old = await self._changeable(request, subject)
        current = represent(old)
        body = change(current)
        if not isinstance(body, dict):
            raise invalid([("", "the body must be a JSON object")])
        password = body.pop("password", None)
        fields, disabled, problems = self._writable(body, current)
        checked = self._check(subject, fields, password, problems, required=False)
        password_hash = (
            old.password_hash if password is None else await self.c.hasher.hash(password)
        )
        now = self.c.clock()
        record = replace(
            old,
            username=checked.username,
            password_hash=password_hash,
            claims=plain(checked.claims),
            roles=checked.roles,
            disabled=disabled,
            updated_at=now,
        )
        await self._save(request, record, old.version)
        if disabled and not old.disabled:
            await self.c.revocations.cut_off_subject(subject, Reason.USER_DISABLED)
        self.c.audit(
            caller,
            Event.USER_DISABLED if disabled and not old.disabled else Event.USER_UPDATED,
            subject=subject,
        )
        shown = represent(record)
        return json_answer(shown, headers={"ETag": etag_of(shown)})

    async def set_password(
        self, request: web.Request, caller: Caller, ids: list[str]
    ) -> web.Response:
        body = await read_object(request)
        old = await self._changeable(request, ids[0])
        unknown = [(name, "unknown field; known: password") for name in body if name != "password"]
        problems = unknown + password_problems(body.get("password"), old.username)
        if problems:
            raise invalid(problems)
        record = replace(
            old,
            password_hash=await self.c.hasher.hash(body["password"]),
            updated_at=self.c.clock(),
        )
        await self._save(request, record, old.version)
        self.c.audit(caller, Event.USER_PASSWORD_SET, subject=old.subject)
        return no_content()

    async def second_factor(
        self, request: web.Request, caller: Caller, ids: list[str]
    ) -> web.Response:
        old = await self._existing(ids[0])
        record = await self.c.store.get_totp(old.subject)
        if record is None or not record.confirmed or record.confirmed_at is None:
            raise not_found("second factor")
        return json_answer(
            {
                "kind": "totp",
                "createdAt": iso(record.confirmed_at),
                "recoveryCodesLeft": record.recovery_codes_left,
            }
        )

    async def remove_second_factor(
        self, request: web.Request, caller: Caller, ids: list[str]
    ) -> web.Response:
        old = await self._existing(ids[0])
        if not await self.c.store.delete_totp(old.subject):
            raise not_found("second factor")
        if self.c.metrics is not None:
            self.c.metrics.factor_changed("totp", "removed")
        self.c.audit(caller, Event.FACTOR_REMOVED, subject=old.subject)
        return no_content()

    async def delete(self, request: web.Request, caller: Caller, ids: list[str]) -> web.Response:
        old = await self._changeable(request, ids[0])
        if not await self.c.store.delete_user(old.subject):
            raise not_found(RESOURCE)
        await self.c.revocations.cut_off_subject(old.subject, Reason.USER_DELETED)
        self.c.audit(caller, Event.USER_DELETED, subject=old.subject)
        return no_content()

    # ------------------------------------------------------------------ steps

    async def _existing(self, subject: str) -> UserRecord:
        record = await self.c.store.get_user(subject)
        if record is None:
            raise not_found(RESOURCE)
        return record

    async def _changeable(self, request: web.Request, subject: str) -> UserRecord:
        record = await self._existing(subject)
        check_if_match(request, etag_of(represent(record)))
        if record.managed_by == MANAGED_BY_CONFIG:
            raise managed_by_config(RESOURCE)
        return record

    async def _save(self, request: web.Request, record: UserRecord, version: int) -> None:
        try:
            saved = await self.c.store.save_user(record, version)
        except AlreadyExists:
            raise conflict("another user has this username") from None
        if not saved:
            raise ApiError(
                412 if "If-Match" in request.headers else 409,
                "precondition_failed" if "If-Match" in request.headers else "conflict",
                "the user changed while this request was served: read it again",
            )

    def _writable(
        self, body: dict[str, Any], current: dict[str, Any]
    ) -> tuple[dict[str, Any], bool, list[tuple[str, str]]]:
        """The writable fields of a body (snake_case, `disabled` apart), and the problems
        of unknown fields, changed read-only ones and a `disabled` that is no boolean."""
        problems = []
        fields: dict[str, Any] = {}
        disabled = False
        for name, value in body.items():
            if name in READ_ONLY:
                if value != current.get(name):
                    problems.append((name, "is read-only"))
            elif name not in WRITABLE:
                problems.append((name, f"unknown field; known: password, {', '.join(FIELDS)}"))
            elif name == "disabled":
                if not isinstance(value, bool) and value is not None:
                    problems.append((name, "must be true or false"))
                disabled = value is True
            elif value is not None:
                fields[snake(name)] = value
        return fields, disabled, problems

    def _check(
        self,
        subject: str,
        fields: dict[str, Any],
        password: Any,
        problems: list[tuple[str, str]],
        *,
        required: bool,
    ) -> DeclaredUser:
        """The user as the configuration file's rules read it, and the password's rules;
        422 listing every problem of both, and those found before (`problems`)."""
        data = {"sub": subject, **fields, "password_hash": passwords.dummy_hash()}
        username = fields.get("username")
        if password is not None or required:
            if password is None:
                problems.append(("password", "is required"))
            else:
                problems += password_problems(
                    password, username if isinstance(username, str) else ""
                )
        try:
            checked = validation.build(DeclaredUser, data, _path)
        except ApiError as exc:
            exc.details = problems + exc.details
            raise
        if problems:
            raise invalid(problems)
        return checked


def _path(key: str) -> str:
    return "id" if key == "sub" else camel(key)
