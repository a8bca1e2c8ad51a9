"""The authorization server as its own process: `python -m authserver run` (or a test
launcher in its place) on a free port, its output copied into a log file.

The output goes through a pipe rather than straight into the file, so that a limit the test
puts on the server's file writes (RLIMIT_FSIZE, a full disk) reaches its database only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import aiohttp

from authserver import settings as authserver_settings
from tests.authserver.conftest import RunningAuthServer, render_config
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE = ("-m", "authserver", "run")


def write_config(directory: Path, config: dict[str, Any] | str, port: int | None = None) -> Path:
    path = directory / "authserver.yaml"
    path.write_text(render_config(config, directory, port or free_port()))
    return path


def _copy(source: IO[bytes], log: Path) -> None:
    """Line by line, each written through, so that the file is current when a test reads it."""
    with log.open("ab") as out:
        for line in iter(source.readline, b""):
            out.write(line)
            out.flush()


class Process:
    """`python -m authserver run` (or `command`) on a free port, with its output in a file."""

    def __init__(self, config: Path, url: str, log: Path, command: Sequence[str] = SERVE) -> None:
        self.config, self.url, self.log, self.command = config, url, log, tuple(command)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *self.command, "--config", str(self.config)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        threading.Thread(target=_copy, args=(self.proc.stdout, self.log), daemon=True).start()

    def server(self) -> RunningAuthServer:
        """What the conftest helpers need to reach this process (no in-process components).
        They address endpoints through the issuer, which a replica shares with another
        process: here it is this process's own address."""
        settings = replace(authserver_settings.load(str(self.config)), issuer=self.url)
        return RunningAuthServer(settings=settings, url=self.url, services=None)  # type: ignore[arg-type]

    async def wait_ready(self, http: aiohttp.ClientSession, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                async with http.get(self.url + "/healthz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"the server did not start:\n{self.log.read_text()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: no cleanup of any kind
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
