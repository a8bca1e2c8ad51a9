"""Minting access tokens (RFC 9068 JWTs) and ID tokens (OIDC Core §2), and sealing the
response of a refresh so that a retry within the grace window can be answered again.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .keys import KeyRing
from .protocol.claims import at_hash, released
from .settings import Settings


def random_token(nbytes: int = 32) -> str:
    return secrets.token_urlsafe(nbytes)


def digest(secret: str) -> bytes:
    """What the store keeps of a code, refresh token, device code or session id."""
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True)
class MintedAccessToken:
    token: str
    jti: str
    expires_at: int
    expires_in: int


class Minter:
    def __init__(self, settings: Settings, keyring: KeyRing) -> None:
        self.settings = settings
        self.keyring = keyring
        self.access_alg = settings.keys.access_token_alg
        self.id_alg = settings.keys.id_token_alg
        self.access_lifetime = int(settings.lifetimes.access_token.total_seconds())
        self.id_lifetime = int(settings.lifetimes.id_token.total_seconds())

    def access_token(
        self,
        *,
        subject: str,
        client_id: str,
        scope: str,
        audience: str,
        now: float,
        auth_time: float | None = None,
    ) -> MintedAccessToken:
        iat = int(now)
        exp = iat + self.access_lifetime
        jti = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        claims: dict[str, Any] = {
            "iss": self.settings.issuer,
            "sub": subject,
            "aud": audience,
            "exp": exp,
            "iat": iat,
            "jti": jti,
            "client_id": client_id,
            "scope": scope,
        }
        if auth_time is not None:
            claims["auth_time"] = int(auth_time)
        token = self.keyring.sign(self.access_alg, claims, typ="at+jwt")
        return MintedAccessToken(token, jti, exp, self.access_lifetime)

    def id_token(
        self,
        *,
        subject: str,
        user_claims: Mapping[str, Any],
        client_id: str,
        scopes: Iterable[str],
        nonce: str | None,
        auth_time: float,
        access_token: str | None,
        now: float,
        alg: str | None = None,
    ) -> str:
        alg = alg or self.id_alg
        iat = int(now)
        claims: dict[str, Any] = {
            "iss": self.settings.issuer,
            "sub": subject,
            "aud": client_id,
            "azp": client_id,
            "exp": iat + self.id_lifetime,
            "iat": iat,
            "auth_time": int(auth_time),
        }
        if nonce is not None:
            claims["nonce"] = nonce
        if access_token is not None:
            claims["at_hash"] = at_hash(access_token, alg)
        claims.update(released(user_claims, scopes))
        return self.keyring.sign(alg, claims, typ="JWT")


def _seal_key(refresh_token: str) -> bytes:
    return hashlib.sha256(b"portcullis refresh successor\x00" + refresh_token.encode()).digest()


def seal(response: Mapping[str, Any], refresh_token: str) -> bytes:
    """Encrypt a token response under a key only the presenter of `refresh_token` can derive."""
    nonce = os.urandom(12)
    return nonce + AESGCM(_seal_key(refresh_token)).encrypt(nonce, orjson.dumps(response), None)


def unseal(sealed: bytes, refresh_token: str) -> dict[str, Any] | None:
    try:
        plain = AESGCM(_seal_key(refresh_token)).decrypt(sealed[:12], sealed[12:], None)
    except (InvalidTag, ValueError):
        return None
    value = orjson.loads(plain)
    return value if isinstance(value, dict) else None
