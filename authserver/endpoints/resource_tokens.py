"""Reading access tokens this server issued: signature, issuer, expiry, and revocation state.

Used by userinfo, introspection, revocation and the admin API. Verification, then the
store: the token revoked (itself or its grant), its client gone or its secret rotated
since it was issued, its user gone or disabled (events.Revocations cuts them off) all make it
inactive.
"""

from __future__ import annotations

from typing import Any

import jwt

from ..keys import SigningRing
from ..registry import ClientRegistry, UserDirectory
from ..store.base import Store


class AccessTokens:
    def __init__(
        self,
        keyring: SigningRing,
        alg: str,
        issuer: str,
        store: Store,
        clients: ClientRegistry,
        users: UserDirectory,
    ) -> None:
        self.keyring = keyring
        self.alg = alg
        self.issuer = issuer
        self.store = store
        self.clients = clients
        self.users = users

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
        client = await self.clients.client(str(claims["client_id"]))
        # iat is in whole seconds: a token from the second of a rotation is refused, even
        # one issued just after it (the client asks again a second later).
        if client is None or int(claims["iat"]) <= int(client.tokens_valid_from):
            return None
        subject = str(claims["sub"])
        # client_credentials tokens have the client as their subject; others a user.
        if subject != client.client_id and await self.users.by_subject(subject) is None:
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
