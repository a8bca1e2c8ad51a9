"""DPoP proofs (RFC 9449): every check that needs no cryptography, and the server's nonces.

A proof is a JWT the client signs with a key whose public half it puts in the header. The
checks of §4.3 are split: the signature is verified by `authserver/dpop.py` (it needs a
cryptography library); what the header and claims must say, the key's thumbprint (RFC
7638), the comparison of `htu` with the URL the request was sent to, the hash of the access
token (`ath`) and the nonces are here, with the standard library only, so they are tested
without a server.

Nonces (§8) are stateless: a nonce names a time window and carries an HMAC of it under a
secret every replica shares, so any replica accepts what another issued, and nothing is
stored. A nonce is accepted in its window and the next one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# §4.3 item 5: asymmetric algorithms only, never `none` or a MAC (a MAC would be keyed
# with the public key the proof carries). The list discovery advertises
# (dpop_signing_alg_values_supported, §5.1).
ALGORITHMS = (
    "ES256",
    "ES384",
    "ES512",
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "EdDSA",
)
# The key each algorithm signs with: its `kty` and, for EC and OKP, the curves (RFC 7518
# §3.4, RFC 8037 §3.1). A proof whose `jwk` is of another kind is refused before any
# signature check.
_RSA_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")
_KEY_KINDS: dict[str, tuple[str, frozenset[str]]] = {
    "ES256": ("EC", frozenset({"P-256"})),
    "ES384": ("EC", frozenset({"P-384"})),
    "ES512": ("EC", frozenset({"P-521"})),
    "EdDSA": ("OKP", frozenset({"Ed25519", "Ed448"})),
    **{alg: ("RSA", frozenset()) for alg in _RSA_ALGORITHMS},
}
# RFC 7518 §3.3: RSA keys of 2048 bits or more.
MIN_RSA_BITS = 2048
PROOF_TYPE = "dpop+jwt"
# Members of a JWK that hold private or symmetric key material (RFC 7518 §6.2.2, §6.3.2,
# §6.4.1; RFC 8037 §2): a proof's `jwk` must have none of them (§4.3 item 7).
PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
# RFC 7638 §3.2: the members a thumbprint hashes, per key type (RFC 8037 §2 for OKP).
_THUMBPRINT_MEMBERS = {
    "EC": ("crv", "kty", "x", "y"),
    "RSA": ("e", "kty", "n"),
    "OKP": ("crv", "kty", "x"),
}
# A jti is a random identifier (§4.2); longer ones are refused rather than stored.
MAX_JTI_LENGTH = 256
# A JWK SHA-256 thumbprint: 32 bytes, base64url without padding (`dpop_jkt`, §10).
_THUMBPRINT = re.compile(r"^[A-Za-z0-9_-]{43}$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class ProofError(ValueError):
    """The proof fails a check of §4.3; the message says which, for the client."""


class NonceRequired(ProofError):
    """The proof carries no nonce, or one that is not (or no longer) the server's (§8, §9)."""


@dataclass(frozen=True)
class ProofClaims:
    """What a checked proof says."""

    jti: str
    iat: float
    nonce: str | None


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def is_thumbprint(value: str) -> bool:
    """Whether `value` can be a JWK SHA-256 thumbprint (`dpop_jkt`, §10)."""
    return bool(_THUMBPRINT.match(value))


