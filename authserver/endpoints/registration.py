"""POST /register (RFC 7591 §3) and GET / DELETE /register/{client_id} (RFC 7592 §2).

POST, in order:
 1. `registration.rate` registrations per client address (protocol/throttle.py's Cap, kept
    in the store, so every replica counts alike), else 429 with Retry-After;
 2. an Authorization header is the initial access token (RFC 7591 §3, Bearer): a wrong
    one is 401 invalid_token; the right one lets the client be confidential;
 3. the JSON body, read once: authserver/registration.py applies the rules, else 400
    invalid_client_metadata or invalid_redirect_uri (RFC 7591 §3.2.2), nothing stored;
 4. the client stored; 201 with the client information response (RFC 7591 §3.2.1): the
    metadata registered, `client_id`, `registration_access_token`,
    `registration_client_uri`, and for a confidential client its generated
    `client_secret` (`client_secret_expires_at` 0), shown this once. Never cached.
GET and DELETE need the registration access token of that client (Bearer); without it, or
for a client that is gone, 401 invalid_token, the same either way (RFC 7592 §3). DELETE
removes the client and cuts off every token it was given: 204. PUT is not offered (405):
a client changes its registration by registering again.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from portcullis.addresses import ClientAddresses

from .. import accesslog, audit
from ..audit import Event
from ..clock import Clock
from ..events import Reason, Revocations
from ..protocol.throttle import Cap
from ..registration import (
    RegistrationError,
    RegistrationPolicy,
    register,
    represent,
    token_matches,
)
from ..store.base import MANAGED_BY_DYNAMIC, AlreadyExists, ClientRecord, Store
from .errors import json_no_store
from .signin import client_address

log = logging.getLogger("portcullis.authserver.registration")

MAX_BODY = 64 * 1024  # a registration is a few hundred bytes; a key set a few thousand
ATTEMPTS = 3  # client ids are random: a clash is drawn again, and never twice but by a bug


class RegistrationEndpoint:
    def __init__(
        self,
        *,
        store: Store,
        policy: RegistrationPolicy,
        rate: Cap,  # its key: the prefix the client address is appended to
        addresses: ClientAddresses,
        revocations: Revocations,
        url: str,
        clock: Clock,
    ) -> None:
        self.store = store
        self.policy = policy
        self.rate = rate
        self.addresses = addresses
        self.revocations = revocations
        self.url = url  # {issuer}/register
        self.clock = clock

    async def register(self, request: web.Request) -> web.Response:
        now = self.clock()
        address = client_address(self.addresses, request)
        cap = Cap(self.rate.key + address, limit=self.rate.limit, window=self.rate.window)  # 1
        refused = await self.store.reserve_attempt([cap], now)
        if refused is not None:
            log.warning("registration throttled")
            return _error(
                429,
                "too_many_requests",
                "too many registrations from this address: try again later",
                {"Retry-After": str(max(1, int(refused.retry_after)))},
            )
        confidential_allowed = False
        authorization = request.headers.get("Authorization")  # 2
        if authorization is not None:
            token = _bearer(authorization)
            if token is None or not self.policy.initial_access_token_valid(token):
                log.info("registration refused: initial access token invalid")
                return _invalid_token()
            confidential_allowed = True
        try:
            body = await _json_body(request)  # 3
            for _ in range(ATTEMPTS):
                made = register(
                    body, self.policy, confidential_allowed=confidential_allowed, now=now
                )
                try:
                    await self.store.save_client(made.record, None)  # 4
                    break
                except AlreadyExists:
                    continue
            else:
                raise RuntimeError("random client ids kept clashing")
        except RegistrationError as exc:
            log.info("registration refused", extra={"error": exc.code})
            return _error(400, exc.code, exc.description)
        record = made.record
        audit.record(Event.CLIENT_REGISTERED, audit.CLIENT, client_id=record.client_id)
        answer = {
            **represent(record, self._client_uri(record.client_id)),
            "registration_access_token": made.registration_access_token,
        }
        if made.client_secret is not None:
            answer["client_secret"] = made.client_secret
            answer["client_secret_expires_at"] = 0  # RFC 7591 §3.2.1: it does not expire
        return json_no_store(
            answer, status=201, headers={"Location": self._client_uri(record.client_id)}
        )

    async def read(self, request: web.Request) -> web.Response:
        record = await self._authorized(request)
        if record is None:
            return _invalid_token()
        return json_no_store(represent(record, self._client_uri(record.client_id)))

    async def delete(self, request: web.Request) -> web.Response:
        record = await self._authorized(request)
        if record is None:
            return _invalid_token()
        if await self.store.delete_client(record.client_id):
            await self.revocations.cut_off_client(record.client_id, Reason.CLIENT_DELETED)
            audit.record(Event.CLIENT_DELETED, audit.CLIENT, client_id=record.client_id)
        return web.Response(status=204, headers={"Cache-Control": "no-store"})

    async def _authorized(self, request: web.Request) -> ClientRecord | None:
        """The client the path names, if the request carries its registration access token
        and it is still registered (not past its time to obtain a token)."""
        token = _bearer(request.headers.get("Authorization", ""))
        if token is None:
            return None
        record = await self.store.get_client(request.match_info["client_id"])
        if record is None or record.managed_by != MANAGED_BY_DYNAMIC:
            return None
        if record.unused_until is not None and record.unused_until <= self.clock():
            return None
        if not token_matches(record, token):
            return None
        accesslog.client_known(record.client_id)
        return record

    def _client_uri(self, client_id: str) -> str:
        return f"{self.url}/{client_id}"  # client ids are URL-safe base64


async def _json_body(request: web.Request) -> object:
    if request.content_type != "application/json":
        raise RegistrationError(
            "invalid_client_metadata", "send the registration as application/json"
        )
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise RegistrationError("invalid_client_metadata", "the registration is too large")
    raw = await request.content.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise RegistrationError("invalid_client_metadata", "the registration is too large")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise RegistrationError("invalid_client_metadata", "the body is not JSON") from None


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _error(
    status: int, code: str, description: str, headers: dict[str, str] | None = None
) -> web.Response:
    return json_no_store({"error": code, "error_description": description}, status, headers)


def _invalid_token() -> web.Response:
    # RFC 6750 §3, as RFC 7591 §3 and RFC 7592 §3 point to.
    return _error(
        401,
        "invalid_token",
        "the access token is missing, invalid or not this client's",
        {"WWW-Authenticate": 'Bearer error="invalid_token"'},
    )
