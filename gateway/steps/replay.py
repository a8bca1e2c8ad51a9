"""Where DPoP proofs already used are remembered (RFC 9449 §11.1), chosen once per gateway:
in this process (`dpop.MemoryReplayCache`), or in Redis when the rate limits are kept there,
so that a proof used at one worker or replica is refused at every other.

`RedisReplayCache` records a proof with one `SET key 1 NX PX ttl`: atomic, so of two
replicas given the same proof at once exactly one accepts it; the key expires when the
proof's `iat` would refuse it anyway. Every call is bounded by `rate_limits.timeout`; when
Redis cannot answer the proof is refused with 503 (ReplayCacheUnavailable): unlike a rate
limit, a replay check that is skipped is a hole, so it never fails open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from datetime import timedelta
from typing import Any

from ..core.dpop import ReplayCacheUnavailable
from ..transport.redis_pool import redis_client, redis_failures

log = logging.getLogger("portcullis.gateway.dpop")
_WARNING_INTERVAL = timedelta(seconds=10)  # a Redis outage must not flood the log


class RedisReplayCache:
    """Proofs seen by every gateway sharing this Redis and key prefix."""

    name = "redis"

    def __init__(self, url: str, seconds: float, key_prefix: str, max_connections: int) -> None:
        self._failures = redis_failures()
        self._timeout = seconds
        self._pool, self._client = redis_client(url, seconds, max_connections)
        self._prefix = key_prefix
        self.errors = 0
        self._warned_at = -math.inf  # monotonic

    def first_use_now(self, key: bytes, until: float, now: float) -> None:
        """Never: every check is a round trip to Redis."""
        return None

    async def first_use(self, key: bytes, until: float, now: float) -> bool:
        milliseconds = max(1000, math.ceil((until - now) * 1000))
        try:
            async with asyncio.timeout(self._timeout * 2):
                stored: Any = await self._client.set(
                    self._prefix + key.hex(), b"1", nx=True, px=milliseconds
                )
        except self._failures as exc:
            self.errors += 1
            moment = time.monotonic()
            if moment - self._warned_at >= _WARNING_INTERVAL.total_seconds():
                self._warned_at = moment
                log.warning(
                    "DPoP replay cache unavailable: proofs are refused",
                    extra={"reason": type(exc).__name__, "failures_so_far": self.errors},
                )
            raise ReplayCacheUnavailable(type(exc).__name__) from None
        return bool(stored)

    def start(self) -> None:
        return None

    async def close(self) -> None:
        # A server already gone cannot be said goodbye to.
        with contextlib.suppress(*self._failures):
            await self._client.aclose()
        with contextlib.suppress(*self._failures):
            await self._pool.disconnect()
