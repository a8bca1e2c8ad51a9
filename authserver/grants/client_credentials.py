"""client_credentials (RFC 6749 §4.4): confidential clients only; no refresh or ID token;
the subject is the client itself. Nothing is stored: the token stands on its signature."""

from __future__ import annotations

from typing import Any

from .. import audit
from ..audit import Event
from ..protocol import scopes as scope_rules
from ..protocol.errors import ErrorCode, OAuthError
from ..protocol.resources import Audiences, within
from ..registry import Client
from ..tokens import Minter, TokenPlan
from .base import TokenRequest, target_for

_USER_ONLY_SCOPES = frozenset({"openid", "offline_access", "profile", "email", "address", "phone"})


class ClientCredentials:
    grant_type = "client_credentials"

    def __init__(self, minter: Minter, audiences: Audiences) -> None:
        self.minter = minter
        self.audiences = audiences

    async def issue(self, request: TokenRequest, client: Client) -> dict[str, Any]:
        if client.public:
            raise OAuthError(ErrorCode.UNAUTHORIZED_CLIENT, "public clients cannot use this grant")
        machine_scopes = tuple(s for s in client.scope if s not in _USER_ONLY_SCOPES)
        requested = scope_rules.parse(request.form.get("scope"))
        if requested:
            scope_rules.require_allowed(requested, machine_scopes)
        target = target_for(self.audiences, client, request.form.get("resource"), requested)
        # RFC 6749 §3.3: without `scope`, the registered default, as far as the resource
        # named accepts it.
        granted = requested or within(target, machine_scopes)
        claims = self.minter.access_claims(
            subject=client.client_id,
            client_id=client.client_id,
            scope=scope_rules.render(granted),
            audience=target.audience,
            now=request.now,
            jkt=request.dpop_jkt,  # RFC 9449 §5: bound to the proof's key, if one came
        )
        # Signed once: nothing is kept to sign it again from.
        plan = TokenPlan(claims, self.minter.access_lifetime, granted)
        audit.record(
            Event.TOKEN_ISSUED,
            audit.CLIENT,
            client_id=client.client_id,
            jti=plan.jti,
            grant_type=self.grant_type,
            scope=claims["scope"],
        )
        return self.minter.sign(plan, repeatable=False)
