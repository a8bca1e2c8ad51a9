"""Connections to Redis, one shape for every user of it in the gateway (rate limits, the
DPoP replay cache, the shared introspection cache): a bounded pool, every call bounded by a
timeout and never retried, so the caller decides at once what a failure means. `redis` is an
optional dependency, imported only when one of them is configured."""

from __future__ import annotations

from typing import Any


def redis_failures() -> tuple[type[BaseException], ...]:
    """How Redis being unreachable, slow or in trouble shows."""
    from redis.exceptions import RedisError

    return (RedisError, OSError, TimeoutError)


def redis_client(url: str, seconds: float, max_connections: int) -> tuple[Any, Any]:
    """A bounded pool to the Redis at `url` and a client on it, every call bounded by
    `seconds` and never retried (the caller decides what a failure means)."""
    import redis.asyncio as redis_asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # A bounded pool: a burst of requests waits (within the timeout) for one of a few
    # connections rather than opening one each, which would take longer than the check.
    pool: Any = redis_asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=seconds,
        socket_timeout=seconds,
        socket_connect_timeout=seconds,
        retry_on_timeout=False,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    return pool, redis_asyncio.Redis(connection_pool=pool)
