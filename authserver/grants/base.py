"""What every grant type supplies, and the registry the token endpoint dispatches on.

The token endpoint runs the shared steps (parse, look up the grant, authenticate the
client, check the client may use the grant) before `Grant.issue`, so no grant can forget
one. A grant only answers: given an authenticated client and the request, what tokens?
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from ..protocol.errors import ErrorCode, OAuthError, invalid_grant
from ..protocol.resources import Audiences, Target, check_scopes
from ..registry import Client

# A compare-and-set that lost means the object's state moved on, and states only move
# forward (lifecycle.py): decided again, the next attempt needs no compare-and-set. More
# attempts than this means a bug.
ATTEMPTS = 3


class TokenRequest(NamedTuple):
    """One token request as the grants read it. A NamedTuple, immutable like a frozen
    dataclass: one is made on every token request, and a frozen dataclass's __init__ costs
    2.5 times as much."""

    grant_type: str
    form: Mapping[str, str]
    now: float
    endpoint_url: str
    # The thumbprint of the key of the request's DPoP proof (RFC 9449 §5), checked; None
    # without one. Access tokens issued to the request are bound to it.
    dpop_jkt: str | None = None


class Grant(Protocol):
    grant_type: str

    async def issue(self, request: TokenRequest, client: Client) -> dict[str, Any]:
        """The token response, or OAuthError."""
        ...


def target_for(
    audiences: Audiences, client: Client, resource: str | None, scopes: Iterable[str]
) -> Target:
    """RFC 8707 §2: the audience `resource` names (the default one without it), one of the
    client's own resources or one registered with the server, else invalid_target; the
    scopes are then held to a registered resource's (protocol/resources.py)."""
    target = audiences.target(resource, client.resources)
    check_scopes(target, scopes)
    return target


def require_authorized_resource(resource: str | None, audience: str) -> None:
    """At the token endpoint, a code's `resource` (RFC 8707 §2.2) may only name the
    audience its authorization named: the grant is for that one, and never widens."""
    if resource is not None and resource != audience:
        raise OAuthError(
            ErrorCode.INVALID_TARGET, "resource is not the one this grant was authorized for"
        )


def may_refresh(client: Client, scopes: tuple[str, ...]) -> bool:
    """Refresh tokens only for clients allowed the grant, and for OpenID Connect requests
    only when offline_access was granted (OIDC Core §11)."""
    if "refresh_token" not in client.grant_types:
        return False
    return "openid" not in scopes or "offline_access" in scopes


def require_key(bound: str | None, request: TokenRequest, what: str) -> None:
    """A code bound with `dpop_jkt` (RFC 9449 §10) or a bound refresh token (§5) is usable
    only with a proof of the key it is bound to: without a proof, invalid_dpop_proof; with
    another key's, invalid_grant (the grant is not this key's, as a code is not another
    client's). Checked before anything changes, so the key's holder can still use it."""
    if bound is None:
        return
    if request.dpop_jkt is None:
        raise OAuthError(
            ErrorCode.INVALID_DPOP_PROOF, f"{what} is bound to a DPoP key: send a proof of it"
        )
    if request.dpop_jkt != bound:
        raise invalid_grant(f"{what} is bound to another DPoP key")


def refresh_binding(client: Client, request: TokenRequest) -> str | None:
    """The key a new refresh family is bound to: the proof's, for a public client (RFC 9449
    §5: a confidential client's refresh token is bound to its authentication instead)."""
    return request.dpop_jkt if client.public else None


class Registry:
    def __init__(self, grants: list[Grant]) -> None:
        self._grants = {g.grant_type: g for g in grants}

    def get(self, grant_type: str) -> Grant:
        grant = self._grants.get(grant_type)
        if grant is None:
            raise OAuthError(ErrorCode.UNSUPPORTED_GRANT_TYPE, "this grant_type is not supported")
        return grant

    def names(self) -> list[str]:
        return list(self._grants)
