"""The private key this server signs its private_key_jwt assertions with when it is the client
of an upstream identity provider (RFC 7523 §2.2, OIDC Core §9): read once from a PEM file, its
algorithm following from its type (RSA RS256, P-256 ES256, Ed25519 EdDSA), its `kid` the
RFC 7638 thumbprint of its public key, as the provider's registration of it would name it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from portcullis.jose import thumbprint


@dataclass(frozen=True)
class SigningKey:
    key: Any  # a cryptography private key
    alg: str
    kid: str


def load_signing_key(path: str) -> SigningKey:
    """The key in the PEM file at `path`; OSError when it cannot be read, ValueError when it is
    not an unencrypted private key of a supported type."""
    with open(path, "rb") as file:
        data = file.read()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (TypeError, ValueError):
        raise ValueError("not an unencrypted PEM private key") from None
    if isinstance(key, rsa.RSAPrivateKey):
        if key.key_size < 2048:
            raise ValueError("an RSA key has at least 2048 bits")
        alg = "RS256"
    elif isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        alg = "ES256"
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        alg = "EdDSA"
    else:
        raise ValueError("the key must be RSA, EC P-256 or Ed25519")
    public = json.loads(jwt.algorithms.get_default_algorithms()[alg].to_jwk(key.public_key()))
    return SigningKey(key, alg, thumbprint(public))


def public_jwk(signing: SigningKey) -> dict[str, Any]:
    """The public key as a JWK, with its kid and alg: what the provider is given."""
    algorithm = jwt.algorithms.get_default_algorithms()[signing.alg]
    jwk: dict[str, Any] = json.loads(algorithm.to_jwk(signing.key.public_key()))
    return {**jwk, "kid": signing.kid, "alg": signing.alg, "use": "sig"}
