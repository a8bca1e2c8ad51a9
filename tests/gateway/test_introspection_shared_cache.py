"""Introspection answers shared through Redis (`introspection.cache: redis://...`): gateways
on one Redis ask the issuer about a token once between them; the key is a keyed hash of the
token, never the token; entries live no longer than the gateway's own cache would keep them;
an entry that is not a gateway's, or Redis being away, is a miss and the issuer is asked.

Each test has a Redis of its own (tests/faults_support.py), so that it can be stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis.asyncio as redis_asyncio

from gateway.verifiers.shared_cache import RedisAnswers
from tests.faults_support import PrivateRedis
from tests.gateway.test_introspection import config
from tests.support import (
    GatewayProcess,
    IntrospectionServer,
    call,
    ecdsa_twin,
    running_gateway,
)


@pytest.fixture
async def redis() -> AsyncIterator[PrivateRedis]:
    with PrivateRedis() as server:
        await server.start()
        yield server


@pytest.fixture
async def server() -> AsyncIterator[IntrospectionServer]:
    introspection = await IntrospectionServer().start()
    yield introspection
    await introspection.stop()


@pytest.fixture
async def client_of(redis: PrivateRedis) -> AsyncIterator[redis_asyncio.Redis]:
    connection = redis_asyncio.Redis.from_url(redis.url)
    yield connection
    await connection.aclose()


def shared(server: IntrospectionServer, upstream_url: str, redis: PrivateRedis, prefix: str) -> str:
    return config(
        server.url,
        upstream_url,
        cache=f'"{redis.url}"',
        cache_key_prefix=f'"{prefix}"',
        cache_ttl="30s",
        inactive_cache_ttl="5s",
    )


def calls_for(server: IntrospectionServer, token: str) -> int:
    return sum(1 for c in server.calls if c["form"]["token"] == token)


@pytest.mark.slow
async def test_two_gateway_processes_on_one_redis_introspect_a_token_once_between_them(
    server: IntrospectionServer, upstream, redis: PrivateRedis, tmp_path: Path, client
) -> None:
    server.active("opaque-active", sub="alice", scope="orders:read")
    text = shared(server, upstream.url, redis, f"test:{uuid.uuid4().hex}:")
    gateways = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            gateways.append(GatewayProcess(text, tmp_path / name))
        for gateway in gateways:
            await gateway.wait_ready()
        for gateway in gateways * 2:
            answer = await call(client, gateway.url + "/orders/1", "opaque-active")
            assert answer.status == 200, answer.body
            # An inactive answer is shared too.
            answer = await call(client, gateway.url + "/orders/1", "opaque-unknown")
            assert answer.status == 401, answer.body
    finally:
        for gateway in gateways:
            await gateway.stop()
    assert calls_for(server, "opaque-active") == 1
    assert calls_for(server, "opaque-unknown") == 1
    assert len(upstream.requests) == 4
    assert all(u["headers"] for u in upstream.requests)


async def test_redis_holds_a_keyed_hash_never_the_token_and_no_longer_than_exp(
    server: IntrospectionServer, upstream, redis: PrivateRedis, client_of, client
) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    token = "opaque-" + uuid.uuid4().hex
    server.active(token, exp=int(time.time()) + 4)  # expires before cache_ttl (30 s)
    async with running_gateway(shared(server, upstream.url, redis, prefix)) as gateway:
        assert (await call(client, gateway.url + "/orders/1", token)).status == 200
        assert (await call(client, gateway.url + "/orders/1", "opaque-nope")).status == 401
    keys = await client_of.keys(prefix + "*")
    assert len(keys) == 2
    for key in keys:
        value = await client_of.get(key)
        assert token.encode() not in key and token.encode() not in value
        assert b"opaque-nope" not in key
        # A plain SHA-256 of the token would let anyone holding it find its entry.
        assert hashlib.sha256(token.encode()).hexdigest().encode() not in key
    ttls = sorted([await client_of.pttl(key) for key in keys])
    assert 0 < ttls[0] <= 4_000  # exp, not cache_ttl; the inactive one: inactive_cache_ttl
    assert 0 < ttls[1] <= 5_000


async def test_an_ecdsa_tokens_twin_has_the_tokens_key(issuer) -> None:
    # (r, n - s) verifies as well as (r, s): one token, one entry, in Redis as in memory.
    answers = RedisAnswers(
        "redis://127.0.0.1:1", b"k" * 32, "p:", timedelta(seconds=1), time.time, time.monotonic
    )
    try:
        token = issuer.token("ES256")
        assert answers.key(ecdsa_twin(token)) == answers.key(token)
        assert answers.key(issuer.token("ES256")) != answers.key(token)
    finally:
        await answers.close()


async def test_an_entry_moved_to_another_tokens_key_or_garbage_is_a_miss(
    server: IntrospectionServer, upstream, redis: PrivateRedis, client_of, client
) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    server.active("opaque-good", scope="orders:read")
    text = shared(server, upstream.url, redis, prefix)
    async with running_gateway(text) as first:
        assert (await call(client, first.url + "/orders/1", "opaque-good")).status == 200
        good_key = (await client_of.keys(prefix + "*"))[0]
        assert (await call(client, first.url + "/orders/1", "opaque-revoked")).status == 401
    keys = await client_of.keys(prefix + "*")
    revoked_key = next(k for k in keys if k != good_key)
    # Someone who can write to Redis puts the active answer under the other token's key.
    await client_of.set(revoked_key, await client_of.get(good_key))
    async with running_gateway(text) as second:  # a fresh gateway: nothing in its memory
        answer = await call(client, second.url + "/orders/1", "opaque-revoked")
        assert answer.status == 401, answer.body
        assert calls_for(server, "opaque-revoked") == 2  # the issuer was asked again
        await client_of.set(good_key, b"x" * 40 + b"{not json")
        assert (await call(client, second.url + "/orders/1", "opaque-good")).status == 200
        assert calls_for(server, "opaque-good") == 2


@pytest.mark.fault
async def test_redis_away_is_a_miss_the_issuer_decides_and_sharing_resumes(
    server: IntrospectionServer, upstream, redis: PrivateRedis, client
) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    server.active("opaque-1")
    text = shared(server, upstream.url, redis, prefix)
    redis.stop()
    async with running_gateway(text) as a, running_gateway(text) as b:
        started = time.monotonic()
        assert (await call(client, a.url + "/orders/1", "opaque-1")).status == 200
        # Never open on a cache error: an inactive token is refused, by the issuer's word.
        assert (await call(client, a.url + "/orders/1", "opaque-inactive")).status == 401
        assert (await call(client, b.url + "/orders/1", "opaque-1")).status == 200
        assert time.monotonic() - started < 3
        assert calls_for(server, "opaque-1") == 2  # nothing shared while Redis is away
        assert calls_for(server, "opaque-inactive") == 1

        await redis.start()
        # A gateway leaves Redis alone for a second after a failure; then B finds what A
        # left, and the issuer is asked about a new token once between them again.
        deadline = time.monotonic() + 10
        attempt = 0
        while True:
            attempt += 1
            token = f"opaque-after-{attempt}"
            server.active(token)
            assert (await call(client, a.url + "/orders/1", token)).status == 200
            assert (await call(client, b.url + "/orders/1", token)).status == 200
            if calls_for(server, token) == 1:
                break
            assert time.monotonic() < deadline, "sharing did not resume"
            await asyncio.sleep(0.2)
