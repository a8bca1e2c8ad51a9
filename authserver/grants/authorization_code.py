"""authorization_code (RFC 6749 §4.1.3, RFC 7636 §4.5, OIDC Core §3.1.3).

Checks happen before the code is consumed, so a wrong verifier, redirect_uri or resource
(RFC 8707 §2.2: the one the authorization named, if any is sent) leaves the code usable by
its rightful holder. A code whose user is gone (disabled, deleted, dropped
from the configuration) gives nothing: `invalid_grant`, as the device and refresh grants
answer; a user's cut-off also ends their codes in the store (Store.cut_off), so one issued
before it gives nothing once they are back either. The code is consumed, its grant created
and the tokens recorded in one store call, a compare-and-set on the code's state; a code
presented after it was consumed is a replay: `invalid_grant`, and every token issued from
it is revoked (RFC 6749 §4.1.2, RFC 9700 §4.8).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .. import audit
from ..audit import Event
from ..protocol import lifecycle, pkce
from ..protocol.errors import invalid_grant, invalid_request
from ..protocol.lifecycle import CODE, Effect, Move
from ..registry import Client, UserDirectory
from ..store.base import CodeRecord, Issuance, Store
from ..tokens import TokenPlan, digest
from .base import (
    ATTEMPTS,
    TokenRequest,
    may_refresh,
    refresh_binding,
    require_authorized_resource,
    require_key,
)
from .issuance import Terms, TokenIssuer

UNKNOWN = "the code is unknown, expired or was issued to another client"


def family_of_code(code_hash: bytes) -> str:
    """Tokens issued from a code live in a grant named after it, so a replay finds them."""
    return "c" + code_hash.hex()[:31]


class AuthorizationCode:
    grant_type = "authorization_code"

    def __init__(self, store: Store, users: UserDirectory, issuer: TokenIssuer) -> None:
        self.store = store
        self.users = users
        self.issuer = issuer

    async def issue(self, request: TokenRequest, client: Client) -> dict[str, Any]:
        form, now = request.form, request.now
        code = form.get("code")
        if not code:
            raise invalid_request("code is required")
        code_hash = digest(code)
        record = await self.store.get_code(code_hash)
        if record is None or record.client_id != client.client_id:
            raise invalid_grant(UNKNOWN)
        if lifecycle.expired(record.expires_at, now):
            raise invalid_grant(UNKNOWN)
        if form.get("redirect_uri") != record.redirect_uri:
            raise invalid_grant("redirect_uri does not match the authorization request")
        pkce.check_verifier(form.get("code_verifier"), record.code_challenge)
        require_authorized_resource(form.get("resource"), record.audience)
        require_key(record.dpop_jkt, request, "the code")

        grant_id = family_of_code(code_hash)
        for _ in range(ATTEMPTS):
            decision = lifecycle.decide(CODE, record.state, "redeem")
            if decision.effect is Effect.REVOKE_ISSUED:
                await self.store.revoke_grant(grant_id, now, "code_replay")
                audit.record(
                    Event.CODE_REPLAYED,
                    audit.SERVER,
                    client_id=client.client_id,
                    subject=record.subject,
                    grant_id=grant_id,
                    reason="code_replay",
                )
                raise invalid_grant("the code was already used")
            response = await self.issuer.issue_tokens(
                await self._terms(record, client, grant_id, request),
                partial(self._redeem, code_hash, decision.move),
            )
            if response is not None:
                return response
            fresh = await self.store.get_code(code_hash)
            if fresh is None:  # purged in between: it expired
                raise invalid_grant(UNKNOWN)
            record = fresh
        raise RuntimeError("the code's state kept changing under its redemption")

    async def _redeem(self, code_hash: bytes, move: Move, issuance: Issuance, _: TokenPlan) -> bool:
        return await self.store.redeem_code(code_hash, move, issuance)

    async def _terms(
        self, record: CodeRecord, client: Client, grant_id: str, request: TokenRequest
    ) -> Terms:
        now = request.now
        scopes = tuple(record.scope.split())
        user = await self.users.by_subject(record.subject)
        if user is None:
            # Disabled, deleted or dropped from the configuration since signing in: a code
            # is no grant of its own, and the user's grants ended with them (RFC 6749
            # §5.2: the authorization grant is revoked).
            raise invalid_grant("the user this code was issued to no longer exists")
        refresh = may_refresh(client, scopes)
        return Terms(
            client=client,
            subject=record.subject,
            scopes=scopes,
            audience=record.audience,
            auth_time=record.auth_time,
            grant_id=grant_id,
            now=now,
            user_claims=user.claims,
            grant_type=request.grant_type,
            nonce=record.nonce,
            family=self.issuer.new_family(record.scope, now) if refresh else None,
            dpop_jkt=request.dpop_jkt,
            refresh_jkt=refresh_binding(client, request),
            # A code stored before codes recorded it was given after a password.
            amr=record.amr or ("pwd",),
        )
