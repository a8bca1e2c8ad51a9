"""Gateways on a Redis of the test's own (tests/faults_support.py): stopped under traffic, the
rate limits answer as `on_backend_error` says within the backend's timeout, and are enforced
again by themselves when Redis is back; three gateway processes on one Redis hold one
combined limit under load.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.faults_support import PrivateRedis
from tests.support import GatewayProcess, gateway_yaml, running_gateway

pytestmark = [pytest.mark.fault, pytest.mark.slow]

TIMEOUT = 0.2  # rate_limits.timeout, seconds
# What one request may take while Redis is away: a connect and a call, each given TIMEOUT,
# with room for a loaded machine. Far less than a hang.
LONGEST_ANSWER = 1.5


@pytest.fixture
async def redis() -> AsyncIterator[PrivateRedis]:
    with PrivateRedis() as server:
        await server.start()
        yield server


def config(issuer: str, upstream: str, redis: PrivateRedis, limit: str, extra: str = "") -> str:
    routes = f'  - {{name: shared, path: "/shared/**", auth: none, rate_limit: {limit}}}\n'
    limits = (
        f'rate_limits: {{backend: "{redis.url}", key_prefix: "test:{uuid.uuid4().hex}:",'
        f" timeout: {TIMEOUT * 1000:g}ms{extra}}}"
    )
    return gateway_yaml(issuer, upstream, extra_routes=routes, extra=limits)


@dataclass
class Seen:
    at: float
    status: int
    took: float


async def traffic(
    http: aiohttp.ClientSession, url: str, seen: list[Seen], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        started = time.monotonic()
        async with http.get(url) as response:
            await response.read()
            seen.append(Seen(started, response.status, time.monotonic() - started))
        await asyncio.sleep(0.01)


async def wait_until(seen: list[Seen], status: int, after: float, timeout: float) -> float:
    """When the first answer with `status` sent after `after` came back."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in seen:
            if s.at > after and s.status == status:
                return s.at
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {status} after {after}: {[(s.at, s.status) for s in seen][-20:]}")


@pytest.mark.parametrize(("on_error", "refused"), [("allow", 200), ("deny", 503)])
async def test_redis_stopped_under_traffic_answers_as_configured_and_recovers_by_itself(
    issuer, upstream, client, redis: PrivateRedis, on_error: str, refused: int
) -> None:
    # Three requests an hour: after the first three, every answer is 429 while Redis counts.
    text = config(
        issuer.url,
        upstream.url,
        redis,
        "{rate: 1/h, burst: 3, key: route}",
        f", on_backend_error: {on_error}",
    )
    seen: list[Seen] = []
    stop = asyncio.Event()
    async with running_gateway(text) as gateway:
        task = asyncio.create_task(traffic(client, gateway.url + "/shared/x", seen, stop))
        try:
            await wait_until(seen, 429, 0, 10)
            redis.stop()
            stopped = time.monotonic()
            await asyncio.sleep(1.5)
            restarted = time.monotonic()
            await redis.start()
            # Enforced again by itself: Redis lost its buckets, so three pass, then 429.
            await wait_until(seen, 429, restarted, 10)
        finally:
            stop.set()
            await task
    during = [s for s in seen if stopped + 0.05 < s.at and s.at + s.took < restarted]
    assert len(during) >= 5, seen
    assert {s.status for s in during} == {refused}, [s.status for s in during]
    assert max(s.took for s in seen) < LONGEST_ANSWER
    after = [s.status for s in seen if s.at > restarted]
    first_limited = after.index(429)
    assert after[first_limited - 3 : first_limited].count(200) == 3, after
    assert set(after[first_limited:]) == {429}, after


async def test_three_gateway_processes_on_one_redis_hold_the_combined_rate(
    issuer, upstream, tmp_path: Path, redis: PrivateRedis
) -> None:
    """20 a second with a burst of 20, whichever of three gateways a request reaches: over
    about three seconds of more load than that, what passes is what one bucket allows,
    within 10 %."""
    rate, burst, duration = 20, 20, 3.0
    text = config(
        issuer.url, upstream.url, redis, f"{{rate: {rate}/s, burst: {burst}, key: route}}"
    )
    # A generous timeout: this is about sharing, and a loaded machine is slow.
    text = text.replace(f"timeout: {TIMEOUT * 1000:g}ms", "timeout: 2s")
    processes: list[GatewayProcess] = []
    try:
        for n in range(3):
            directory = tmp_path / f"gw{n}"
            directory.mkdir()
            processes.append(GatewayProcess(text, directory))
        for process in processes:
            await process.wait_ready()
        statuses: list[int] = []
        async with aiohttp.ClientSession() as session:

            async def load(url: str, deadline: float) -> None:
                # Bounded: until the deadline, and at most 2000 requests per worker.
                for _ in range(2000):
                    if time.monotonic() >= deadline:
                        return
                    async with session.get(url + "/shared/x") as response:
                        await response.read()
                        statuses.append(response.status)

            started = time.monotonic()
            deadline = started + duration
            await asyncio.gather(*(load(p.url, deadline) for p in processes for _ in range(4)))
            elapsed = time.monotonic() - started
    finally:
        for process in processes:
            await process.stop()
    allowed = statuses.count(200)
    expected = burst + rate * elapsed
    assert set(statuses) == {200, 429}, set(statuses)
    # The load was more than the limit: otherwise the test proves nothing.
    assert len(statuses) > 1.5 * expected, (len(statuses), expected)
    assert abs(allowed - expected) <= 0.1 * expected, (allowed, expected, elapsed)
    assert len(upstream.requests) == allowed
