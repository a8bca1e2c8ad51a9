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

from ..metrics import Metrics
from ..protocol import scopes as scope_rules
from ..protocol.errors import ErrorCode, OAuthError
from ..settings import ClientSettings, Settings
from ..store.base import Store
from ..tokens import Minter

audit = logging.getLogger("portcullis.authserver.audit")


@dataclass(frozen=True)
class TokenRequest:
    grant_type: str
    form: Mapping[str, str]
    now: float
    endpoint_url: str


@dataclass(frozen=True)
class GrantContext:
    settings: Settings
    store: Store
    minter: Minter
    metrics: Metrics


class Grant(Protocol):
    grant_type: str

    async def issue(self, request: TokenRequest, client: ClientSettings) -> dict[str, Any]:
        """The token response, or OAuthError."""
        ...


def audience_for(settings: Settings, client: ClientSettings, resource: str | None) -> str:
    """RFC 8707 §2: `resource` names the audience, and must be one this client may use."""
    if resource is None:
        return settings.default_audience or settings.issuer
    if resource not in client.resources:
        raise OAuthError(ErrorCode.INVALID_TARGET, "resource is not one this client may use")
    return resource


def may_refresh(client: ClientSettings, scopes: tuple[str, ...]) -> bool:
    """Refresh tokens only for clients allowed the grant, and for OpenID Connect requests
    only when offline_access was granted (OIDC Core §11)."""
    if "refresh_token" not in client.grant_types:
        return False
    return "openid" not in scopes or "offline_access" in scopes


def token_response(
    access_token: str, expires_in: int, scopes: tuple[str, ...], **extra: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "access_token": access_token,
        "token_type": "Bearer",
        "expires_in": expires_in,
        "scope": scope_rules.render(scopes),
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


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
