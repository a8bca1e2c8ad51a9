"""The admin API against its own OpenAPI document: schemathesis generates requests from
every operation's schema (valid and invalid ones) and the server must never answer with an
unexpected 5xx. Bounded (a few examples per operation, a fixed seed) to stay a few seconds."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp

from tests.authserver.admin_support import admin_server, admin_token, api, start_admin_server
from tests.authserver.conftest import RunningAuthServer
from tests.support import service_missing

__all__ = ["admin_server", "start_admin_server"]  # fixtures

EXAMPLES = 3


def schemathesis_command() -> Path:
    command = Path(sys.executable).parent / "st"
    if not command.exists():
        service_missing("schemathesis is not installed (pip install portcullis[test])")
    return command


async def test_generated_requests_never_meet_a_server_error(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    command = schemathesis_command()
    token = await admin_token(http, admin_server)
    process = await asyncio.create_subprocess_exec(
        str(command),
        "run",
        api(admin_server, "/openapi.json"),
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        "1",
        "--workers",
        "1",
        "--phases",
        "fuzzing",
        "--header",
        f"Authorization: Bearer {token}",
        "--no-color",
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=300)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-6000:]
    assert "generated" in text and "failed" not in text.split("Test cases:")[-1], text[-2000:]
