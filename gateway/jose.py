"""JOSE encodings shared by the token verifier and the DPoP proof checks. Pure."""

from __future__ import annotations

import base64
import binascii
import re

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
    rest = len(part) % 4
    if rest == 1 or (rest and part[-1] not in _CANONICAL_LAST[rest]):
        raise binascii.Error("not canonical base64url")
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def b64url_encode(data: bytes) -> str:
    """Unpadded base64url (RFC 7515 §2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")
