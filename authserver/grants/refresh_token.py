"""refresh_token (RFC 6749 §6) with rotation and reuse detection (RFC 9700 §4.14.2).

Every use rotates: a successor in the same family, the presented token marked rotated, in
one transaction (two concurrent uses: exactly one wins). A rotated token presented again
within `refresh_grace` repeats the successor response, sealed in the store under a key
derived from the presented token; outside it, or for a revoked token, the whole family is
revoked and an audit line written. A token is bound to its client; scope may narrow only.
"""

from __future__ import annotations

from typing import Any

from ..protocol import scopes as scope_rules
from ..protocol.errors import invalid_grant, invalid_request
from ..settings import ClientSettings
from ..store.base import RefreshOutcome, RefreshRecord
from ..tokens import digest, random_token, seal, unseal
from .base import GrantContext, TokenRequest, audit, token_response


class RefreshToken:
    grant_type = "refresh_token"

    def __init__(self, context: GrantContext) -> None:
        self.ctx = context

    async def issue(self, request: TokenRequest, client: ClientSettings) -> dict[str, Any]:
        form, now, store, settings = request.form, request.now, self.ctx.store, self.ctx.settings
        presented = form.get("refresh_token")
        if not presented:
            raise invalid_request("refresh_token is required")
        token_hash = digest(presented)
        record = await store.get_refresh(token_hash)
        if record is None or record.client_id != client.client_id:
            raise invalid_grant("the refresh token is unknown, expired or revoked")
        if settings.user_by_subject(record.subject) is None:
            # The user was removed from the configuration: their grants end with them.
            raise invalid_grant("the refresh token is unknown, expired or revoked")
        granted = tuple(record.scope.split())
        requested = scope_rules.parse(form.get("scope"))
        scopes = scope_rules.narrow(requested, granted) if requested else granted

        minted = self.ctx.minter.access_token(
            subject=record.subject,
            client_id=client.client_id,
            scope=scope_rules.render(scopes),
            audience=record.audience,
            now=now,
            auth_time=record.auth_time,
        )
        successor_token = random_token()
        id_token = None
        if "openid" in scopes:
            user = settings.user_by_subject(record.subject)
            id_token = self.ctx.minter.id_token(
                subject=record.subject,
                user_claims=user.claims if user else {},
                client_id=client.client_id,
                scopes=scopes,
                nonce=None,
                auth_time=record.auth_time,
                access_token=minted.token,
                now=now,
                alg=client.id_token_signed_response_alg,
            )
        response = token_response(
            minted.token,
            minted.expires_in,
            scopes,
            refresh_token=successor_token,
            id_token=id_token,
        )
        # The successor keeps the scope of the family: narrowing applies to this access token.
        successor = RefreshRecord(
            token_hash=digest(successor_token),
            family_id=record.family_id,
            client_id=client.client_id,
            subject=record.subject,
            scope=record.scope,
            audience=record.audience,
            auth_time=record.auth_time,
            created_at=now,
            expires_at=min(
                now + settings.lifetimes.refresh_token_idle.total_seconds(),
                record.family_expires_at,
            ),
            family_expires_at=record.family_expires_at,
            state="active",
        )
        use = await store.use_refresh(
            token_hash,
            now,
            settings.refresh_grace.total_seconds(),
            successor,
            seal(response, presented),
        )
        if use.outcome is RefreshOutcome.ROTATED:
            await store.record_access_token(
                minted.jti, record.family_id, client.client_id, minted.expires_at
            )
            return response
        if use.outcome is RefreshOutcome.GRACE and use.record and use.record.successor_sealed:
            repeated = unseal(use.record.successor_sealed, presented)
            if repeated is not None:
                return repeated
        if use.outcome is RefreshOutcome.REUSED:
            self.ctx.metrics.refresh_reused()
            audit.warning(
                "refresh token reused: family revoked",
                extra={"client_id": client.client_id, "family_id": record.family_id},
            )
        raise invalid_grant("the refresh token is unknown, expired or revoked")
