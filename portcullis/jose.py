"""JOSE for both services, once: what a JWS is made of and how its signature is checked
(RFC 7515, RFC 7518, RFC 8037), the RFC 7638 thumbprint of a JWK, and the one spelling of
an ECDSA signature. Pure: no I/O, no policy, nothing of either service (the standard
library, cryptography and orjson alone); which algorithms are accepted, and what a refusal
says, is the caller's.

- base64url in its one canonical spelling (`b64url_decode`, `b64url_encode`);
- the compact serialisation (`compact_parts`) and its JSON object parts (`json_object`);
- `verify_signature`: a key's signature of a signing input by one of the asymmetric
  algorithms (`SIGNATURE_ALGORITHMS`; never `none` or a MAC);
- `thumbprint` (RFC 7638) of a public JWK, and `is_thumbprint` for one a client names;
- the low-S rule of ECDSA signatures (`is_low_s`, `low_s`), below.

ECDSA signatures of JWS (ES256, ES384, ES512) in one spelling: the low-S form.

An ECDSA signature is a pair (r, s); RFC 7518 §3.4 writes it as R || S, each a big-endian
integer as wide as the curve's order n. Whoever holds a signature (r, s) can make a second
one without the key: (r, n - s) verifies just as well (SEC 1 §4.1.4 only ever reads s
through its inverse, and negating s negates the point whose x is compared with r). So every
ES* token has two spellings that verify, and anything keyed on a token's text (a cache of
verified tokens, say) sees two tokens. The canonical spelling is the one with s <= n / 2
(`is_low_s`; the rule of Bitcoin's BIP 62 and of libsecp256k1); `low_s` turns either one
into it. Other algorithms have one spelling already: RSA signatures are one integer below
the modulus, and EdDSA's S must be below the group order (RFC 8032 §5.1.7), which the
verifiers enforce.

RFC 7515 and RFC 7518 do not require low S, and most signers do not produce it
(cryptography, OpenSSL, Java's ECDSA as in Keycloak, browsers' WebCrypto: random S, high half
the time). So which spellings are accepted is decided per kind of JWS, by who signs it and
what is keyed on it:

- Access tokens at the gateway are accepted in either spelling: the gateway trusts any
  standards issuer, and refusing high S would refuse half of those issuers' tokens. Instead
  what is keyed on a token is keyed on its low-S spelling (gateway/verifiers/cache.py
  `canonical_spelling`): a token and its twin are one entry of the verified-token cache and
  of the introspection caches, in memory and in Redis. The deny-set names tokens by `jti`
  and so covers both spellings.
- Revocation events (SETs) at the gateway come from this project's authorization server
  alone, which signs low S: a high-S SET is refused like one whose signature does not verify.
- Tokens the authorization server reads back (its access tokens at introspection, userinfo,
  revocation and the admin API; its ID tokens as logout hints) are its own, signed low S by
  its key ring (authserver/keys.py): a high-S one is refused like a bad signature.
- DPoP proofs (RFC 9449) at both and client assertions (RFC 7523) at the authorization
  server are signed by clients, often with WebCrypto: refusing high S would refuse half of
  their proofs, so both spellings are accepted. Nothing keys on their signatures: the replay
  caches hold the key's thumbprint and the `jti` (a proof), or the client and the `jti` (an
  assertion), so a used proof's twin is a replay and refused as one; `ath` is the hash of
  the access token, not of the proof.

So the authorization server goes first in an upgrade: gateways refuse the high-S half of
the events an earlier server signs, and a server refuses the high-S tokens an earlier one
issued, for the rest of their lifetime.

Curve orders from SEC 2 (version 2) §2.4.2, §2.5.1, §2.6.1 (secp256r1, secp384r1,
secp521r1: the P-256, P-384 and P-521 of RFC 7518 §3.4).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

# ---------------------------------------------------------------------------- base64url

_B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_B64URL_TEXT = re.compile(r"[A-Za-z0-9_-]*")
# RFC 4648 §3.5: the bits a final partial group leaves unused must be zero. With 2 characters
# left the last one carries 4 unused bits, with 3 it carries 2; only the characters whose
# unused bits are zero spell the bytes canonically. (PyJWT's decoder accepts any of them.)
_CANONICAL_LAST = {
    2: frozenset(_B64URL[::16]),
    3: frozenset(_B64URL[::4]),
}


def b64url_decode(part: str) -> bytes:
    """Unpadded base64url (RFC 7515 §2) in its one canonical spelling, else binascii.Error:
    no `=`, nothing outside the alphabet, no length that no bytes encode to, zero pad bits."""
    if not _B64URL_TEXT.fullmatch(part):
        raise binascii.Error("not base64url")
    return decode_checked_alphabet(part)


def decode_checked_alphabet(part: str) -> bytes:
    """`b64url_decode` for text already known to hold base64url characters alone (a compact
    JWS that matched its pattern): the length and the pad bits are still checked."""
    rest = len(part) % 4
    if rest:
        if rest == 1 or part[-1] not in _CANONICAL_LAST[rest]:
            raise binascii.Error("not canonical base64url")
        part += "==" if rest == 2 else "="
    # The alphabet is proven, so the standard decoder's own pass over it is not needed:
    # RFC 4648 §5 differs from §4 in these two characters only.
    return binascii.a2b_base64(part.replace("-", "+").replace("_", "/"))


def b64url_encode(data: bytes) -> str:
    """Unpadded base64url (RFC 7515 §2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


# ---------------------------------------------------------------------------- compact JWS

# What a compact JWS is made of: base64url text and the two dots between its parts.
_COMPACT_CHARACTERS = (_B64URL + ".").encode()


def compact_parts(text: str) -> list[str] | None:
    """The header, payload and signature of a JWS in compact serialisation (RFC 7515 §7.1),
    each non-empty base64url text, else None. The same test as a full match of
    `[A-Za-z0-9_-]+\\.[A-Za-z0-9_-]+\\.[A-Za-z0-9_-]+`, made by one `bytes.translate` pass
    (a third of the regular expression's time on a token of 500 characters)."""
    if not text.isascii() or text.encode().translate(None, _COMPACT_CHARACTERS):
        return None
    parts = text.split(".")
    if len(parts) != 3 or not (parts[0] and parts[1] and parts[2]):
        return None
    return parts


class NotAnObject(ValueError):
    """A part of a compact JWS that does not encode a JSON object; `problem` says how, as
    the end of a sentence naming the part ("is not a JSON object")."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def json_object(part: str) -> dict[str, Any]:
    """The JSON object the header or payload of a compact JWS encodes (`part` as
    `compact_parts` gave it, so its alphabet is proven), else NotAnObject."""
    try:
        value = orjson.loads(decode_checked_alphabet(part))
    except (binascii.Error, ValueError):
        raise NotAnObject("is not base64url-encoded JSON") from None
    if not isinstance(value, dict):
        raise NotAnObject("is not a JSON object")
    return value


# ---------------------------------------------------------------------------- signatures


class _Ecdsa:
    """ECDSA on one curve (RFC 7518 §3.4): the signature is R and S, each as many bytes as
    the curve's order needs, concatenated; cryptography wants them DER-encoded."""

    def __init__(self, curve: ec.EllipticCurve, hash_: hashes.HashAlgorithm) -> None:
        self._curve = type(curve)
        self._half = (curve.key_size + 7) // 8
        self._algorithm = ec.ECDSA(hash_)

    def verify(self, key: Any, signing_input: bytes, signature: bytes) -> bool:
        half = self._half
        if (
            len(signature) != 2 * half
            or not isinstance(key, ec.EllipticCurvePublicKey)
            or not isinstance(key.curve, self._curve)
        ):
            return False
        der = encode_dss_signature(
            int.from_bytes(signature[:half], "big"), int.from_bytes(signature[half:], "big")
        )
        try:
            key.verify(der, signing_input, self._algorithm)
        except InvalidSignature:
            return False
        return True


class _Rsa:
    """RSASSA-PKCS1-v1_5 (RFC 7518 §3.3) or RSASSA-PSS (§3.5) with one hash."""

    def __init__(self, scheme: padding.AsymmetricPadding, hash_: hashes.HashAlgorithm) -> None:
        self._padding = scheme
        self._hash = hash_

    def verify(self, key: Any, signing_input: bytes, signature: bytes) -> bool:
        if not isinstance(key, rsa.RSAPublicKey):
            return False
        try:
            key.verify(signature, signing_input, self._padding, self._hash)
        except InvalidSignature:
            return False
        return True


def _pss(hash_: hashes.HashAlgorithm) -> _Rsa:
    # RFC 7518 §3.5: MGF1 with the same hash, and a salt as long as the hash's output.
    return _Rsa(padding.PSS(mgf=padding.MGF1(hash_), salt_length=hash_.digest_size), hash_)


class _EdDsa:
    """EdDSA (RFC 8037 §3.1) with an Ed25519 or Ed448 key."""

    def verify(self, key: Any, signing_input: bytes, signature: bytes) -> bool:
        if not isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
            return False
        try:
            key.verify(signature, signing_input)
        except InvalidSignature:
            return False
        return True


# Built once: the padding, hash and signature-algorithm objects serve every verification.
_VERIFIERS: Mapping[str, _Ecdsa | _Rsa | _EdDsa] = {
    "RS256": _Rsa(padding.PKCS1v15(), hashes.SHA256()),
    "RS384": _Rsa(padding.PKCS1v15(), hashes.SHA384()),
    "RS512": _Rsa(padding.PKCS1v15(), hashes.SHA512()),
    "PS256": _pss(hashes.SHA256()),
    "PS384": _pss(hashes.SHA384()),
    "PS512": _pss(hashes.SHA512()),
    "ES256": _Ecdsa(ec.SECP256R1(), hashes.SHA256()),
    "ES384": _Ecdsa(ec.SECP384R1(), hashes.SHA384()),
    "ES512": _Ecdsa(ec.SECP521R1(), hashes.SHA512()),
    "EdDSA": _EdDsa(),
}
# The asymmetric JWS algorithms (RFC 7518 §3.1, RFC 8037 §3.1); never `none` nor a MAC.
SIGNATURE_ALGORITHMS = frozenset(_VERIFIERS)


def verify_signature(alg: str, key: Any, signing_input: bytes, signature: bytes) -> bool:
    """Whether `signature` is `key`'s signature of `signing_input` by `alg`, one of
    SIGNATURE_ALGORITHMS. A key of another type than `alg` needs (or on another curve) never
    verifies; the callers refuse such keys before, with their own reasons."""
    return _VERIFIERS[alg].verify(key, signing_input, signature)


# ---------------------------------------------------------------------------- thumbprints

# RFC 7638 §3.2: the members of each key type that its thumbprint covers, in lexicographic
# order (RFC 8037 §2 for OKP).
_THUMBPRINT_MEMBERS: Mapping[str, tuple[str, ...]] = {
    "EC": ("crv", "kty", "x", "y"),
    "RSA": ("e", "kty", "n"),
    "OKP": ("crv", "kty", "x"),
}


def thumbprint(jwk: Mapping[str, Any]) -> str:
    """The RFC 7638 thumbprint (SHA-256, base64url) of a public JWK whose type is EC, RSA or
    OKP; ValueError when the type is another or a member it covers is missing, empty or not
    a string."""
    members = _THUMBPRINT_MEMBERS.get(jwk.get("kty"))  # type: ignore[arg-type]
    if members is None:
        raise ValueError("unsupported key type")
    required = {}
    for name in members:
        value = jwk.get(name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"the key has no {name}")
        required[name] = value
    # RFC 7638 §3.3: the members in lexicographic order, as UTF-8 JSON without whitespace
    # (orjson writes the dict in the order built, which `members` gives).
    return b64url_encode(hashlib.sha256(orjson.dumps(required)).digest())


def is_thumbprint(value: str) -> bool:
    """Whether `value` can be a JWK SHA-256 thumbprint (as RFC 9449 §10's `dpop_jkt` names
    one): the canonical base64url of 32 bytes."""
    if len(value) != 43:
        return False
    try:
        return len(b64url_decode(value)) == 32
    except binascii.Error:
        return False


# ---------------------------------------------------------------------------- low S


class Curve(NamedTuple):
    order: int  # n
    width: int  # bytes of R, and of S, in a JWS signature (RFC 7518 §3.4)


def _hex(digits: str) -> int:
    """An integer written as SEC 2 writes it: hexadecimal digits in groups."""
    return int(digits.replace(" ", ""), 16)


ECDSA_CURVES: Mapping[str, Curve] = {
    "ES256": Curve(
        _hex("FFFFFFFF 00000000 FFFFFFFF FFFFFFFF BCE6FAAD A7179E84 F3B9CAC2 FC632551"),
        32,
    ),
    "ES384": Curve(
        _hex(
            "FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF"
            "C7634D81 F4372DDF 581A0DB2 48B0A77A ECEC196A CCC52973"
        ),
        48,
    ),
    "ES512": Curve(
        _hex(
            "01FF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFA"
            "51868783 BF2F966B 7FCC0148 F709A5D0 3BB5C9B8 899C47AE BB6FB71E 91386409"
        ),
        66,
    ),
}


def is_low_s(alg: str, signature: bytes) -> bool:
    """Whether `signature`, a JWS signature by `alg`, is in its one canonical spelling: for
    ES256, ES384 and ES512, R || S of the curve's width with S at most half the order; for
    any other algorithm, always (it has one spelling). A signature of another length than
    its curve's is not."""
    curve = ECDSA_CURVES.get(alg)
    if curve is None:
        return True
    if len(signature) != 2 * curve.width:
        return False
    # n is odd: s <= n >> 1 is s < n / 2, and of s and n - s exactly one is so.
    return int.from_bytes(signature[curve.width :], "big") <= curve.order >> 1


def low_s(alg: str, signature: bytes) -> bytes:
    """`signature` in its low-S spelling: for ES256, ES384 and ES512, S replaced by n - S
    when S is above half the order; anything else (another algorithm, another length, an S
    that is no residue mod n) unchanged, which no verifier accepts any more than before."""
    curve = ECDSA_CURVES.get(alg)
    if curve is None or len(signature) != 2 * curve.width:
        return signature
    width = curve.width
    s = int.from_bytes(signature[width:], "big")
    if not curve.order >> 1 < s < curve.order:
        return signature
    return signature[:width] + (curve.order - s).to_bytes(width, "big")
