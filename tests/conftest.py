"""Fixtures shared by every test package: real issuer, upstream and gateway on 127.0.0.1."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests import hypothesis_profiles  # noqa: F401  (registers and loads the profiles)
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


# ---------------------------------------------------------------------------- tiers

# `make test` runs every test; `make test-fast` runs those marked `fast`: the tests that need
# no other process, browser, front proxy, database or image build. The mark is given here,
# by what a test is, so that a new test falls in its tier without a list to update. A test
# is `fast` unless
# - it lives in one of HEAVY_DIRECTORIES (programs, browsers, front proxies, the image);
# - it has one of HEAVY_MARKERS: slow, fault and long, or asyncio, which pytest-asyncio
#   gives every coroutine test: the async tests are the ones that serve or call over
#   sockets, open a store or run a command-line program;
# - its module imports subprocess: it runs programs.
# A synchronous test that is slow all the same is marked `slow`, which takes it out.
TESTS = Path(__file__).resolve().parent
HEAVY_DIRECTORIES = frozenset({"e2e", "examples", "deploy"})
HEAVY_MARKERS = ("slow", "fault", "long", "asyncio")


def pytest_itemcollected(item: pytest.Item) -> None:
    if _in_fast_tier(item):
        item.add_marker(pytest.mark.fast)


def _in_fast_tier(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(name) is not None for name in HEAVY_MARKERS):
        return False
    path = item.path.resolve()
    if any(path.is_relative_to(TESTS / name) for name in HEAVY_DIRECTORIES):
        return False
    module = getattr(item, "module", None)
    return module is None or not _runs_programs(vars(module).values())


def _runs_programs(globals_: Iterable[object]) -> bool:
    """Whether a module's globals hold subprocess or anything imported from it."""
    return any(
        value is subprocess or getattr(value, "__module__", None) == "subprocess"
        for value in globals_
    )
