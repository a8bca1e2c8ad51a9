"""refresh_token (RFC 6749 §6) with rotation and reuse detection (RFC 9700 §4.14.2).

Every use rotates: the presented token marked rotated, a successor in the same family and
the new access token recorded, in one store call that is a compare-and-set on the token's
state (two concurrent uses: exactly one wins). A rotated token presented again within
`refresh_grace`, by the client it belongs to and before its successor was used, repeats the
successor response, sealed in the store under a key derived from the presented token: the
retry of a response that was lost (a dropped connection, a server killed after the commit).
Otherwise a rotated or revoked token presented again revokes the whole family and writes an
audit line. A token is bound to its client; scope may narrow only.

What a refresh issues is at most the family's grant as far as the client is still
registered for it (RFC 6749 §6: never more than the original grant; §3.3 and RFC 8707 §2:
never more than the client may be given). A scope removed from the client is dropped
silently, and from the family for good (the successor keeps the narrowed grant: giving
the scope back to the client does not give it back to grants made without it); a refresh
that names such a scope is `invalid_scope`, as one naming a scope the grant never had, and
so is one with nothing of its grant left, or whose OpenID grant lost `offline_access`
(OIDC Core §11: the refresh stands on it). The family's audience is its one resource: a
request may name it (RFC 8707 §2.2) and no other, and a client no longer registered for it
gets `invalid_target`; a scope its registered resource (protocol/resources.py) no longer
accepts is dropped as one the client lost. A retry within the grace is repeated only while
the client is still registered for all it held.

DPoP (RFC 9449 §5): a public client's refresh token is bound to the key of the proof it
was first issued with, for the life of its family: every use needs a proof of that key. A
confidential client's is not (its authentication binds it); the new access token is bound
to whatever key the request proves. A retry within the grace is answered again only with
the key the lost response was bound to.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .. import audit
from ..audit import Event
from ..metrics import Metrics
from ..protocol import lifecycle
from ..protocol import scopes as scope_rules
from ..protocol.errors import ErrorCode, OAuthError, invalid_grant, invalid_request, invalid_scope
from ..protocol.lifecycle import REFRESH, Effect, Move
from ..protocol.resources import Audiences, Target, within
from ..registry import Client, User, UserDirectory
from ..store.base import Issuance, RefreshRecord, Store
from ..tokens import TokenPlan, digest, seal, unseal
from .base import ATTEMPTS, TokenRequest, may_refresh, require_key
from .issuance import Family, Terms, TokenIssuer

REFUSED = "the refresh token is unknown, expired or revoked"


class RefreshToken:
    grant_type = "refresh_token"

    def __init__(
        self,
        store: Store,
        users: UserDirectory,
        issuer: TokenIssuer,
        grace: float,
        metrics: Metrics,
        audiences: Audiences,
    ) -> None:
        self.store = store
        self.users = users
        self.issuer = issuer
        self.grace = grace  # seconds
        self.metrics = metrics
        self.audiences = audiences

    async def issue(self, request: TokenRequest, client: Client) -> dict[str, Any]:
        form, now = request.form, request.now
        presented = form.get("refresh_token")
        if not presented:
            raise invalid_request("refresh_token is required")
        token_hash = digest(presented)
        record = await self._owned(token_hash, client)
        require_key(record.dpop_jkt, request, "the refresh token")
        user = await self.users.by_subject(record.subject)
        if user is None:
            # The user was removed from the configuration: their grants end with them.
            raise invalid_grant(REFUSED)
        target = check_audience(record, client, form.get("resource"), self.audiences)
        kept, scopes = still_granted(record, client, scope_rules.parse(form.get("scope")), target)

        for _ in range(ATTEMPTS):
            decision = lifecycle.decide(REFRESH, record.state, await self._event(record, now))
            if decision.effect is Effect.ISSUE_TOKENS:
                response = await self.issuer.issue_tokens(
                    _terms(record, client, user, kept, scopes, request),
                    partial(self._rotate, token_hash, decision.move, presented),
                )
                if response is not None:
                    return response
                record = await self._owned(token_hash, client)  # lost the race: again
                continue
            if decision.effect is Effect.REPEAT_SUCCESSOR and record.successor_sealed:
                plan = unseal(record.successor_sealed, presented)
                # The retry of a lost response gets it again only with the key the lost
                # one was bound to (or none, as then): a token bound to a key is never
                # handed to a request that did not prove it.
                # Nor one holding a scope the client lost since.
                if (
                    plan is not None
                    and plan.dpop_jkt == request.dpop_jkt
                    and set(plan.scopes) <= set(kept)
                ):
                    return self.issuer.repeat(plan)
            if decision.effect is Effect.REVOKE_FAMILY:
                await self.store.revoke_grant(record.family_id, now, "refresh_reuse")
                self.metrics.refresh_reused()
                audit.record(
                    Event.REFRESH_REUSED,
                    audit.SERVER,
                    client_id=client.client_id,
                    subject=record.subject,
                    grant_id=record.family_id,
                    reason="refresh_reuse",
                )
            raise invalid_grant(REFUSED)
        raise RuntimeError("the refresh token's state kept changing under its rotation")

    async def _owned(self, token_hash: bytes, client: Client) -> RefreshRecord:
        """The token, if it is this client's. Another client's token is refused without a
        change: it proves nothing about the token's owner (and no grace is given to it)."""
        record = await self.store.get_refresh(token_hash)
        if record is None or record.client_id != client.client_id:
            raise invalid_grant(REFUSED)
        return record

    async def _event(self, record: RefreshRecord, now: float) -> str:
        successor = None
        if record.successor_hash is not None:
            successor = await self.store.get_refresh(record.successor_hash)
        return lifecycle.refresh_use_event(
            record.state,
            expires_at=record.expires_at,
            family_expires_at=record.family_expires_at,
            rotated_at=record.rotated_at,
            successor_state=successor.state if successor is not None else None,
            now=now,
            grace=self.grace,
        )

    async def _rotate(
        self, token_hash: bytes, move: Move, presented: str, issuance: Issuance, plan: TokenPlan
    ) -> bool:
        return await self.store.rotate_refresh(token_hash, move, issuance, seal(plan, presented))


