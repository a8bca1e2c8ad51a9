"""urn:ietf:params:oauth:grant-type:device_code (RFC 8628 §3.4, §3.5): the device polls.

The code is read, the poll decided by `lifecycle.DEVICE` (authorization_pending until the
user decides, slow_down, with the code's interval raised by 5 s for good, for a poll that
comes sooner than the interval after the previous one, access_denied after a denial,
expired_token once the code's lifetime is over, the tokens exactly once after approval),
and the decision recorded by one store call, a compare-and-set on the code's state and last
poll: two polls at once cannot both read the same previous poll. The tokens are issued in
the same call that redeems the code. A code redeemed again answers invalid_grant and
revokes what it issued, like a replayed authorization code. A poll by a client other than
the one the code was issued to answers invalid_grant and changes nothing: it neither
redeems the code nor makes the device's next poll too fast. Refresh and ID tokens follow
the code flow's rules.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .. import audit
from ..audit import Event
from ..protocol import lifecycle
from ..protocol.errors import ErrorCode, OAuthError, invalid_grant, invalid_request
from ..protocol.lifecycle import DEVICE, Decision, Effect, device_poll_event
from ..registry import Client, UserDirectory
from ..store.base import DeviceRecord, Issuance, Poll, Store
from ..tokens import TokenPlan, digest
from .base import (
    ATTEMPTS,
    TokenRequest,
    may_refresh,
    refresh_binding,
    require_authorized_resource,
)
from .issuance import Terms, TokenIssuer

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
UNKNOWN = "the device code is unknown or was issued to another client"


def family_of_device_code(code_hash: bytes) -> str:
    """Tokens issued from a device code live in a grant named after it, so a second
    redemption finds them."""
    return "d" + code_hash.hex()[:31]


class DeviceCode:
    grant_type = GRANT_TYPE

    def __init__(self, store: Store, users: UserDirectory, issuer: TokenIssuer) -> None:
        self.store = store
        self.users = users
        self.issuer = issuer

    async def issue(self, request: TokenRequest, client: Client) -> dict[str, Any]:
        form, now = request.form, request.now
        device_code = form.get("device_code")
        if not device_code:
            raise invalid_request("device_code is required")
        code_hash = digest(device_code)
        record = await self._owned(code_hash, client)
        if lifecycle.expired(record.expires_at, now):
            raise OAuthError(ErrorCode.EXPIRED_TOKEN, "the device code has expired")
        require_authorized_resource(form.get("resource"), record.audience)
        grant_id = family_of_device_code(code_hash)

        for _ in range(ATTEMPTS):
            too_fast = lifecycle.poll_too_fast(record.last_poll, record.interval, now)
            event = device_poll_event(record.state, too_fast)
            decision = lifecycle.decide(DEVICE, record.state, event)
            if decision.effect is Effect.REVOKE_ISSUED:
                await self.store.revoke_grant(grant_id, now, "device_code_replay")
                audit.record(
                    Event.CODE_REPLAYED,
                    audit.SERVER,
                    client_id=client.client_id,
                    subject=record.subject,
                    grant_id=grant_id,
                    reason="device_code_replay",
                )
                raise invalid_grant(_DESCRIPTIONS["invalid_grant"])
            if decision.effect is Effect.ISSUE_TOKENS:
                response = await self.issuer.issue_tokens(
                    await self._terms(record, client, grant_id, request),
                    partial(self._redeem, code_hash, _poll(record, decision, now)),
                )
                if response is not None:
                    return response
            elif await self.store.record_poll(code_hash, _poll(record, decision, now)):
                assert decision.error is not None
                raise OAuthError(ErrorCode(decision.error), _DESCRIPTIONS[decision.error])
            record = await self._owned(code_hash, client)  # another poll came in between
        raise RuntimeError("the device code's state kept changing under its poll")

    async def _owned(self, code_hash: bytes, client: Client) -> DeviceRecord:
        """The code, if it was issued to this client: another client's poll reads it only
        to refuse (RFC 8628 §3.4: the code is bound to its client)."""
        record = await self.store.get_device(code_hash)
        if record is None or record.client_id != client.client_id:
            raise invalid_grant(UNKNOWN)
        return record

    async def _terms(
        self, record: DeviceRecord, client: Client, grant_id: str, request: TokenRequest
    ) -> Terms:
        now = request.now
        user = await self.users.by_subject(record.subject or "")
        if user is None:
            # The user was removed from the configuration since approving.
            raise invalid_grant("the user who approved this device no longer exists")
        scopes = tuple(record.scope.split())
        refresh = may_refresh(client, scopes)
        return Terms(
            client=client,
            subject=user.subject,
            scopes=scopes,
            audience=record.audience,
            auth_time=record.auth_time if record.auth_time is not None else now,
            grant_id=grant_id,
            now=now,
            user_claims=user.claims,
            grant_type=request.grant_type,
            family=self.issuer.new_family(record.scope, now) if refresh else None,
            dpop_jkt=request.dpop_jkt,
            refresh_jkt=refresh_binding(client, request),
            amr=record.amr or ("pwd",),  # before device codes recorded it: a password
        )

    async def _redeem(self, code_hash: bytes, poll: Poll, issuance: Issuance, _: TokenPlan) -> bool:
        return await self.store.redeem_device(code_hash, poll, issuance)


def _poll(record: DeviceRecord, decision: Decision, now: float) -> Poll:
    interval = record.interval
    if decision.effect is Effect.RAISE_INTERVAL:
        interval = lifecycle.slowed_down(interval)
    return Poll(decision.move, record.last_poll, now, interval)


_DESCRIPTIONS = {
    "authorization_pending": "the user has not decided yet",
    "slow_down": "polling too fast: wait the interval, now 5 seconds longer, between polls",
    "access_denied": "the user denied the request",
    "invalid_grant": "the device code was already used",
}
