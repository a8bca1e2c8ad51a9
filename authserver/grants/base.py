"""What every grant type supplies, and the registry the token endpoint dispatches on.

The token endpoint runs the shared steps (parse, look up the grant, authenticate the
client, check the client may use the grant) before `Grant.issue`, so no grant can forget
one. A grant only answers: given an authenticated client and the request, what tokens?
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol.errors import ErrorCode, OAuthError
from ..registry import Client

audit = logging.getLogger("portcullis.authserver.audit")

# A compare-and-set that lost means the object's state moved on, and states only move
# forward (lifecycle.py): decided again, the next attempt needs no compare-and-set. More
# attempts than this means a bug.
ATTEMPTS = 3


@dataclass(frozen=True)
class TokenRequest:
    grant_type: str
    form: Mapping[str, str]
    now: float
    endpoint_url: str


class Grant(Protocol):
    grant_type: str

    async def issue(self, request: TokenRequest, client: Client) -> dict[str, Any]:
        """The token response, or OAuthError."""
        ...


def audience_for(default_audience: str, client: Client, resource: str | None) -> str:
    """RFC 8707 §2: `resource` names the audience, and must be one this client may use."""
    if resource is None:
        return default_audience
    if resource not in client.resources:
        raise OAuthError(ErrorCode.INVALID_TARGET, "resource is not one this client may use")
    return resource


def may_refresh(client: Client, scopes: tuple[str, ...]) -> bool:
    """Refresh tokens only for clients allowed the grant, and for OpenID Connect requests
    only when offline_access was granted (OIDC Core §11)."""
    if "refresh_token" not in client.grant_types:
        return False
    return "openid" not in scopes or "offline_access" in scopes


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
