"""Access tokens (RFC 9068 JWTs) and ID tokens (OIDC Core §2): their claims, decided before
an issuance is committed, and their signatures, made after.

A `TokenPlan` is a token response before signing: every claim set (the access token's `jti`
included) and the refresh token drawn. The store commits the issuance the plan describes;
only then does `Minter.sign` turn the plan into the response. The plan of a rotation is also
sealed under the presented refresh token, so that a retry within the grace window is
answered with the same tokens, signed again.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from portcullis.unique import UniqueBytes

from .keys import SigningRing, b64url
from .protocol import assurance
from .protocol import scopes as scope_rules
from .protocol.claims import at_hash, released


def random_token(nbytes: int = 32) -> str:
    return secrets.token_urlsafe(nbytes)


def digest(secret: str) -> bytes:
    """What the store keeps of a code, refresh token, device code or session id."""
    return hashlib.sha256(secret.encode()).digest()


_UNIQUE = UniqueBytes()


def new_jti() -> str:
    """128 random bits, base64url without padding (22 characters)."""
    return b64url(_UNIQUE.take(16)).decode()


@dataclass(frozen=True)
class MintedAccessToken:
    token: str
    jti: str
    expires_at: int
    expires_in: int


class TokenPlan(NamedTuple):
    """A token response with every claim decided and nothing signed yet. A NamedTuple, for
    the reason TokenRequest is one (grants/base.py)."""

    access_claims: Mapping[str, Any]
    expires_in: int
    scopes: tuple[str, ...]
    refresh_token: str | None = None
    id_claims: Mapping[str, Any] | None = None  # without at_hash: it hashes the signed token
    id_alg: str | None = None

    @property
    def jti(self) -> str:
        return str(self.access_claims["jti"])

    @property
    def dpop_jkt(self) -> str | None:
        """The thumbprint of the DPoP key the access token is bound to, if any."""
        cnf = self.access_claims.get("cnf")
        jkt = cnf.get("jkt") if isinstance(cnf, Mapping) else None
        return jkt if isinstance(jkt, str) else None

    @property
    def access_expires_at(self) -> float:
        return float(self.access_claims["exp"])

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "v": _PLAN_VERSION,
                "access_claims": self.access_claims,
                "expires_in": self.expires_in,
                "scopes": list(self.scopes),
                "refresh_token": self.refresh_token,
                "id_claims": self.id_claims,
                "id_alg": self.id_alg,
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> TokenPlan | None:
        """The plan, or None for anything else (a plan of another version included)."""
        value = orjson.loads(data)
        if not isinstance(value, dict) or value.get("v") != _PLAN_VERSION:
            return None
        return cls(
            access_claims=value["access_claims"],
            expires_in=int(value["expires_in"]),
            scopes=tuple(value["scopes"]),
            refresh_token=value["refresh_token"],
            id_claims=value["id_claims"],
            id_alg=value["id_alg"],
        )


_PLAN_VERSION = 1


class Minter:
    def __init__(
        self,
        keyring: SigningRing,
        *,
        issuer: str,
        access_alg: str,
        id_alg: str,
        access_lifetime: timedelta,
        id_lifetime: timedelta,
    ) -> None:
        """`id_alg` signs the ID tokens of clients registered without an algorithm of their
        own; every lifetime counts whole seconds (`exp` is a NumericDate)."""
        self.issuer = issuer
        self.keyring = keyring
        self.access_alg = access_alg
        self.id_alg = id_alg
        self.access_lifetime = int(access_lifetime.total_seconds())
        self.id_lifetime = int(id_lifetime.total_seconds())

    def access_claims(
        self,
        *,
        subject: str,
        client_id: str,
        scope: str,
        audience: str,
        now: float,
        auth_time: float | None = None,
        jkt: str | None = None,
    ) -> dict[str, Any]:
        """The claims of an access token; bound to a DPoP key when `jkt` names one (RFC 9449
        §6.1: its thumbprint as `cnf.jkt`)."""
        iat = int(now)
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": subject,
            "aud": audience,
            "exp": iat + self.access_lifetime,
            "iat": iat,
            "jti": new_jti(),
            "client_id": client_id,
            "scope": scope,
        }
        if auth_time is not None:
            claims["auth_time"] = int(auth_time)
        if jkt is not None:
            claims["cnf"] = {"jkt": jkt}
        return claims

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
        """An access token signed at once: for tokens nothing is recorded of
        (client_credentials)."""
        claims = self.access_claims(
            subject=subject,
            client_id=client_id,
            scope=scope,
            audience=audience,
            now=now,
            auth_time=auth_time,
        )
        token = self.keyring.sign(self.access_alg, claims, typ="at+jwt")
        return MintedAccessToken(token, claims["jti"], claims["exp"], self.access_lifetime)

    def id_claims(
        self,
        *,
        subject: str,
        user_claims: Mapping[str, Any],
        client_id: str,
        scopes: Iterable[str],
        nonce: str | None,
        auth_time: float,
        now: float,
        amr: Sequence[str] = (),
    ) -> dict[str, Any]:
        iat = int(now)
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": subject,
            "aud": client_id,
            "azp": client_id,
            "exp": iat + self.id_lifetime,
            "iat": iat,
            "auth_time": int(auth_time),
        }
        if nonce is not None:
            claims["nonce"] = nonce
        if amr:
            # OIDC Core §2: how the user authenticated, and the level that makes. A sign-in
            # at a provider that named no method claims none.
            named = [method for method in amr if method != assurance.EXTERNAL]
            if named:
                claims["amr"] = named
            claims["acr"] = assurance.acr_of(amr)
        claims.update(released(user_claims, scopes))
        return claims

    def sign(self, plan: TokenPlan, *, repeatable: bool = True) -> dict[str, Any]:
        """The token response of a committed plan (RFC 6749 §5.1). `repeatable`: signed
        again, the plan gives the same response (a refresh retried within the grace window
        is answered byte for byte); False where a plan is never signed again."""
        access_token = self.keyring.sign(
            self.access_alg, plan.access_claims, typ="at+jwt", repeatable=repeatable
        )
        body: dict[str, Any] = {
            "access_token": access_token,
            # RFC 9449 §5.1: a token bound to a DPoP key is of type DPoP.
            "token_type": "DPoP" if plan.dpop_jkt is not None else "Bearer",
            "expires_in": plan.expires_in,
            "scope": scope_rules.render(plan.scopes),
        }
        if plan.refresh_token is not None:
            body["refresh_token"] = plan.refresh_token
        if plan.id_claims is not None:
            alg = plan.id_alg or self.id_alg
            claims = {**plan.id_claims, "at_hash": at_hash(access_token, alg)}
            body["id_token"] = self.keyring.sign(alg, claims, typ="JWT")
        return body


def _seal_key(refresh_token: str) -> bytes:
    return hashlib.sha256(b"portcullis refresh successor\x00" + refresh_token.encode()).digest()


def seal(plan: TokenPlan, refresh_token: str) -> bytes:
    """Encrypt a plan under a key only the presenter of `refresh_token` can derive."""
    nonce = _UNIQUE.take(12)  # unique under a key that is this refresh token's alone
    return nonce + AESGCM(_seal_key(refresh_token)).encrypt(nonce, plan.to_json(), None)


def unseal(sealed: bytes, refresh_token: str) -> TokenPlan | None:
    try:
        plain = AESGCM(_seal_key(refresh_token)).decrypt(sealed[:12], sealed[12:], None)
    except (InvalidTag, ValueError):
        return None
    return TokenPlan.from_json(plain)
