"""The bench's counting client (bench/keepalive_client.py) sends exactly the requests it is
told to, over the connections it is told to, and fails on an answer that is not 200: the
instruction counts of bench/instructions.sh are divided by that number."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

from tests.support import start_site

ROOT = Path(__file__).resolve().parent.parent


async def run_client(port: int, path: str, requests: int, connections: int) -> int:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "bench/keepalive_client.py",
        "--port",
        str(port),
        "--path",
        path,
        "--authorization",
        "Bearer abc.def.ghi",
        "--requests",
        str(requests),
        "--connections",
        str(connections),
        cwd=ROOT,
    )
    return await asyncio.wait_for(process.wait(), 60)


async def test_every_request_is_sent_once_over_the_connections_given() -> None:
    seen: list[tuple[str, str | None, object]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization"), request.transport))
        if request.path == "/refused":
            return web.Response(status=401)
        return web.Response(text="ok" * (len(seen) % 3))  # bodies of 0, 2 and 4 bytes

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner, url = await start_site(app)
    port = int(url.rsplit(":", 1)[1])
    try:
        assert await run_client(port, "/api/items", 10, 3) == 0
        assert len(seen) == 10
        assert {(path, authorization) for path, authorization, _ in seen} == {
            ("/api/items", "Bearer abc.def.ghi")
        }
        assert len({id(transport) for _, _, transport in seen}) == 3
        seen.clear()
        assert await run_client(port, "/refused", 4, 2) != 0
        assert len(seen) <= 2  # each connection stops at its first refusal
    finally:
        await runner.cleanup()
