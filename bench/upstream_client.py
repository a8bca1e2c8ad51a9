"""CPU time per exchange: gateway/transport/upstream_client.py against an aiohttp ClientSession
set up as the forward path set it up before, both to the same local aiohttp upstream (small GET
answers, keep-alive), on uvloop.

    PYTHONPATH=. .venv/bin/python bench/upstream_client.py [exchanges] [concurrency]

Each client runs `exchanges` GETs, `concurrency` at a time, after a warm-up. The upstream
runs in a process of its own, so the figure, this process's CPU time (time.process_time)
divided by the exchanges, is the client's alone.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import uvloop
from aiohttp import web
from multidict import CIMultiDict

from gateway.transport.upstream_client import Origin, UpstreamClient

HEADERS = [
    ("Accept", "application/json"),
    ("X-Forwarded-For", "127.0.0.1"),
    ("X-Forwarded-Proto", "http"),
    ("Forwarded", "for=127.0.0.1;proto=http"),
    ("Via", "1.1 portcullis"),
    ("X-Request-ID", "0123456789abcdef0123456789abcdef"),
    ("X-Auth-Subject", "alice"),
    ("X-Auth-Scopes", "orders:read"),
    ("X-Auth-Issuer", "https://auth.example.com"),
]


def _serve_upstream(sock: socket.socket) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(body=b'{"id":1,"status":"shipped"}', content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", ok)
    web.run_app(app, sock=sock, access_log=None, print=None, loop=uvloop.new_event_loop())


async def _measure(
    name: str, exchange: Callable[[], Awaitable[bytes]], exchanges: int, concurrency: int
) -> float:
    async def worker(count: int) -> None:
        for _ in range(count):
            await exchange()

    await asyncio.gather(*(worker(200) for _ in range(concurrency)))  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(exchanges // concurrency) for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done = exchanges // concurrency * concurrency
    per = cpu / done * 1e6
    print(f"{name:14} {per:7.1f} µs CPU/exchange  {done / wall:8.0f} exchanges/s")
    return per


async def main(exchanges: int, concurrency: int, port: int) -> None:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, connect=7, sock_connect=2, sock_read=30),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        read_bufsize=65536,
    )
    client = UpstreamClient(
        Origin("127.0.0.1", port),
        max_connections=256,
        connect_timeout=2,
        read_timeout=30,
        buffer_size=65536,
    )
    base = f"http://127.0.0.1:{port}"

    async def old() -> bytes:
        async with session.request(
            "GET",
            aiohttp.client.URL(base + "/orders/1?x=1", encoded=True),
            headers=CIMultiDict(HEADERS),
            allow_redirects=False,
        ) as answer:
            return await answer.read()

    async def new() -> bytes:
        answer = await client.request("GET", "/orders/1?x=1", CIMultiDict(HEADERS), None)
        try:
            return await answer.read()
        finally:
            answer.release()

    try:
        assert await old() == await new()
        for _ in range(2):
            before = await _measure("ClientSession", old, exchanges, concurrency)
            after = await _measure("UpstreamClient", new, exchanges, concurrency)
            print(f"{'':14} {1 - after / before:7.0%} less CPU per exchange")
    finally:
        await session.close()
        await client.close()


if __name__ == "__main__":
    exchanges, concurrency = [int(a) for a in sys.argv[1:]] + [20_000, 8][len(sys.argv) - 1 :]
    listener = socket.create_server(("127.0.0.1", 0))
    upstream = multiprocessing.get_context("fork").Process(
        target=_serve_upstream, args=(listener,), daemon=True
    )
    upstream.start()
    try:
        uvloop.run(main(exchanges, concurrency, listener.getsockname()[1]))
    finally:
        upstream.terminate()
