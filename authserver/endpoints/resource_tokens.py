"""Reading access tokens this server issued: signature, issuer, expiry, and revocation state.

Used by userinfo, introspection and revocation. Pure verification plus one store lookup.
"""

from __future__ import annotations

from typing import Any

import jwt

from ..keys import KeyRing
from ..store.base import Store


class AccessTokens:
    def __init__(self, keyring: KeyRing, alg: str, issuer: str, store: Store) -> None:
        self.keyring = keyring
        self.alg = alg
        self.issuer = issuer
        self.store = store

    async def active(self, token: str) -> dict[str, Any] | None:
        """The claims of a valid, unexpired, unrevoked access token of this server, else None."""
        try:
            header = jwt.get_unverified_header(token)
            if str(header.get("typ", "")).lower() not in ("at+jwt", "application/at+jwt"):
                return None
            claims = self.keyring.verify(
                token,
                [self.alg],
                issuer=self.issuer,
                options={"verify_aud": False, "require": ["exp", "iat", "jti", "sub", "client_id"]},
            )
        except (jwt.InvalidTokenError, ValueError):
            return None
        if not await self.store.access_token_active(str(claims["jti"])):
            return None
        return claims

    def signed(self, token: str) -> dict[str, Any] | None:
        """The claims of an access token this server signed, expired or not, else None."""
        try:
            return self.keyring.verify(
                token,
                [self.alg],
                issuer=self.issuer,
                options={"verify_aud": False, "verify_exp": False, "require": ["jti", "exp"]},
            )
        except (jwt.InvalidTokenError, ValueError):
            return None
