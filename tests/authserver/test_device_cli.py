"""examples/device_cli.py as a person runs it: a real process against a real server, approved
(or denied) through the real device pages over HTTP while it polls."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from tests.authserver.conftest import RunningAuthServer, StartAuthServer
from tests.authserver.device_support import TV_SCOPE, approve_on_pages, device_config

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "examples" / "device_cli.py"


@pytest.fixture
async def browser() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


class Cli:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    @classmethod
    async def start(cls, server: RunningAuthServer, *args: str) -> Cli:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CLI),
            "--issuer",
            server.settings.issuer,
            "--client-id",
            "tv",
            *args,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return cls(process)

    async def read_until(self, pattern: str, timeout: float = 15) -> re.Match[str]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                found = re.search(pattern, line)
                if found:
                    return found
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no line matching {pattern!r} in {self.lines}"
            line = await asyncio.wait_for(self.process.stdout.readline(), remaining)
            assert line, f"the client ended before printing {pattern!r}: {self.lines}"
            self.lines.append(line.decode())

    async def finish(self, timeout: float = 20) -> tuple[int, str, str]:
        out, err = await asyncio.wait_for(self.process.communicate(), timeout)
        assert self.process.returncode is not None
        return self.process.returncode, "".join(self.lines) + out.decode(), err.decode()

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


async def test_the_cli_shows_code_and_link_polls_politely_and_prints_verified_claims(
    start_authserver: StartAuthServer, browser: aiohttp.ClientSession
) -> None:
    server = await start_authserver(device_config())
    cli = await Cli.start(server, "--scope", TV_SCOPE, "--qr", "never", "--json")
    try:
        uri = (await cli.read_until(r"To sign in, open (\S+)")).group(1)
        code = (await cli.read_until(r"enter the code ([A-Z]{4}-[A-Z]{4})")).group(1)
        complete = (await cli.read_until(r"or open (\S+)")).group(1)
        assert uri == server.endpoint("/device")
        assert parse_qs(urlsplit(complete).query) == {"user_code": [code]}
        await cli.read_until(r"expires in 10 min 0 s")

        # It polls, and hears authorization_pending.
        user_code = code.replace("-", "")
        deadline = time.monotonic() + 30
        while True:
            record = await server.services.store.device_by_user_code(user_code, time.time())
            if record is not None and record.last_poll is not None:
                break
            assert time.monotonic() < deadline, "the command never polled"
            await asyncio.sleep(0.05)
        done = await approve_on_pages(browser, server, complete)
        assert "Device connected" in done.text
        status, out, err = await cli.finish()
    finally:
        cli.kill()
    assert status == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    access = result["access_token_claims"]
    assert access["sub"] == server.subject("alice")
    assert access["client_id"] == "tv"
    assert access["aud"] == "orders-api"
    assert access["scope"] == TV_SCOPE
    assert result["id_token_claims"]["aud"] == "tv"
    assert result["id_token_claims"]["name"] == "Alice Liddell"
    assert result["refresh_token"] == "received"
    assert result["scope"] == TV_SCOPE
    # Polite: it never polled faster than the interval, which the server would have raised.
    assert "slow down" not in err
    record = await server.services.store.device_by_user_code(code.replace("-", ""), time.time())
    assert record is not None
    assert (record.state, record.interval) == ("redeemed", 1.0)


async def test_the_cli_reports_a_denial_with_exit_status_1(
    start_authserver: StartAuthServer, browser: aiohttp.ClientSession
) -> None:
    server = await start_authserver(device_config())
    cli = await Cli.start(server, "--scope", "orders:read", "--qr", "never")
    try:
        complete = (await cli.read_until(r"or open (\S+)")).group(1)
        await approve_on_pages(browser, server, complete, decision="deny")
        status, out, err = await cli.finish()
    finally:
        cli.kill()
    assert status == 1, (out, err)
    assert "the request was denied" in err
    assert "Signed in" not in out


async def test_the_cli_gives_up_when_the_code_expires_and_draws_a_qr_code_when_it_can(
    start_authserver: StartAuthServer,
) -> None:
    server = await start_authserver(device_config(lifetimes={"device_code": "2s"}))
    cli = await Cli.start(server, "--scope", "orders:read", "--qr", "always")
    try:
        status, out, err = await cli.finish()
    finally:
        cli.kill()
    assert status == 2, (out, err)
    assert "the code expired before it was approved" in err
    if importlib.util.find_spec("segno") is not None:
        # A QR code of the link, drawn with half blocks: at least 21 modules wide.
        drawn = [line for line in out.splitlines() if set(line) <= set("█▀▄ ") and line]
        assert len(drawn) >= 11, out
        assert all(len(line) >= 21 for line in drawn)
    else:
        assert "install segno to see a QR code" in err


async def test_the_cli_explains_a_refused_start(start_authserver: StartAuthServer) -> None:
    server = await start_authserver(device_config())
    cli = await Cli.start(server, "--scope", "orders:read admin", "--qr", "never")
    try:
        status, out, err = await cli.finish()
    finally:
        cli.kill()
    assert status == 3
    assert "400 invalid_scope" in err
    assert out == ""
