"""JOSE encodings and signature checks shared by the token verifier, the DPoP proof checks and
the revocation events' receiver. Pure."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

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


def b64url_encode(data: bytes) -> str:
    """Unpadded base64url (RFC 7515 §2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


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
