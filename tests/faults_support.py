"""A PostgreSQL and a Redis of a test's own, to stop and start again while servers use them.

The machine's shared servers are never touched: each of these runs from a temporary
directory of its own, on a port reserved for it (tests/support.py `reserve_port`: below the
ephemeral range and this worker's alone, so that nothing takes it while the server is down
and it comes back on the same address), listening on 127.0.0.1 only.

PostgreSQL: `initdb` and `pg_ctl` from /usr/local/bin, else from PATH. The cluster has trust
authentication, the superuser `postgres` and fsync off (nothing here must survive the
machine; every commit still reaches the kernel before it is acknowledged, so a stopped or
killed server keeps what it committed). PostgreSQL refuses to run as root: as root, the
cluster belongs to the unprivileged user `nobody` and its programs run as that user
(`runuser`), in a temporary directory that user owns.

Redis: `redis-server` from PATH, without persistence: stopping it loses its keys, as a
restarted cache would.

Both are removed however the test ends (a context manager, and an exit hook for a test
process that ends without running it). Missing programs skip the test with the reason, or
fail it under CI=true (tests/support.py `service_missing`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support import reserve_port, service_missing

POSTGRES_BIN = Path("/usr/local/bin")
UNPRIVILEGED = "nobody"
START_TIMEOUT = 30.0  # seconds for a server to accept connections


def _program(name: str) -> str:
    local = POSTGRES_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        service_missing(f"{name} is not installed (looked in {POSTGRES_BIN} and PATH)")
    return found


def _as_user() -> tuple[list[str], int | None]:
    """The prefix that runs a PostgreSQL program, and the uid that must own its files
    (None: the current user's)."""
    if os.geteuid() != 0:
        return [], None
    runuser = shutil.which("runuser")
    if runuser is None:
        service_missing("running as root, and runuser is missing to run PostgreSQL as another user")
    try:
        uid = pwd.getpwnam(UNPRIVILEGED).pw_uid
    except KeyError:
        service_missing(f"running as root, and there is no user {UNPRIVILEGED!r} to run PostgreSQL")
    return [runuser, "-u", UNPRIVILEGED, "--"], uid


_LIVE: set[PrivatePostgres | PrivateRedis] = set()


@atexit.register
def _remove_leftovers() -> None:
    for server in list(_LIVE):
        server.remove()


class PrivatePostgres:
    """A PostgreSQL cluster in a temporary directory: `start`, `stop`, `start` again on the
    same port, `remove` (or use it as a context manager)."""

    def __init__(self, password: str | None = None) -> None:
        """With `password`, connections over TCP must give it (SCRAM); without, any
        connection is trusted."""
        self.initdb, self.pg_ctl = _program("initdb"), _program("pg_ctl")
        self.prefix, self.owner = _as_user()
        self.root = Path(tempfile.mkdtemp(prefix="portcullis-pg-"))
        if self.owner is not None:
            os.chown(self.root, self.owner, -1)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = reserve_port()
        self.password = password
        login = f"postgres:{password}" if password else "postgres"
        self.url = f"postgresql://{login}@127.0.0.1:{self.port}/postgres"
        self._initialised = False
        _LIVE.add(self)

    def __enter__(self) -> PrivatePostgres:
        return self

    def __exit__(self, *_: object) -> None:
        self.remove()

    def _run(self, *args: str, timeout: float = 60) -> None:
        done = subprocess.run(
            [*self.prefix, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise AssertionError(f"{args[0]} failed:\n{done.stdout}{done.stderr}\n{tail}")

    def start(self) -> PrivatePostgres:
        if not self._initialised:
            authentication = ["--auth", "trust"]
            if self.password is not None:
                secret = self.root / "password"
                secret.write_text(self.password + "\n")
                if self.owner is not None:
                    os.chown(secret, self.owner, -1)
                authentication = [
                    "--auth-local",
                    "trust",
                    "--auth-host",
                    "scram-sha-256",
                    f"--pwfile={secret}",
                ]
            self._run(
                self.initdb,
                "--pgdata",
                str(self.data),
                *authentication,
                "--username",
                "postgres",
                "--encoding",
                "UTF8",
                "--locale",
                "C",
                "--no-sync",
            )
            self._initialised = True
        options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.root}",
                "-c fsync=off",
                "-c full_page_writes=off",
                "-c max_connections=60",
            ]
        )
        self._run(
            self.pg_ctl,
            "start",
            "--pgdata",
            str(self.data),
            "--log",
            str(self.log),
            "--wait",
            f"--timeout={int(START_TIMEOUT)}",
            "-o",
            options,
        )
        return self

    def stop(self, mode: str = "fast") -> None:
        """`fast`: sessions are ended and the server shuts down cleanly; `immediate`: every
        process quits at once, as in a crash (recovery replays the log at the next start)."""
        if self.data.exists() and (self.data / "postmaster.pid").exists():
            self._run(self.pg_ctl, "stop", "--pgdata", str(self.data), "--mode", mode, "--wait")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
        _LIVE.discard(self)


class PrivateRedis:
    """redis-server in a temporary directory without persistence: `start`, `stop`, `start`
    again on the same port, `remove` (or use it as a context manager)."""

    def __init__(self) -> None:
        found = shutil.which("redis-server")
        if found is None:
            service_missing("redis-server is not installed")
        self.program = found
        self.root = Path(tempfile.mkdtemp(prefix="portcullis-redis-"))
        self.port = reserve_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        _LIVE.add(self)

    def __enter__(self) -> PrivateRedis:
        return self

    def __exit__(self, *_: object) -> None:
        self.remove()

    async def start(self) -> PrivateRedis:
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(
            [
                self.program,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.root),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"redis-server exited:\n{(self.root / 'server.log').read_text()}"
                )
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return self
            if time.monotonic() > deadline:
                raise AssertionError("redis-server did not start")
            await asyncio.sleep(0.02)

    def stop(self) -> None:
        """SIGKILL: Redis gone at once, connections reset, keys lost."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        _LIVE.discard(self)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as server:
        server.start()
        yield server
