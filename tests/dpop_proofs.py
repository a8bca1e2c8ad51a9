"""A DPoP client's side, for tests: a key pair and the proofs it signs (RFC 9449 §4.2).

Built by hand from the RFC (not with the gateway's code), so that the gateway's checks are
tested against an independent reading; every member can be changed or removed to make the
proof each negative test needs.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import get_default_algorithms

from portcullis.jose import low_s
from tests.support import b64url, compact, public_jwk

_REMOVE = object()


def _new_key(alg: str) -> Any:
    if alg.startswith(("RS", "PS")):
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    curves = {"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(), "ES512": ec.SECP521R1()}
    if alg in curves:
        return ec.generate_private_key(curves[alg])
    if alg == "EdDSA":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(alg)


def jwk_thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638 §3: the required members in lexicographic order, no whitespace, SHA-256."""
    required = {
        "EC": ("crv", "kty", "x", "y"),
        "RSA": ("e", "kty", "n"),
        "OKP": ("crv", "kty", "x"),
    }[jwk["kty"]]
    canonical = "{" + ",".join(f'"{name}":"{jwk[name]}"' for name in required) + "}"
    return b64url(hashlib.sha256(canonical.encode()).digest())


def token_hash(token: str) -> str:
    return b64url(hashlib.sha256(token.encode()).digest())


@dataclass
class DpopKey:
    """A client's DPoP key: `proof(...)` signs a proof for one request."""

    alg: str = "ES256"
    private: Any = None
    extra_jwk: dict[str, Any] = field(default_factory=dict)  # members added to the jwk

    def __post_init__(self) -> None:
        if self.private is None:
            self.private = _new_key(self.alg)

    @property
    def jwk(self) -> dict[str, Any]:
        jwk = public_jwk(self.private, "unused", self.alg)
        for member in ("kid", "alg", "use"):
            jwk.pop(member)
        jwk.update(self.extra_jwk)
        return jwk

    @property
    def jkt(self) -> str:
        return jwk_thumbprint(self.jwk)

    @property
    def cnf(self) -> dict[str, str]:
        """The `cnf` claim of a token bound to this key (RFC 9449 §6.1)."""
        return {"jkt": self.jkt}

    def proof(
        self,
        method: str,
        url: str,
        token: str | None = None,
        *,
        iat: float | None = None,
        header: dict[str, Any] | None = None,
        sign_alg: str | None = None,
        **claims: Any,
    ) -> str:
        """A proof for `method url` with `ath` of `token`; `header` and `claims` change or,
        with `REMOVE`, drop members; `sign_alg` signs with another algorithm than `alg`."""
        head: dict[str, Any] = {"typ": "dpop+jwt", "alg": self.alg, "jwk": self.jwk}
        body: dict[str, Any] = {
            "jti": uuid.uuid4().hex,
            "htm": method,
            "htu": url,
            "iat": int(time.time()) if iat is None else iat,
        }
        if token is not None:
            body["ath"] = token_hash(token)
        head.update(header or {})
        body.update(claims)
        head = {k: v for k, v in head.items() if v is not REMOVE}
        body = {k: v for k, v in body.items() if v is not REMOVE}
        algorithm = get_default_algorithms()[sign_alg or self.alg]
        if (sign_alg or self.alg) == "none":
            return compact(head, body)
        # Low S (portcullis.jose.low_s): of a proof and its twin (r, n - s), the twin is high.
        signing = sign_alg or self.alg
        return compact(head, body, lambda data: low_s(signing, algorithm.sign(data, self.private)))


REMOVE: Any = _REMOVE


# Spellings of a proof's htu for a request to origin + path, and whether each names the
# request's URI (RFC 9449 §4.3 item 9): the same after RFC 3986 §6.2.2 normalisation (dot
# segments removed, percent-encoded unreserved characters decoded), or another URI, or none
# (a control character, a space: RFC 3986 §2 has no place for them). Both services are held
# to this one table (tests/gateway/test_dpop_gateway.py, tests/authserver/test_dpop.py).
HTU_SPELLINGS: dict[str, tuple[Callable[[str, str], str], bool]] = {
    "dot-segment": (lambda origin, path: f"{origin}/.{path}", True),
    "dot-dot-segment": (lambda origin, path: f"{origin}/x/..{path}", True),
    "encoded-dot-dot": (lambda origin, path: f"{origin}/x/%2e%2e{path}", True),
    "encoded-dot-upper-case": (lambda origin, path: f"{origin}/%2E{path}", True),
    "dot-dot-above-the-root": (lambda origin, path: f"{origin}/..{path}", True),
    "encoded-unreserved": (lambda origin, path: f"{origin}/%{ord(path[1]):02x}{path[2:]}", True),
    "up-out-of-it": (lambda origin, path: f"{origin}{path}/..", False),
    "encoded-up-out-of-it": (lambda origin, path: f"{origin}{path}/%2e%2e", False),
    "up-to-a-sibling": (lambda origin, path: f"{origin}{path}/../x", False),
    "encoded-dot-dot-as-a-name": (lambda origin, path: f"{origin}{path}%2e%2e", False),
    "tab": (lambda origin, path: f"{origin}{path[:2]}\t{path[2:]}", False),
    "newline-before-the-path": (lambda origin, path: f"{origin}\n{path}", False),
    "carriage-return-at-the-end": (lambda origin, path: f"{origin}{path}\r", False),
    "nul": (lambda origin, path: f"{origin}{path}\x00", False),
    "delete": (lambda origin, path: f"{origin}{path}\x7f", False),
    "space": (lambda origin, path: f"{origin}{path} ", False),
}


def htu_spelling(case: str, url: str) -> tuple[str, bool]:
    """The htu of `case` (HTU_SPELLINGS) for a request to `url`, and whether it matches."""
    spell, same = HTU_SPELLINGS[case]
    parts = urlsplit(url)
    return spell(f"{parts.scheme}://{parts.netloc}", parts.path), same