def thumbprint(jwk: Mapping[str, Any]) -> str:
    """The JWK SHA-256 thumbprint (RFC 7638 §3): the required members, in lexicographic
    order, as JSON without whitespace, hashed. ProofError for a key type or member missing."""
    members = _THUMBPRINT_MEMBERS.get(str(jwk.get("kty")))
    if members is None:
        raise ProofError("the proof's jwk has an unsupported key type")
    values = {}
    for name in members:
        value = jwk.get(name)
        if not isinstance(value, str) or not value:
            raise ProofError(f"the proof's jwk lacks {name}")
        values[name] = value
    canonical = json.dumps(values, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return b64url(hashlib.sha256(canonical.encode()).digest())


def access_token_hash(access_token: str) -> str:
    """`ath` (§4.2): the base64url SHA-256 of the access token's ASCII bytes."""
    return b64url(hashlib.sha256(access_token.encode("ascii", "replace")).digest())


def normalized_url(url: str) -> str | None:
    """`url` without query and fragment, normalised as RFC 3986 §6.2.2 and §6.2.3 say:
    scheme and host in lower case, the scheme's default port dropped, an empty path as `/`,
    percent-encodings in upper case. None when it is not an absolute http(s) URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username or parts.password:
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        host = f"{host}:{port}"
    path = re.sub(r"%[0-9a-fA-F]{2}", lambda m: m.group(0).upper(), parts.path) or "/"
    return urlunsplit((scheme, host, path, "", ""))


def check_header(header: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """§4.3 items 4, 5 and 7: the `alg` and public `jwk` of a proof's JOSE header: the key
    of the type (and curve, or RSA size) the algorithm needs, without private members."""
    if header.get("typ") != PROOF_TYPE:
        raise ProofError("the proof's typ must be dpop+jwt")
    alg = header.get("alg")
    if alg not in ALGORITHMS:
        raise ProofError("the proof's alg is not an allowed asymmetric algorithm")
    jwk = header.get("jwk")
    if not isinstance(jwk, Mapping):
        raise ProofError("the proof's header must carry the public key as jwk")
    if PRIVATE_MEMBERS & set(jwk):
        raise ProofError("the proof's jwk must hold a public key only")
    kty, curves = _KEY_KINDS[str(alg)]
    if jwk.get("kty") != kty or (curves and jwk.get("crv") not in curves):
        raise ProofError("the proof's jwk is not a key for its alg")
    if kty == "RSA" and _rsa_bits(jwk.get("n")) < MIN_RSA_BITS:
        raise ProofError("the proof's RSA key is shorter than 2048 bits")
    return str(alg), jwk


def _rsa_bits(modulus: Any) -> int:
    """The size of an RSA modulus given base64url-encoded (RFC 7518 §6.3.1.1); 0 if it is not."""
    if not isinstance(modulus, str):
        return 0
    try:
        raw = base64.urlsafe_b64decode(modulus + "=" * (-len(modulus) % 4))
    except (ValueError, TypeError):
        return 0
    return int.from_bytes(raw, "big").bit_length()


def check_claims(
    claims: Mapping[str, Any],
    *,
    method: str,
    url: str,
    now: float,
    max_age: float,
    leeway: float,
    access_token: str | None = None,
) -> ProofClaims:
    """§4.3 items 3, 8, 9, 11 and 12 (the nonce, item 10, is `Nonces.check`'s):
    - the claims `jti`, `htm`, `htu` and `iat` are there, and `ath` with an access token;
    - `htm` is the request's method, `htu` its URL, query and fragment ignored, both
      normalised (RFC 3986 §6);
    - `iat` is at most `max_age` old and at most `leeway` ahead (§11.1);
    - `ath` is the hash of the access token the request presents (§4.3 item 12, §7)."""
    jti, htm, htu, iat = (claims.get(name) for name in ("jti", "htm", "htu", "iat"))
    if not isinstance(jti, str) or not jti or len(jti) > MAX_JTI_LENGTH:
        raise ProofError("the proof needs a jti of at most 256 characters")
    if not isinstance(htm, str) or not isinstance(htu, str):
        raise ProofError("the proof needs htm and htu")
    if isinstance(iat, bool) or not isinstance(iat, int | float):
        raise ProofError("the proof needs a numeric iat")
    if htm != method:
        raise ProofError("the proof's htm is not this request's method")
    expected = normalized_url(url)
    if expected is None or normalized_url(htu) != expected:
        raise ProofError("the proof's htu is not this endpoint's URL")
    if iat < now - max_age - leeway:
        raise ProofError("the proof is too old (iat)")
    if iat > now + leeway:
        raise ProofError("the proof is issued in the future (iat)")
    if access_token is not None:
        ath = claims.get("ath")
        if not isinstance(ath, str) or not hmac.compare_digest(
            ath.encode(), access_token_hash(access_token).encode()
        ):
            raise ProofError("the proof's ath is not the hash of the access token")
    nonce = claims.get("nonce")
    return ProofClaims(jti, float(iat), nonce if isinstance(nonce, str) else None)


class Nonces:
    """Server-provided nonces (§8, §9): the current one is an HMAC of the time window
    (`lifetime` long) under `secret`; a nonce of this window or the one before is valid."""

    def __init__(self, secret: bytes, lifetime: float) -> None:
        if lifetime <= 0:
            raise ValueError("a nonce lifetime is positive")
        self._key = hashlib.sha256(b"portcullis dpop nonce\x00" + secret).digest()
        self.lifetime = lifetime

    def _window(self, now: float) -> int:
        return int(now // self.lifetime)

    def _mac(self, window: int) -> bytes:
        return hmac.new(self._key, struct.pack(">Q", window), hashlib.sha256).digest()[:18]

    def current(self, now: float) -> str:
        window = self._window(now)
        return b64url(struct.pack(">Q", window) + self._mac(window))

    def check(self, nonce: str | None, now: float) -> None:
        """NonceRequired unless `nonce` is one this server issued, still valid at `now`."""
        if nonce is None:
            raise NonceRequired("the server requires a nonce in the proof")
        try:
            raw = base64.urlsafe_b64decode(nonce + "=" * (-len(nonce) % 4))
        except (ValueError, TypeError):
            raise NonceRequired("the proof's nonce is not the server's") from None
        if len(raw) != 26:
            raise NonceRequired("the proof's nonce is not the server's")
        (window,) = struct.unpack(">Q", raw[:8])
        if not hmac.compare_digest(raw[8:], self._mac(window)):
            raise NonceRequired("the proof's nonce is not the server's")
        if not 0 <= self._window(now) - window <= 1:
            raise NonceRequired("the proof's nonce has expired")
