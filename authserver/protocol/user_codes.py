"""User codes of the device authorization grant (RFC 8628 §6.1): what a person types.

Eight characters from twenty consonants that are hard to confuse with each other or with
digits, and that cannot spell words: 20**8 (about 2.6e10, 34.6 bits) codes. Stored and
compared in the normal form (upper case, no separator); shown as two groups of four,
`WDJB-MJHT`. What a person types is accepted in any case, with or without the hyphen or
spaces.
"""

from __future__ import annotations

import secrets

ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
LENGTH = 8
SPACE = len(ALPHABET) ** LENGTH  # 25_600_000_000 codes
_ALLOWED = frozenset(ALPHABET)
_SEPARATORS = str.maketrans("", "", "- \t")


def generate() -> str:
    """A fresh user code in normal form, from the operating system's random source."""
    return "".join(secrets.choice(ALPHABET) for _ in range(LENGTH))


def normalise(typed: str) -> str | None:
    """The normal form of what a person typed, or None when it cannot be a user code."""
    code = typed.translate(_SEPARATORS).upper()
    if len(code) != LENGTH or not set(code) <= _ALLOWED:
        return None
    return code


def display(code: str) -> str:
    """`WDJBMJHT` → `WDJB-MJHT`: two halves are easier to read out and type."""
    half = LENGTH // 2
    return f"{code[:half]}-{code[half:]}"
