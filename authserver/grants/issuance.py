"""One issuance of tokens, shared by every grant that records what it issues.

`TokenIssuer.issue_tokens` plans the response (the access token's claims and jti, the
refresh token and its record, the ID token's claims), hands the records to the grant's one
store call (`commit`: redeem a code or a device code, or rotate a refresh token), and signs
only once that call reports the issuance committed. When the call finds the state it was
decided from gone (another request won the race), nothing was recorded and nothing is
signed: the grant decides again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import audit
from ..audit import Event
from ..protocol import lifecycle
from ..protocol import scopes as scope_rules
from ..protocol.lifecycle import Refresh
from ..registry import Client
from ..store.base import AccessTokenRecord, GrantRecord, Issuance, RefreshRecord
from ..tokens import Minter, TokenPlan, digest, random_token

# The store call that commits an issuance: True when it did, False when its
# compare-and-set failed and nothing was recorded.
Commit = Callable[[Issuance, TokenPlan], Awaitable[bool]]


@dataclass(frozen=True)
class Family:
    """The refresh family the response's refresh token joins: the scope the family keeps
    (a narrowed access token does not narrow it) and its absolute end."""

    scope: str
    expires_at: float


@dataclass(frozen=True)
class Terms:
    """What a grant decided the tokens say."""

    client: Client
    subject: str
    scopes: tuple[str, ...]  # the access token's
    audience: str
    auth_time: float
    grant_id: str
    now: float
    user_claims: Mapping[str, Any]  # released into the ID token by scope
    grant_type: str  # the token request's
    nonce: str | None = None
    family: Family | None = None  # None: no refresh token
    new_grant: bool = True  # False: the tokens join an existing grant (a rotation)
    dpop_jkt: str | None = None  # the access token's DPoP key (RFC 9449 §6.1 cnf.jkt)
    refresh_jkt: str | None = None  # the refresh token's DPoP key (RFC 9449 §5)
    # RFC 8176: how the user signed in, for the ID token's amr and acr and the refresh
    # family (so a refreshed ID token says the same); empty where it is not known (a family
    # started before sign-ins recorded it: the ID token then carries neither).
    amr: tuple[str, ...] = ()


@dataclass(frozen=True)
class RefreshLifetimes:
    """How long a refresh token lives: `idle`, unused, and its family `absolute` from the
    login that started it, whatever its rotations."""

    idle: timedelta
    absolute: timedelta


class TokenIssuer:
    def __init__(self, minter: Minter, refresh: RefreshLifetimes) -> None:
        self.minter = minter
        self.idle = refresh.idle.total_seconds()
        self.absolute = refresh.absolute.total_seconds()

    def new_family(self, scope: str, now: float) -> Family:
        return Family(scope, now + self.absolute)

    async def issue_tokens(self, terms: Terms, commit: Commit) -> dict[str, Any] | None:
        """The token response once `commit` recorded it; None when `commit` lost its race."""
        plan = self._plan(terms)
        if not await commit(self._records(terms, plan), plan):
            return None
        audit.record(
            Event.TOKEN_ISSUED,
            audit.CLIENT,
            client_id=terms.client.client_id,
            subject=terms.subject,
            grant_id=terms.grant_id,
            jti=plan.jti,
            grant_type=terms.grant_type,
            scope=scope_rules.render(terms.scopes),
        )
        return self.minter.sign(plan)

    def repeat(self, plan: TokenPlan) -> dict[str, Any]:
        """A committed plan's response again (a retry within the grace window)."""
        return self.minter.sign(plan)

    def _plan(self, terms: Terms) -> TokenPlan:
        client = terms.client
        access_claims = self.minter.access_claims(
            subject=terms.subject,
            client_id=client.client_id,
            scope=scope_rules.render(terms.scopes),
            audience=terms.audience,
            now=terms.now,
            auth_time=terms.auth_time,
            jkt=terms.dpop_jkt,
        )
        roles = terms.user_claims.get("roles")
        if "roles" in terms.scopes and roles:
            access_claims["roles"] = list(roles)  # RFC 9068 §2.2.3.1
        id_claims = None
        if "openid" in terms.scopes:
            id_claims = self.minter.id_claims(
                subject=terms.subject,
                user_claims=terms.user_claims,
                client_id=client.client_id,
                scopes=terms.scopes,
                nonce=terms.nonce,
                auth_time=terms.auth_time,
                now=terms.now,
                amr=terms.amr,
            )
        return TokenPlan(
            access_claims=access_claims,
            expires_in=self.minter.access_lifetime,
            scopes=terms.scopes,
            refresh_token=random_token() if terms.family is not None else None,
            id_claims=id_claims,
            id_alg=client.id_token_signed_response_alg if id_claims is not None else None,
        )

    def _records(self, terms: Terms, plan: TokenPlan) -> Issuance:
        client_id = terms.client.client_id
        access = AccessTokenRecord(plan.jti, terms.grant_id, client_id, plan.access_expires_at)
        refresh = None
        if terms.family is not None and plan.refresh_token is not None:
            refresh = RefreshRecord(
                token_hash=digest(plan.refresh_token),
                family_id=terms.grant_id,
                client_id=client_id,
                subject=terms.subject,
                scope=terms.family.scope,
                audience=terms.audience,
                auth_time=terms.auth_time,
                created_at=terms.now,
                expires_at=lifecycle.refresh_idle_expiry(
                    terms.now, self.idle, terms.family.expires_at
                ),
                family_expires_at=terms.family.expires_at,
                state=Refresh.ACTIVE.value,
                dpop_jkt=terms.refresh_jkt,
                amr=terms.amr,
            )
        grant = None
        if terms.new_grant:
            grant = GrantRecord(
                grant_id=terms.grant_id,
                client_id=client_id,
                subject=terms.subject,
                created_at=terms.now,
                expires_at=(
                    terms.family.expires_at if terms.family is not None else plan.access_expires_at
                ),
            )
        return Issuance(access, refresh, grant)
