"""Password hashing with scrypt (hashlib), a per-user random salt, and constant-time checks.

Stored form: `scrypt$<log2 n>$<r>$<p>$<salt b64>$<hash b64>`, so parameters can be raised
later without invalidating existing hashes.

The server checks passwords on a `PasswordHasher`: a pool of its own threads with a bounded
queue, refusing at once what it could not start soon.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .protocol.errors import TemporarilyUnavailable

MIN_PASSWORD = 8
_LOG2_N, _R, _P = 15, 8, 1  # about 32 MiB and ~50 ms per hash on a current core
_LENGTH = 32


def password_problems(
    password: Any, username: str, field: str = "password"
) -> list[tuple[str, str]]:
    """What is wrong with a new password (the admin API's and the account page's rule)."""
    if not isinstance(password, str):
        return [(field, "must be a string")]
    if len(password) < MIN_PASSWORD:
        return [(field, f"must have at least {MIN_PASSWORD} characters")]
    if password == username:
        return [(field, "must not be the username")]
    return []


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


class HashingBusy(TemporarilyUnavailable):
    """Every password-hashing slot is taken: the check was not started."""


class PasswordHasher:
    """Password checks off the event loop, at most `workers` at once and `max_waiting`
    queued behind them.

    A check costs about 32 MiB and tens of milliseconds of a core. One more than the pool
    can hold is refused at once with HashingBusy (503 with Retry-After) rather than queued:
    a backlog without bound would only grow the memory held and the wait of every sign-in
    behind it, until none finished in time. A slot is held until its check has finished,
    even when the request that asked for it is gone.
    """

    def __init__(self, workers: int, max_waiting: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="password")
        self._capacity = workers + max_waiting
        self._taken = 0  # changed on the event loop only

    async def verify(self, password: str, stored: str) -> bool:
        if self._taken >= self._capacity:
            raise HashingBusy("every password-hashing slot is taken")
        loop = asyncio.get_running_loop()
        self._taken += 1
        job: Future[bool] = self._executor.submit(verify_password, password, stored)
        job.add_done_callback(lambda _: self._release_from(loop))
        return await asyncio.wrap_future(job)

    async def hash(self, password: str) -> str:
        """A new scrypt hash of `password`, on the pool and within its bounds as `verify`."""
        if self._taken >= self._capacity:
            raise HashingBusy("every password-hashing slot is taken")
        loop = asyncio.get_running_loop()
        self._taken += 1
        job: Future[str] = self._executor.submit(hash_password, password)
        job.add_done_callback(lambda _: self._release_from(loop))
        return await asyncio.wrap_future(job)

    def _release_from(self, loop: asyncio.AbstractEventLoop) -> None:
        """From the worker thread: give the slot back on the loop (if it still runs)."""
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        self._taken -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
