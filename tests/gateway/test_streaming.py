"""Bodies stream through the gateway in constant memory, both ways.

The gateway runs as operators run it (`python -m gateway run --config FILE`) in a child
process, so its memory can be read from /proc without the test's own allocations mixed in.
The issuer, the upstream and the client live in the test process.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support import EchoUpstream, GatewayProcess, TestIssuer, gateway_yaml, memory_kib

SIZE = 100 * 1024 * 1024
BLOCK = 64 * 1024
# What the gateway may add to its resident memory while moving SIZE bytes: a fraction of the
# body, so a gateway that held the body (or a good part of it) in memory fails.
MAX_GROWTH_KIB = 50 * 1024


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    server = TestIssuer()
    server.add_key("ES256")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def gateway_process(
    issuer: TestIssuer, upstream: EchoUpstream, tmp_path: Path
) -> AsyncIterator[GatewayProcess]:
    process = GatewayProcess(gateway_yaml(issuer.url, upstream.url), tmp_path)
    try:
        await process.wait_ready()
        yield process
    finally:
        await process.stop()


class Upload:
    """SIZE bytes made block by block, each block numbered, hashed as they are produced."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.sent = 0

    async def blocks(self) -> AsyncIterator[bytes]:
        filler = bytes(range(256)) * (BLOCK // 256)
        for number in range(SIZE // BLOCK):
            block = number.to_bytes(8, "big") + filler[8:]
            self.digest.update(block)
            self.sent += len(block)
            yield block


async def test_100_mb_upload_arrives_intact_in_bounded_gateway_memory(
    gateway_process, issuer, upstream
):
    start_rss = memory_kib(gateway_process.pid, "VmRSS")
    upload = Upload()
    headers = {"Authorization": f"Bearer {issuer.token()}"}
    async with (
        aiohttp.ClientSession() as client,
        client.post(
            gateway_process.url + "/upload/big", data=upload.blocks(), headers=headers
        ) as r,
    ):
        assert r.status == 200, await r.text()
        seen = await r.json()
    peak = memory_kib(gateway_process.pid, "VmHWM")
    assert upload.sent == SIZE
    assert seen["body_size"] == SIZE
    assert seen["body_sha256"] == upload.digest.hexdigest()
    assert peak - start_rss < MAX_GROWTH_KIB, f"grew {peak - start_rss} KiB from {start_rss}"


async def test_100_mb_download_arrives_intact_in_bounded_gateway_memory(gateway_process, issuer):
    start_rss = memory_kib(gateway_process.pid, "VmRSS")
    received = 0
    foreign = 0
    headers = {"Authorization": f"Bearer {issuer.token()}"}
    async with (
        aiohttp.ClientSession(auto_decompress=False) as client,
        client.get(gateway_process.url + f"/_bytes/{SIZE}", headers=headers) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Length"] == str(SIZE)
        async for chunk in r.content.iter_any():
            received += len(chunk)
            foreign += len(chunk) - chunk.count(b"x")
    peak = memory_kib(gateway_process.pid, "VmHWM")
    assert received == SIZE
    assert foreign == 0
    assert peak - start_rss < MAX_GROWTH_KIB, f"grew {peak - start_rss} KiB from {start_rss}"
