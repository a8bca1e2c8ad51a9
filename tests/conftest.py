"""Fixtures shared by every test package: real issuer, upstream and gateway on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from tests.support import (
    EchoUpstream,
    RunningGateway,
    TestIssuer,
    gateway_yaml,
    refusing_port,
    start_gateway,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `long` (the long profiles of property tests) run only when the marker
    expression names them (`pytest -m long`); `make test` runs their bounded profiles."""
    if "long" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a long profile: run it with -m long")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    server = TestIssuer()
    for alg in ("ES256", "RS256", "EdDSA"):
        server.add_key(alg)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[EchoUpstream]:
    server = await EchoUpstream().start()
    yield server
    await server.stop()


@pytest.fixture
async def gateway(issuer: TestIssuer, upstream: EchoUpstream) -> AsyncIterator[RunningGateway]:
    running = await start_gateway(gateway_yaml(issuer.url, upstream.url))
    yield running
    await running.stop()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses connections for the whole test."""
    with refusing_port() as port:
        yield port


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session
