"""Revocation events: recorded in the store, signed as Security Event Tokens, streamed.

A resource server that validates JWTs itself cannot see a revocation. This server tells it:
every revocation is recorded as an event in the store, in the transaction of the revocation
(store/base.py), and `GET /revocation_events` streams the log to resource servers as
Server-Sent Events (HTML Living Standard §9.2), each event's data a Security Event Token
(RFC 8417) signed with the key that signs access tokens, so that a receiver verifies it
with the JWKS it already trusts.

The events (a SET's `events` claim holds exactly one), in the shape of the OpenID Shared
Signals / CAEP events, with subject identifiers of RFC 9493:

- `TOKENS_REVOKED`: access tokens named by jti: `{"tokens": [{"jti", "exp"}], "reason"}`.
  From /revoke (an access token, or a refresh token's grant), refresh token reuse, and a
  code or device code redeemed twice (the grant's access tokens still valid).
- `SUBJECT_TOKENS_REVOKED`: `{"subject": {"format": "iss_sub", "iss", "sub"},
  "issued_before", "exp", "reason"}`: every token of the subject whose `iat` is before
  `issued_before` is revoked; the last of them expires by `exp`.
- `CLIENT_TOKENS_REVOKED`: the same for a client: `{"subject": {"format": "opaque", "id":
  client_id}, "issued_before", "exp", "reason"}`.

The SET: header `typ: secevent+jwt` (RFC 8417 §2.3), claims `iss`, `iat`, `jti` (the event
id, also the SSE `id:`), `toe` (when it was recorded) and `events`; no `sub` or `exp`, so it
is never taken for an access token (§4.2), and no `aud`: one SET is served to every
subscriber, each authenticated by the stream itself.

Who records a cut-off: `Revocations.cut_off_subject` (a user disabled or deleted, or their
grants revoked) and `Revocations.cut_off_client` (a client deleted, its secret rotated or
its authentication method changed), each one store call that revokes the grants concerned
and records the event together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import OrderedDict
from datetime import timedelta
from typing import Any

from aiohttp import web

from . import audit
from .audit import Event
from .clients import ClientAuthenticator
from .clock import Clock
from .endpoints.errors import oauth_json_error
from .keys import SigningRing
from .protocol.errors import ErrorCode, OAuthError, invalid_request
from .registry import Client
from .store.base import CutOff, EventKind, RevocationEvent, Store, StoreUnavailable

log = logging.getLogger("portcullis.authserver.events")

TOKENS_REVOKED = "https://portcullis.dev/secevent/tokens-revoked"
SUBJECT_TOKENS_REVOKED = "https://portcullis.dev/secevent/subject-tokens-revoked"
CLIENT_TOKENS_REVOKED = "https://portcullis.dev/secevent/client-tokens-revoked"
SET_TYPE = "secevent+jwt"  # RFC 8417 §2.3

# Events read from the store in one go; a snapshot larger than this is sent in batches.
BATCH = 500
# Signed SETs kept, so that many subscribers (and their reconnections) sign each event once.
SIGNED_KEPT = 10_000
# The largest event id: the stores keep ids as signed 64-bit integers.
MAX_EVENT_ID = 2**63 - 1


class Reason:
    """Why tokens were revoked: the `reason` of an event (free text for a receiver's log)."""

    REVOKED = "revoked"  # RFC 7009 revocation by the client
    REFRESH_REUSE = "refresh_reuse"  # RFC 9700 §4.14.2
    CODE_REPLAY = "code_replay"  # RFC 6749 §4.1.2
    DEVICE_CODE_REPLAY = "device_code_replay"
    USER_DISABLED = "user_disabled"
    USER_DELETED = "user_deleted"
    CLIENT_DELETED = "client_deleted"
    CLIENT_SECRET_ROTATED = "client_secret_rotated"  # noqa: S105 - a reason, not a secret
    CLIENT_AUTH_METHOD_CHANGED = "client_auth_method_changed"  # RFC 9700 §4.14.2
    UNCONFIGURED = "removed_from_configuration"  # a seeded client or user the file dropped
    CLIENT_BLOCKED = "client_blocked"  # a metadata document client the operator blocked
    # A metadata document now names other keys or another authentication method.
    CLIENT_REKEYED = "client_rekeyed"
    CONSENT_WITHDRAWN = "consent_withdrawn"  # by the user, on the account page


def set_claims(event: RevocationEvent, issuer: str, now: float) -> dict[str, Any]:
    """The claims of the SET that reports `event`."""
    payload: dict[str, Any]
    if event.kind is EventKind.TOKENS:
        uri = TOKENS_REVOKED
        payload = {"tokens": [{"jti": t.jti, "exp": math.ceil(t.expires_at)} for t in event.tokens]}
    else:
        if event.kind is EventKind.SUBJECT:
            uri = SUBJECT_TOKENS_REVOKED
            subject = {"format": "iss_sub", "iss": issuer, "sub": event.key}
        else:
            uri = CLIENT_TOKENS_REVOKED
            subject = {"format": "opaque", "id": event.key}
        assert event.issued_before is not None
        payload = {
            "subject": subject,
            "issued_before": math.ceil(event.issued_before),
            "exp": math.ceil(event.expires_at),
        }
    payload["reason"] = event.reason
    return {
        "iss": issuer,
        "iat": int(now),
        "jti": str(event.event_id),
        "toe": int(event.created_at),
        "events": {uri: payload},
    }


class Revocations:
    """The entry point for revoking every token of a subject or a client at once (the
    admin API calls it when a user is disabled or deleted, a client deleted or its secret
    rotated). Each call is one store call: the grants concerned revoked and the event
    recorded in one transaction; resource servers subscribed to the stream refuse the
    access tokens issued before it within about a second."""

    def __init__(self, store: Store, clock: Clock, access_token_lifetime: timedelta) -> None:
        self.store = store
        self.clock = clock
        self.lifetime = access_token_lifetime.total_seconds()

    def _cut(self, kind: EventKind, key: str, reason: str) -> CutOff:
        now = self.clock()
        # `iat` is in whole seconds: a token of this very second is covered too, whether
        # issued just before or just after (a second's tokens refused rather than one let
        # through). Every covered token expires a lifetime after it at the latest.
        issued_before = float(math.floor(now) + 1)
        return CutOff(kind, key, issued_before, issued_before + self.lifetime, reason, now)

    async def cut_off_subject(self, subject: str, reason: str = Reason.USER_DISABLED) -> int:
        """End the login sessions of `subject` and revoke every token of theirs issued
        until now; the event's id."""
        sessions = await self.store.delete_sessions(subject)
        event = await self.store.cut_off(self._cut(EventKind.SUBJECT, subject, reason))
        audit.record(
            Event.USER_CUT_OFF,
            audit.SERVER,
            subject=subject,
            reason=reason,
            sessions=sessions,
            revocation_event=event,
        )
        return event

    async def cut_off_client(self, client_id: str, reason: str = Reason.CLIENT_DELETED) -> int:
        """Revoke every token of `client_id` issued until now; the event's id. (Its access
        tokens recorded nowhere, of client_credentials, are refused by this server through
        the client itself: registry.Client.tokens_valid_from, resource_tokens.py.)"""
        event = await self.store.cut_off(self._cut(EventKind.CLIENT, client_id, reason))
        audit.record(
            Event.CLIENT_CUT_OFF,
            audit.SERVER,
            client_id=client_id,
            reason=reason,
            revocation_event=event,
        )
        return event


class SignedEvents:
    """SETs signed once per event and key, kept for the next subscriber."""

    def __init__(self, keyring: SigningRing, alg: str, issuer: str, clock: Clock) -> None:
        self.keyring = keyring
        self.alg = alg
        self.issuer = issuer
        self.clock = clock
        self._kid: str | None = None
        self._kept: OrderedDict[int, str] = OrderedDict()

    def sign(self, event: RevocationEvent) -> str:
        kid = self.keyring.active(self.alg).kid
        if kid != self._kid:  # a rotation: sign with the new key from now on
            self._kept.clear()
            self._kid = kid
        token = self._kept.get(event.event_id)
        if token is None:
            claims = set_claims(event, self.issuer, self.clock())
            token = self.keyring.sign(self.alg, claims, typ=SET_TYPE)
            self._kept[event.event_id] = token
            if len(self._kept) > SIGNED_KEPT:
                self._kept.popitem(last=False)
        return token


class EventStream:
    """GET /revocation_events: the log as Server-Sent Events, to clients allowed to
    introspect (resource servers), authenticated with HTTP Basic as at introspection.

    Without `Last-Event-ID`, every unexpired event first (the snapshot), then each new one
    as it is committed; with it, the events after that id. A comment line follows whenever
    everything committed has been sent, and after `heartbeat` of silence: a receiver knows
    from it that it is up to date. The stream ends when the server shuts down, and when its
    credentials no longer let it read (the client deleted, its secret rotated, its
    `introspection` turned off): they are checked again at every wake-up."""

    def __init__(
        self,
        clients: ClientAuthenticator,
        store: Store,
        signed: SignedEvents,
        url: str,
        clock: Clock,
        heartbeat: timedelta,
        poll_interval: timedelta,
        followers: set[asyncio.Task[Any]],
    ) -> None:
        self.clients = clients
        self.store = store
        self.signed = signed
        self.url = url
        self.clock = clock
        self.heartbeat = heartbeat.total_seconds()
        self.poll_interval = poll_interval.total_seconds()
        # The tasks serving a stream now: the server cancels them when it shuts down, since a
        # stream never ends by itself.
        self.followers = followers

    async def handle(self, request: web.Request) -> web.StreamResponse:
        authorization = request.headers.get("Authorization")
        try:
            client = await self._reader(authorization)
            after = _last_event_id(request.headers.get("Last-Event-ID"))
        except OAuthError as error:
            return oauth_json_error(error)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # proxies that buffer (nginx) pass it on at once
            }
        )
        await response.prepare(request)
        log.info(
            "revocation events subscriber connected",
            extra={"client_id": client.client_id, "after": after},
        )
        task = asyncio.current_task()
        assert task is not None
        self.followers.add(task)
        try:
            await self._follow(response, after, client.client_id, authorization)
        except ConnectionResetError:
            pass  # the subscriber went away (a shutdown cancels the task instead)
        except StoreUnavailable as exc:
            # The answer has begun: no error status can be sent any more. Ending the stream
            # makes the subscriber connect again (with backoff) and resume where it was.
            log.warning("revocation events stream ended: the store is unavailable",
                        extra={"reason": str(exc)})  # fmt: skip
        finally:
            self.followers.discard(task)
        return response

    async def _reader(self, authorization: str | None) -> Client:
        """The client these credentials authenticate, if it may read the events (it may
        introspect); OAuthError otherwise."""
        client = await self.clients.authenticate({}, authorization, self.url)
        if not client.introspection or client.public:
            raise OAuthError(
                ErrorCode.UNAUTHORIZED_CLIENT,
                "this client may not read revocation events",
                status=403,
            )
        return client

    async def _still_reader(self, client_id: str, authorization: str | None) -> bool:
        try:
            await self._reader(authorization)
        except OAuthError as refusal:
            log.info(
                "revocation events stream ended: its client may no longer read it",
                extra={"client_id": client_id, "reason": refusal.code.value},
            )
            return False
        return True

    async def _follow(
        self, response: web.StreamResponse, after: int, client_id: str, authorization: str | None
    ) -> None:
        loop = asyncio.get_running_loop()
        last_write = -math.inf
        while True:
            signal = self.store.events_signal()  # before reading: nothing slips between
            events = await self.store.revocation_events(after, self.clock(), BATCH)
            # The credentials are checked again at every wake-up, after the read: an event
            # recorded after the client was deleted, its secret rotated or its introspection
            # turned off is never sent under them (the stream ends instead).
            if not await self._still_reader(client_id, authorization):
                return
            if events:
                chunk = "".join(
                    f"id: {e.event_id}\nevent: revocation\ndata: {self.signed.sign(e)}\n\n"
                    for e in events
                )
                after = events[-1].event_id
                await response.write(chunk.encode())
                if len(events) == BATCH:
                    continue
            if events or loop.time() - last_write >= self.heartbeat:
                # Everything committed so far is sent: the comment says so, and is the
                # heartbeat as well.
                await response.write(b": up to date\n\n")
                last_write = loop.time()
            wait = min(self.poll_interval, last_write + self.heartbeat - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wait)):
                    await signal.wait()


def _last_event_id(value: str | None) -> int:
    if value is None or value == "":
        return 0
    # ASCII digits only: str.isdigit() also takes digits int() cannot read ("²"). And no
    # more than the stores' ids hold (signed 64-bit): checked here, while an error can still
    # be answered, rather than failing in the store once the stream has begun.
    if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > MAX_EVENT_ID:
        raise invalid_request("Last-Event-ID is not an event id")
    return int(value)