def still_granted(
    record: RefreshRecord, client: Client, requested: tuple[str, ...], target: Target
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The scopes of the family from now on (its grant, as far as the client is still
    registered for it and its registered resource still accepts it) and those of the
    access token (the request's, else the same)."""
    granted = tuple(record.scope.split())
    registered = set(within(target, client.scope))
    kept = tuple(s for s in granted if s in registered)
    if granted and not kept:
        raise invalid_scope("the client is no longer registered for any scope of this grant")
    if not may_refresh(client, kept):
        raise invalid_scope("the client is no longer registered for offline_access")
    if not requested:
        return kept, kept
    scope_rules.narrow(requested, granted)  # RFC 6749 §6: never beyond the original grant
    scope_rules.require_allowed(requested, kept)  # nor beyond the registration now
    return kept, requested


def check_audience(
    record: RefreshRecord, client: Client, resource: str | None, audiences: Audiences
) -> Target:
    """The family's audience, named by the request or not, is one the client may still be
    given (RFC 8707 §2.2: a refresh names a resource of its grant, and a family has one):
    the default, one of the client's own resources, or one still registered."""
    if resource is not None and resource != record.audience:
        raise OAuthError(ErrorCode.INVALID_TARGET, "resource is not the one of this grant")
    if not audiences.may_use(record.audience, client.resources):
        raise OAuthError(
            ErrorCode.INVALID_TARGET, "the client is no longer registered for this resource"
        )
    return Target(record.audience, audiences.registered(record.audience))


def _terms(
    record: RefreshRecord,
    client: Client,
    user: User,
    kept: tuple[str, ...],
    scopes: tuple[str, ...],
    request: TokenRequest,
) -> Terms:
    """The tokens of a rotation: the family's grant (`kept`), subject, audience and sign-in
    time. The access token is bound to the request's proof; the successor keeps the
    family's binding."""
    now = request.now
    return Terms(
        client=client,
        subject=record.subject,
        scopes=scopes,
        audience=record.audience,
        auth_time=record.auth_time,
        grant_id=record.family_id,
        now=now,
        user_claims=user.claims,
        grant_type=request.grant_type,
        # The successor keeps the scope of the family, as far as the client is still
        # registered for it: a request's narrowing applies to this access token only.
        family=Family(scope_rules.render(kept), record.family_expires_at),
        new_grant=False,
        dpop_jkt=request.dpop_jkt,
        refresh_jkt=record.dpop_jkt,
        amr=record.amr,  # OIDC Core §12.2: the refreshed ID token tells of the same sign-in
    )
