"""urn:ietf:params:oauth:grant-type:device_code (RFC 8628 §3.4, §3.5): the device polls.

Each poll is recorded atomically by the store, which returns the code as it was before;
the answer follows `lifecycle.DEVICE`: authorization_pending until the user decides,
slow_down (and the code's interval raised by 5 s for good) for a poll that comes sooner than
the interval after the previous one, access_denied after a denial, expired_token once the
code's lifetime is over, and the tokens exactly once after approval. A code redeemed again
answers invalid_grant and revokes what it issued, like a replayed authorization code.
A poll by a client other than the one the code was issued to answers invalid_grant and
changes nothing: it neither redeems the code nor makes the device's next poll too fast.
Refresh and ID tokens follow the code flow's rules.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..protocol.errors import ErrorCode, OAuthError, invalid_grant, invalid_request
from ..protocol.lifecycle import DEVICE, Effect, device_poll_event, step
from ..settings import ClientSettings
from ..store.base import RefreshRecord
from ..tokens import digest, random_token
from .base import GrantContext, TokenRequest, audit, may_refresh, token_response

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
SLOW_DOWN_STEP = timedelta(seconds=5)  # RFC 8628 §3.5
# A poll counts as too fast only when it comes this much sooner than the interval: the
# device waits after it reads an answer, the server measures between arrivals, and the
# two differ by network and scheduling jitter. The interval protects load, not a secret.
POLL_TOLERANCE = timedelta(milliseconds=100)


def family_of_device_code(code_hash: bytes) -> str:
    """Tokens issued from a device code live in a family named after it, so a second
    redemption finds them."""
    return "d" + code_hash.hex()[:31]


class DeviceCode:
    grant_type = GRANT_TYPE

    def __init__(self, context: GrantContext) -> None:
        self.ctx = context

    async def issue(self, request: TokenRequest, client: ClientSettings) -> dict[str, Any]:
        form, now, store, settings = request.form, request.now, self.ctx.store, self.ctx.settings
        device_code = form.get("device_code")
        if not device_code:
            raise invalid_request("device_code is required")
        code_hash = digest(device_code)
        # The store checks the client before it records anything: a poll by another client
        # neither redeems the code nor counts towards the device's slow_down.
        before = await store.poll_device(code_hash, client.client_id, now)
        if before is None:
            raise invalid_grant("the device code is unknown or was issued to another client")
        if before.expires_at <= now:
            raise OAuthError(ErrorCode.EXPIRED_TOKEN, "the device code has expired")

        too_fast = (
            before.last_poll is not None
            and now - before.last_poll < before.interval - POLL_TOLERANCE.total_seconds()
        )
        transition = step(DEVICE, before.state, device_poll_event(before.state, too_fast))
        family_id = family_of_device_code(code_hash)
        if transition.effect is Effect.RAISE_INTERVAL:
            await store.slow_down_device(
                code_hash, before.interval + SLOW_DOWN_STEP.total_seconds()
            )
        elif transition.effect is Effect.REVOKE_ISSUED:
            await store.revoke_grant(family_id, now)
            audit.warning(
                "device code redeemed twice: tokens issued from it revoked",
                extra={"client_id": client.client_id, "family_id": family_id},
            )
        if transition.error is not None:
            raise OAuthError(ErrorCode(transition.error), _DESCRIPTIONS[transition.error])
        assert transition.effect is Effect.ISSUE_TOKENS

        subject = before.subject or ""
        user = settings.user_by_subject(subject)
        if user is None:
            # The user was removed from the configuration since approving.
            raise invalid_grant("the user who approved this device no longer exists")
        scopes = tuple(before.scope.split())
        auth_time = before.auth_time if before.auth_time is not None else now
        minted = self.ctx.minter.access_token(
            subject=subject,
            client_id=client.client_id,
            scope=before.scope,
            audience=before.audience,
            now=now,
            auth_time=auth_time,
        )
        await store.record_access_token(minted.jti, family_id, client.client_id, minted.expires_at)

        refresh_token = None
        if may_refresh(client, scopes):
            refresh_token = random_token()
            lifetimes = settings.lifetimes
            await store.save_refresh(
                RefreshRecord(
                    token_hash=digest(refresh_token),
                    family_id=family_id,
                    client_id=client.client_id,
                    subject=subject,
                    scope=before.scope,
                    audience=before.audience,
                    auth_time=auth_time,
                    created_at=now,
                    expires_at=now + lifetimes.refresh_token_idle.total_seconds(),
                    family_expires_at=now + lifetimes.refresh_token_absolute.total_seconds(),
                    state="active",
                )
            )

        id_token = None
        if "openid" in scopes:
            id_token = self.ctx.minter.id_token(
                subject=subject,
                user_claims=user.claims,
                client_id=client.client_id,
                scopes=scopes,
                nonce=None,
                auth_time=auth_time,
                access_token=minted.token,
                now=now,
                alg=client.id_token_signed_response_alg,
            )
        return token_response(
            minted.token, minted.expires_in, scopes, refresh_token=refresh_token, id_token=id_token
        )


_DESCRIPTIONS = {
    "authorization_pending": "the user has not decided yet",
    "slow_down": "polling too fast: wait the interval, now 5 seconds longer, between polls",
    "access_denied": "the user denied the request",
    "invalid_grant": "the device code was already used",
}
