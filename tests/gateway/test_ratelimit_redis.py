"""Rate limits shared through Redis: one atomic script per check, one limit for every
gateway using the same Redis, and a configured answer (with a metric) when Redis is away.

The tests that need the machine's Redis (127.0.0.1:6379) skip with the reason when it is not
reachable, and fail instead under CI=true. The tests of an unreachable Redis need none.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support import (
    REDIS_URL,
    GatewayProcess,
    call,
    gateway_yaml,
    redis_or_skip,
    running_gateway,
    sample,
    scrape,
)


@pytest.fixture
async def redis() -> AsyncIterator[object]:
    client = await redis_or_skip()
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis) -> AsyncIterator[str]:
    """A key prefix of this test alone, so runs never share buckets; its keys are removed
    afterwards."""
    chosen = f"portcullis-test:{uuid.uuid4().hex}:"
    yield chosen
    keys = await redis.keys(chosen + "*")
    if keys:
        await redis.delete(*keys)


def redis_config(
    issuer: str,
    upstream: str,
    *,
    backend: str = REDIS_URL,
    prefix: str = "portcullis-test:",
    limit: str = "{rate: 1/h, burst: 40, key: route}",
    timeout: str = "200ms",
    extra: str = "",
) -> str:
    routes = f'  - {{name: shared, path: "/shared/**", auth: none, rate_limit: {limit}}}\n'
    limits = (
        f'rate_limits: {{backend: "{backend}", key_prefix: "{prefix}", timeout: {timeout}{extra}}}'
    )
    return gateway_yaml(issuer, upstream, extra_routes=routes, extra=limits)


async def test_the_redis_backend_answers_429_with_the_ratelimit_fields(
    issuer, upstream, client, prefix, redis
):
    config = redis_config(
        issuer.url, upstream.url, prefix=prefix, limit="{rate: 1/m, burst: 2, key: route}"
    )
    async with running_gateway(config) as gateway:
        answers = [await call(client, gateway.url + "/shared/x") for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 429]
    assert answers[0].headers["RateLimit"] == '"shared";r=1;t=60'
    assert answers[2].headers["Retry-After"] == "60"
    assert answers[2].headers["RateLimit-Policy"] == '"shared";q=2;w=120'
    assert answers[2].body["error"]["code"] == "rate_limited"
    assert len(upstream.requests) == 2
    # The bucket lives in Redis, under the prefix, and expires by itself.
    keys = await redis.keys(prefix + "*")
    assert len(keys) == 1
    assert 0 < await redis.pttl(keys[0]) <= 121_000


async def test_concurrent_checks_against_redis_never_exceed_the_burst(
    issuer, upstream, client, prefix, redis
):
    # A generous timeout: this is about the buckets' atomicity. With the 200 ms of the other
    # tests here, 60 calls at once on a loaded machine can outwait it, and on_backend_error:
    # allow (the default, tested apart) then lets those through: a full suite run failed so.
    config = redis_config(
        issuer.url,
        upstream.url,
        prefix=prefix,
        limit="{rate: 1/h, burst: 20, key: route}",
        timeout="2s",
    )
    async with running_gateway(config) as gateway:
        answers = await asyncio.gather(
            *(call(client, gateway.url + "/shared/x") for _ in range(60))
        )
    statuses = sorted(a.status for a in answers)
    assert statuses == [200] * 20 + [429] * 40


async def test_two_gateway_processes_sharing_redis_hold_the_combined_limit(
    issuer, upstream, tmp_path: Path, prefix, redis
):
    """Two replicas, one limit: 40 requests in all, whichever replica gets them."""
    processes = []
    try:
        for n in range(2):
            directory = tmp_path / f"gw{n}"
            directory.mkdir()
            processes.append(
                # A generous timeout: this is about sharing, and a loaded machine is slow.
                GatewayProcess(
                    redis_config(issuer.url, upstream.url, prefix=prefix, timeout="2s"), directory
                )
            )
        for process in processes:
            await process.wait_ready()
        async with aiohttp.ClientSession() as session:

            async def one(n: int) -> int:
                url = processes[n % 2].url + "/shared/x"
                async with session.get(url) as response:
                    await response.read()
                    return response.status

            statuses = await asyncio.gather(*(one(n) for n in range(100)))
    finally:
        for process in processes:
            await process.stop()
    allowed = statuses.count(200)
    # With a bucket per process each would allow 40 (80 in all); shared, 40 pass.
    assert 36 <= allowed <= 44, statuses
    assert statuses.count(429) == 100 - allowed
    assert len(upstream.requests) == allowed


# ---------------------------------------------------------------------------- Redis away


@pytest.mark.parametrize(
    ("on_error", "expected"), [("allow", 200), ("deny", 503)], ids=["allow", "deny"]
)
async def test_an_unreachable_redis_answers_at_once_as_configured_and_is_counted(
    issuer, upstream, client, on_error, expected, refused_port
):
    dead = f"redis://127.0.0.1:{refused_port}/0"
    config = redis_config(
        issuer.url, upstream.url, backend=dead, extra=f", on_backend_error: {on_error}"
    )
    async with running_gateway(config) as gateway:
        started = time.monotonic()
        answers = [await call(client, gateway.url + "/shared/x") for _ in range(5)]
        elapsed = time.monotonic() - started
        samples = await scrape(gateway.admin_url)
    assert [a.status for a in answers] == [expected] * 5
    assert elapsed < 2.0  # no request waited long for Redis
    assert all("RateLimit" not in a.headers for a in answers)  # nothing known to tell
    if expected == 503:
        assert answers[0].headers["Retry-After"] == "1"
        assert answers[0].body == {
            "error": {
                "code": "unavailable",
                "message": "The gateway cannot check rate limits right now; try again shortly.",
                "details": [],
            }
        }
        assert upstream.requests == []
    else:
        assert len(upstream.requests) == 5
    assert (
        sample(samples, "portcullis_gateway_rate_limit_backend_errors_total", backend="redis") == 5
    )


async def test_a_redis_that_never_answers_is_given_up_on_within_the_timeout(
    issuer, upstream, client
):
    # A listener that accepts connections and never says anything: a hung Redis.
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    config = redis_config(issuer.url, upstream.url, backend=f"redis://127.0.0.1:{port}/0", extra="")
    try:
        async with running_gateway(config) as gateway:
            started = time.monotonic()
            answer = await call(client, gateway.url + "/shared/x")
            elapsed = time.monotonic() - started
    finally:
        silent.close()
        await silent.wait_closed()
    assert answer.status == 200  # on_backend_error: allow is the default
    assert elapsed < 1.5  # 200 ms timeout per call, not a hang
