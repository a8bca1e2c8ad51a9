"""A DPoP client key for tests: it signs proofs (RFC 9449 §4.2) a test can break one part at
a time, and knows its own JWK thumbprint (RFC 7638), computed here independently of the
server's code."""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from tests.support import low_s_jws


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def ath_of(access_token: str) -> str:
    return _b64(hashlib.sha256(access_token.encode()).digest())


class DpopKey:
    """An EC P-256 key pair a client proves possession of."""

    def __init__(self) -> None:
        self.private = ec.generate_private_key(ec.SECP256R1())
        self.jwk: dict[str, Any] = ECAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        members = {k: self.jwk[k] for k in ("crv", "kty", "x", "y")}
        canonical = json.dumps(members, separators=(",", ":"), sort_keys=True)
        self.jkt = _b64(hashlib.sha256(canonical.encode()).digest())

    def proof(
        self,
        htu: str,
        htm: str = "POST",
        *,
        access_token: str | None = None,
        nonce: str | None = None,
        iat: float | None = None,
        header: dict[str, Any] | None = None,
        signer: Any = None,
        alg: str = "ES256",
        omit: tuple[str, ...] = (),
        **claims: Any,
    ) -> str:
        """A proof for `htm htu`; `claims` replace claims (None or `omit` drops one), `header` JOSE
        header members, `signer` the key it is signed with (another key: a forged proof)."""
        body: dict[str, Any] = {
            "jti": uuid.uuid4().hex,
            "htm": htm,
            "htu": htu,
            "iat": int(time.time() if iat is None else iat),
        }
        if access_token is not None:
            body["ath"] = ath_of(access_token)
        if nonce is not None:
            body["nonce"] = nonce
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None and k not in omit}
        headers = {"typ": "dpop+jwt", "jwk": self.jwk, **(header or {})}
        key = self.private if signer is None else signer
        return low_s_jws(jwt.encode(body, key, algorithm=alg, headers=headers))
