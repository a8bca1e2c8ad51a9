"""Reading access tokens this server issued: signature, issuer, expiry, and revocation state.

Used by userinfo and introspection. Pure verification plus one store lookup.
"""

from __future__ import annotations

from typing import Any

import jwt

from .common import Services


async def active_access_token(svc: Services, token: str) -> dict[str, Any] | None:
    """The claims of a valid, unexpired, unrevoked access token of this server, else None."""
    try:
        header = jwt.get_unverified_header(token)
        if str(header.get("typ", "")).lower() not in ("at+jwt", "application/at+jwt"):
            return None
        claims = svc.keyring.verify(
            token,
            [svc.settings.keys.access_token_alg],
            issuer=svc.settings.issuer,
            options={"verify_aud": False, "require": ["exp", "iat", "jti", "sub", "client_id"]},
        )
    except (jwt.InvalidTokenError, ValueError):
        return None
    if not await svc.store.access_token_active(str(claims["jti"])):
        return None
    return claims
