"""Helpers for the key rotation tests: the config file of a running server, the
`portcullis-authserver keys` command run as its own process (without blocking the event
loop the server runs on), and the published key set."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt

from tests.authserver.conftest import RunningAuthServer, fetch_jwks, render_config

ROOT = Path(__file__).resolve().parents[2]


def config_file(server: RunningAuthServer, config: dict[str, Any]) -> Path:
    """The YAML file a running server started by `start_authserver(config)` was made from,
    for the command line to read."""
    keys_dir = server.settings.keys.dir
    # Keys kept in the storage: the file may be anywhere.
    directory = Path(keys_dir).parent if keys_dir else Path(tempfile.mkdtemp(prefix="authserver-"))
    path = directory / "authserver.yaml"
    path.write_text(render_config(config, directory, server.port))
    return path


async def keys_command(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "authserver",
        "keys",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def rotate(path: Path, *args: str) -> str:
    status, out, err = await keys_command("rotate", "--config", str(path), *args)
    assert status == 0, err
    return out


async def listed(path: Path) -> dict[str, dict[str, Any]]:
    """`keys list --json`, by kid."""
    status, out, err = await keys_command("list", "--config", str(path), "--json")
    assert status == 0, err
    return {entry["kid"]: entry for entry in json.loads(out)}


async def on_disk(server: RunningAuthServer) -> dict[str, dict[str, Any]]:
    """The ring as the processes sharing it last wrote it, by kid: keyring.json in the key
    directory, or the rows of the storage."""
    if server.settings.keys.dir is None:
        ring = await server.services.store.signing_keys()
        return {key.kid: {f: getattr(key, f) for f in STORED_FIELDS} for key in ring.keys}
    entries = json.loads((Path(server.settings.keys.dir) / "keyring.json").read_text())
    return {entry["kid"]: entry for entry in entries}


STORED_FIELDS = ("kid", "alg", "state", "created_at", "activate_at", "retired_at", "remove_after")


async def published(http: aiohttp.ClientSession, server: RunningAuthServer) -> set[str]:
    return {key["kid"] for key in (await fetch_jwks(http, server))["keys"]}


def kid_of(token: str) -> str:
    return str(jwt.get_unverified_header(token)["kid"])


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float, what: str, every: float = 0.05
) -> float:
    """Wait until `check()` is true; the time.time() when it first was."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)
    return time.time()
