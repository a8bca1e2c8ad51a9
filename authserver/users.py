"""Password hashing with scrypt (hashlib), a per-user random salt, and constant-time checks.

Stored form: `scrypt$<log2 n>$<r>$<p>$<salt b64>$<hash b64>`, so parameters can be raised
later without invalidating existing hashes.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os

_LOG2_N, _R, _P = 15, 8, 1  # about 32 MiB and ~50 ms per hash on a current core
_LENGTH = 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _scrypt(password: str, salt: bytes, log2_n: int, r: int, p: int) -> bytes:
    n = 1 << log2_n
    return hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * n * r + 1024 * 1024, dklen=_LENGTH
    )


def hash_password(password: str) -> str:
    salt = os.urandom(16)
    digest = _scrypt(password, salt, _LOG2_N, _R, _P)
    return f"scrypt${_LOG2_N}${_R}${_P}${_b64(salt)}${_b64(digest)}"


def is_hash(text: str) -> bool:
    parts = text.split("$")
    return len(parts) == 6 and parts[0] == "scrypt" and all(x.isdigit() for x in parts[1:4])


def verify_password(password: str, stored: str) -> bool:
    if not is_hash(stored):
        return False
    _, log2_n, r, p, salt, digest = stored.split("$")
    try:
        expected = _unb64(digest)
        actual = _scrypt(password, _unb64(salt), int(log2_n), int(r), int(p))
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(actual, expected)


@functools.cache
def dummy_hash() -> str:
    """A hash to check against when the username is unknown, so that an unknown user and a
    wrong password take the same time and give the same answer."""
    return hash_password(_b64(os.urandom(16)))
