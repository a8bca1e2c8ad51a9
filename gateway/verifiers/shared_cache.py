"""Introspection answers shared through Redis, so that N gateways ask the issuer about a
token once between them rather than once each (`introspection.cache: redis://...`).

What is stored, and why it can be trusted no more than it must be:
- The key is a prefix and an HMAC-SHA-256 of the token (its one spelling, as the caches in
  memory take it: cache.canonical_spelling) under a key derived from the issuer and the
  gateway's introspection credentials: never the token, and not a plain hash of it,
  so someone who can read Redis can neither recover a token nor test whether one they hold
  is cached. Gateways with the same issuer and credentials find each other's entries;
  others (another issuer, other credentials) never do.
- The value is the issuer's answer with its deadline, sealed with an HMAC under the same
  key and bound to the Redis key: an entry written by anything but a gateway holding the
  credentials, or moved to another token's key, fails the check and is a miss. The answer's
  claims are checked again on every read, as when it came from the issuer.
- Entries expire in Redis at their deadline: an active answer's is min(cache_ttl, exp,
  max-age), an inactive one's inactive_cache_ttl, as in each gateway's memory.
- Redis failing, slow (each call is given `cache_timeout`) or holding garbage is a miss:
  the gateway asks the issuer. A cache error never lets a token through. After a failure,
  Redis is left alone for a second, so that requests do not each wait for its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import orjson

from ..core.clock import Now
from ..transport.redis_pool import redis_client, redis_failures
from .cache import canonical_spelling

log = logging.getLogger("portcullis.gateway.introspection")

RETRY_AFTER_FAILURE = timedelta(seconds=1)
_WARN_EVERY = timedelta(seconds=10)
_TAG_BYTES = 32


@dataclass(frozen=True, slots=True)
class SharedAnswer:
    answer: dict[str, Any]  # the issuer's JSON object, `active` included
    until: float  # wall-clock deadline


class SharedAnswers(Protocol):
    """Where introspectors of several gateways leave answers for each other."""

    hits: int  # answers found there

    async def lookup(self, token: str) -> SharedAnswer | None: ...

    async def store(self, token: str, answer: dict[str, Any], until: float) -> None: ...

    async def close(self) -> None: ...


class NoSharedAnswers:
    """No cache shared between gateways: every miss in memory asks the issuer."""

    hits = 0

    async def lookup(self, token: str) -> SharedAnswer | None:
        return None

    async def store(self, token: str, answer: dict[str, Any], until: float) -> None:
        return None

    async def close(self) -> None:
        return None


def cache_secret(issuer: str, client_id: str, client_secret: str) -> bytes:
    """The key of the keyed hashes and seals: the same for every gateway that introspects at
    `issuer` with these credentials, unknowable without them."""
    material = "\x00".join(["portcullis introspection cache", issuer, client_id, client_secret])
    return hashlib.sha256(material.encode()).digest()


class RedisAnswers:
    """Answers in Redis under `prefix`; `now` is the gateway's wall clock, `monotonic` paces
    retries and warnings."""

    def __init__(
        self,
        url: str,
        secret: bytes,
        prefix: str,
        timeout: timedelta,
        now: Now,
        monotonic: Now,
        max_connections: int = 16,
    ) -> None:
        self._failures = redis_failures()
        seconds = timeout.total_seconds()
        self._timeout = seconds
        self._pool, self._client = redis_client(url, seconds, max_connections)
        self._secret = secret
        self._prefix = prefix.encode()
        self._now = now
        self._monotonic = monotonic
        self._resting_until = -math.inf
        self._warned_at = -math.inf
        self.hits = 0
        self.errors = 0

    def key(self, token: str) -> bytes:
        spelling = canonical_spelling(token).encode()  # an ECDSA token's twin: the same entry
        return self._prefix + hmac.new(self._secret, spelling, "sha256").hexdigest().encode()

    def _seal(self, key: bytes, payload: bytes) -> bytes:
        return hmac.new(self._secret, key + b"\x00" + payload, "sha256").digest()

    async def lookup(self, token: str) -> SharedAnswer | None:
        if self._monotonic() < self._resting_until:
            return None
        key = self.key(token)
        try:
            async with asyncio.timeout(self._timeout * 2):
                value = await self._client.get(key)
        except self._failures as exc:
            self._failed(exc)
            return None
        if value is None or len(value) <= _TAG_BYTES:
            return None
        tag, payload = value[:_TAG_BYTES], value[_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._seal(key, payload)):
            self._warn("a shared introspection cache entry failed its seal; ignored")
            return None
        try:
            entry = orjson.loads(payload)
            answer, until = entry["answer"], float(entry["until"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        if not isinstance(answer, dict) or until <= self._now():
            return None
        self.hits += 1
        return SharedAnswer(answer, until)

    async def store(self, token: str, answer: dict[str, Any], until: float) -> None:
        milliseconds = math.floor((until - self._now()) * 1000)
        if milliseconds <= 0 or self._monotonic() < self._resting_until:
            return
        key = self.key(token)
        payload = orjson.dumps({"answer": answer, "until": until})
        try:
            async with asyncio.timeout(self._timeout * 2):
                await self._client.set(key, self._seal(key, payload) + payload, px=milliseconds)
        except self._failures as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self._resting_until = self._monotonic() + RETRY_AFTER_FAILURE.total_seconds()
        self._warn(
            "shared introspection cache unavailable; asking the issuer",
            reason=type(exc).__name__,
        )

    def _warn(self, message: str, **extra: str) -> None:
        now = self._monotonic()
        if now - self._warned_at >= _WARN_EVERY.total_seconds():
            self._warned_at = now
            log.warning(message, extra=extra)

    async def close(self) -> None:
        with contextlib.suppress(*self._failures):
            await self._client.aclose()
        with contextlib.suppress(*self._failures):
            await self._pool.disconnect()
