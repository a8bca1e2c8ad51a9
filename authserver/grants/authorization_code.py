"""authorization_code (RFC 6749 §4.1.3, RFC 7636 §4.5, OIDC Core §3.1.3).

Checks happen before the code is consumed, so a wrong verifier or redirect_uri leaves the
code usable by its rightful holder. Consumption is atomic; a code presented after it was
consumed is a replay: `invalid_grant`, and every token issued from it is revoked
(RFC 6749 §4.1.2, RFC 9700 §4.8).
"""

from __future__ import annotations

from typing import Any

from ..protocol import pkce
from ..protocol.errors import invalid_grant, invalid_request
from ..settings import ClientSettings
from ..store.base import RefreshRecord
from ..tokens import digest, random_token
from .base import GrantContext, TokenRequest, audit, may_refresh, token_response


def family_of_code(code_hash: bytes) -> str:
    """Tokens issued from a code live in a family named after it, so a replay finds them."""
    return "c" + code_hash.hex()[:31]


class AuthorizationCode:
    grant_type = "authorization_code"

    def __init__(self, context: GrantContext) -> None:
        self.ctx = context

    async def issue(self, request: TokenRequest, client: ClientSettings) -> dict[str, Any]:
        form, now, store = request.form, request.now, self.ctx.store
        code = form.get("code")
        if not code:
            raise invalid_request("code is required")
        code_hash = digest(code)
        record = await store.get_code(code_hash)
        if record is None or record.client_id != client.client_id:
            raise invalid_grant("the code is unknown, expired or was issued to another client")
        if record.expires_at <= now:
            raise invalid_grant("the code is unknown, expired or was issued to another client")
        if form.get("redirect_uri") != record.redirect_uri:
            raise invalid_grant("redirect_uri does not match the authorization request")
        pkce.check_verifier(form.get("code_verifier"), record.code_challenge)

        family_id = family_of_code(code_hash)
        _, first = await store.consume_code(code_hash, now)
        if not first:
            await store.revoke_grant(family_id, now)
            audit.warning(
                "authorization code replayed: tokens issued from it revoked",
                extra={"client_id": client.client_id, "family_id": family_id},
            )
            raise invalid_grant("the code was already used")

        scopes = tuple(record.scope.split())
        minted = self.ctx.minter.access_token(
            subject=record.subject,
            client_id=client.client_id,
            scope=record.scope,
            audience=record.audience,
            now=now,
            auth_time=record.auth_time,
        )
        await store.record_access_token(minted.jti, family_id, client.client_id, minted.expires_at)

        refresh_token = None
        if may_refresh(client, scopes):
            refresh_token = random_token()
            lifetimes = self.ctx.settings.lifetimes
            await store.save_refresh(
                RefreshRecord(
                    token_hash=digest(refresh_token),
                    family_id=family_id,
                    client_id=client.client_id,
                    subject=record.subject,
                    scope=record.scope,
                    audience=record.audience,
                    auth_time=record.auth_time,
                    created_at=now,
                    expires_at=now + lifetimes.refresh_token_idle.total_seconds(),
                    family_expires_at=now + lifetimes.refresh_token_absolute.total_seconds(),
                    state="active",
                )
            )

        id_token = None
        if "openid" in scopes:
            user = self.ctx.settings.user_by_subject(record.subject)
            id_token = self.ctx.minter.id_token(
                subject=record.subject,
                user_claims=user.claims if user else {},
                client_id=client.client_id,
                scopes=scopes,
                nonce=record.nonce,
                auth_time=record.auth_time,
                access_token=minted.token,
                now=now,
                alg=client.id_token_signed_response_alg,
            )
        return token_response(
            minted.token, minted.expires_in, scopes, refresh_token=refresh_token, id_token=id_token
        )
