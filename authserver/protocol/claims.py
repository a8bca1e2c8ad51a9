"""Which user claims a scope releases (OIDC Core §5.4), and the at_hash of an ID token."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

SCOPE_CLAIMS: Mapping[str, tuple[str, ...]] = {
    "profile": (
        "name",
        "family_name",
        "given_name",
        "middle_name",
        "nickname",
        "preferred_username",
        "profile",
        "picture",
        "website",
        "gender",
        "birthdate",
        "zoneinfo",
        "locale",
        "updated_at",
    ),
    "email": ("email", "email_verified"),
    "address": ("address",),
    "phone": ("phone_number", "phone_number_verified"),
    "roles": ("roles",),  # RFC 9068 §2.2.3.1: the user's roles, a list of strings
}


def released(user_claims: Mapping[str, Any], scopes: Iterable[str]) -> dict[str, Any]:
    """The user's claims the granted scopes release, as the user record has them."""
    out: dict[str, Any] = {}
    for scope in scopes:
        for name in SCOPE_CLAIMS.get(scope, ()):
            if name in user_claims and user_claims[name] is not None:
                out[name] = user_claims[name]
    return out


def supported_claims() -> list[str]:
    base = ["sub", "iss", "aud", "exp", "iat", "auth_time", "nonce", "at_hash", "azp", "amr", "acr"]
    return base + [c for names in SCOPE_CLAIMS.values() for c in names]


_HASH_OF_ALG = {"ES256": hashlib.sha256, "RS256": hashlib.sha256, "PS256": hashlib.sha256}


def at_hash(access_token: str, alg: str) -> str:
    """OIDC Core §3.1.3.6: left half of the hash of the token's ASCII octets, base64url.

    For EdDSA the hash is SHA-512 (OpenID Connect errata for Ed25519).
    """
    hash_fn = _HASH_OF_ALG.get(alg, hashlib.sha512 if alg == "EdDSA" else hashlib.sha256)
    digest = hash_fn(access_token.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest[: len(digest) // 2]).rstrip(b"=").decode()
