"""One-time codes of an authenticator app (TOTP, RFC 6238) and recovery codes.

The parameters are the ones every authenticator app reads from an otpauth:// URI and most
apps support alone: HMAC-SHA1, 6 digits, a 30-second time step (RFC 6238 §4, §5.2), counted
from the Unix epoch. A secret is 20 random bytes (RFC 4226 §4 asks for at least 128 bits;
160 is the length of SHA-1's output, as RFC 4226 §4 recommends).

A code is accepted for the current time step or the one either side (RFC 6238 §5.2 allows
a window for clock drift and the time a person takes to type), and only for a step later
than the last one this user had accepted: a code is used once (RFC 6238 §5.2, "the verifier
MUST NOT accept the second attempt of the OTP"), and so is every code before it. The store
records the step (`Store.use_totp_step`, a compare-and-set), so two requests carrying the
same code cannot both pass.

Recovery codes stand in for the app when it is lost: ten random codes, shown once, stored
as SHA-256 digests (each holds 50 bits, far beyond what the sign-in throttle lets anyone
try), each accepted once.

Pure: standard library only; times are seconds since the epoch, passed in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import struct
from collections.abc import Sequence
from urllib.parse import quote, urlencode

SECRET_BYTES = 20
DIGITS = 6
STEP = 30  # seconds
WINDOW = 1  # steps accepted on either side of the current one
RECOVERY_CODES = 10
# Recovery codes are read off paper and typed: an alphabet without 0/O, 1/I/L.
_RECOVERY_ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"
_RECOVERY_LENGTH = 10  # 31**10: about 50 bits
_CODE = re.compile(r"^[0-9]{6}$")


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def base32(secret: bytes) -> str:
    """The secret as authenticator apps take it: base32 without padding (RFC 4648 §6)."""
    return base64.b32encode(secret).decode().rstrip("=")


def grouped(secret: bytes) -> str:
    """The base32 secret in groups of four, for a person to type into an app."""
    text = base32(secret)
    return " ".join(text[i : i + 4] for i in range(0, len(text), 4))


def provisioning_uri(secret: bytes, issuer: str, account: str) -> str:
    """The otpauth:// URI a QR code carries (the Key Uri Format of authenticator apps):
    the label `issuer:account`, and the parameters spelt out so no app guesses."""
    label = quote(issuer, safe="") + ":" + quote(account, safe="")
    query = urlencode(
        {
            "secret": base32(secret),
            "issuer": issuer,
            "algorithm": "SHA1",
            "digits": DIGITS,
            "period": STEP,
        },
        quote_via=quote,
    )
    return f"otpauth://totp/{label}?{query}"


def time_step(now: float) -> int:
    """T of RFC 6238 §4.2: whole steps since the epoch."""
    return int(now // STEP)


def code_at(secret: bytes, step: int) -> str:
    """HOTP (RFC 4226 §5.3) of the step's counter: dynamic truncation, 6 decimal digits."""
    mac = hmac.new(secret, struct.pack(">Q", step), hashlib.sha1).digest()
    offset = mac[-1] & 0x0F
    number = struct.unpack(">I", mac[offset : offset + 4])[0] & 0x7FFFFFFF
    return str(number % 10**DIGITS).zfill(DIGITS)


def normalised_code(typed: str) -> str | None:
    """Six digits from what a person typed (spaces allowed, as apps show `123 456`), or None
    when it cannot be a code."""
    compact = "".join(typed.split())
    return compact if _CODE.match(compact) else None


def matching_step(secret: bytes, code: str, now: float, last_step: int | None) -> int | None:
    """The time step `code` is for, within the window around `now` and later than
    `last_step`; None when there is none. Every candidate is compared, in constant time,
    so the answer's timing tells nothing of which step matched."""
    current = time_step(now)
    found: int | None = None
    for step in range(current - WINDOW, current + WINDOW + 1):
        if hmac.compare_digest(code_at(secret, step), code) and found is None:
            found = step
    if found is None or (last_step is not None and found <= last_step):
        return None
    return found


def new_recovery_codes(count: int = RECOVERY_CODES) -> list[str]:
    """Fresh recovery codes, written `xxxxx-xxxxx`."""
    codes = []
    for _ in range(count):
        chars = "".join(
            _RECOVERY_ALPHABET[b % len(_RECOVERY_ALPHABET)] for b in _unbiased(_RECOVERY_LENGTH)
        )
        codes.append(f"{chars[:5]}-{chars[5:]}")
    return codes


def _unbiased(count: int) -> list[int]:
    """`count` random bytes each below the largest multiple of the alphabet's size, so the
    remainder picks every character equally often."""
    limit = 256 - 256 % len(_RECOVERY_ALPHABET)
    result: list[int] = []
    while len(result) < count:
        result.extend(b for b in os.urandom(count) if b < limit)
    return result[:count]


def normalised_recovery_code(typed: str) -> str | None:
    """A recovery code as stored (lower case, no hyphen or space), or None when what was
    typed cannot be one."""
    compact = "".join(typed.split()).replace("-", "").lower()
    if len(compact) != _RECOVERY_LENGTH or any(c not in _RECOVERY_ALPHABET for c in compact):
        return None
    return compact


def recovery_digest(subject: str, code: str) -> bytes:
    """What the store keeps of a normalised recovery code: SHA-256 under the subject, so a
    code's digest is of no use for another user."""
    return hashlib.sha256(
        b"portcullis recovery\x00" + subject.encode() + b"\x00" + code.encode()
    ).digest()


def recovery_digests(subject: str, codes: Sequence[str]) -> list[bytes]:
    digests = []
    for code in codes:
        normal = normalised_recovery_code(code)
        if normal is None:
            raise ValueError("not a recovery code")
        digests.append(recovery_digest(subject, normal))
    return digests
