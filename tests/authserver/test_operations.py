"""The authorization server as operators run it: `python -m authserver run` in its own process,
with its admin listener (/healthz, /readyz, /metrics), its version, SIGHUP reloading the
configuration, SIGTERM draining, and one line with exit code 1 when it cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest
import yaml

from authserver import settings as authserver_settings
from tests.authserver.conftest import (
    PASSWORD_HASH,
    SECRET,
    CodeResult,
    RunningAuthServer,
    _key_template,
    authorize_code,
    basic_auth,
    client_credentials,
    default_config,
    post_token,
    render_config,
    tokens_for,
)
from tests.authserver.test_authorize import auth_params, send
from tests.authserver.test_cli import ROOT, Process, cli
from tests.authserver.test_login_throttle import attempt
from tests.support import (
    RawConnection,
    raw_request,
    read_json_lines,
    refused_exchange,
    reserve_port,
    sample,
    scrape,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


class Server(Process):
    """`python -m authserver run` on free ports, with the shared test keys copied in."""

    def __init__(self, directory: Path, key_root: Path, config: dict[str, Any]) -> None:
        directory.mkdir(exist_ok=True)
        shutil.copytree(_key_template(key_root), directory / "keys", dirs_exist_ok=True)
        port = reserve_port()
        path = directory / "authserver.yaml"
        path.write_text(render_config(config, directory, port))
        super().__init__(path, f"http://127.0.0.1:{port}", directory / "server.log")
        self.settings = authserver_settings.load(str(path))
        admin = self.settings.admin_listen
        self.admin_url = f"http://{admin.host}:{admin.port}"

    def view(self) -> RunningAuthServer:
        """What the flow helpers of the other tests need: settings and URL."""
        return RunningAuthServer(settings=self.settings, url=self.url, services=None)  # type: ignore[arg-type]

    def rewrite(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Change the configuration file in place (the running process reads it on SIGHUP)."""
        config = yaml.safe_load(self.config.read_text())
        change(config)
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))

    def log_lines(self) -> list[dict[str, Any]]:
        return [line for line in read_json_lines(self.log) if isinstance(line, dict)]

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    async def wait_exit(self, timeout: float) -> int | None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.proc.poll()


@pytest.fixture
def servers(tmp_path: Path, key_root: Path) -> Iterator[Callable[..., Server]]:
    """Factory of servers (not started); whatever is still running at the end is killed."""
    made: list[Server] = []

    def make(config: dict[str, Any] | None = None) -> Server:
        server = Server(tmp_path / f"server{len(made)}", key_root, config or default_config())
        made.append(server)
        return server

    yield make
    for server in made:
        server.kill()


@pytest.fixture
async def running(
    servers: Callable[..., Server], http: aiohttp.ClientSession
) -> AsyncIterator[Server]:
    server = servers()
    server.start()
    await server.wait_ready(http)
    yield server


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as response:
        return response.status, await response.json()


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "it") -> None:
    """Until the async `check()` is true."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------- version


def test_version_is_the_installed_distributions() -> None:
    result = cli("--version")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"portcullis-authserver {metadata.version('portcullis')}\n"


async def test_the_first_log_line_names_the_version_and_build_info_is_a_metric(
    servers: Callable[..., Server], http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["users"].append({"username": "dev", "password": "a plain one"})  # warns at load
    server = servers(config)
    server.start()
    await server.wait_ready(http)
    first, *rest = server.log_lines()
    assert (first["message"], first["version"]) == ("starting", metadata.version("portcullis"))
    assert any("plain-text password" in line["message"] for line in rest)
    samples = await scrape(server.admin_url)
    assert sample(samples, "portcullis_build_info", version=metadata.version("portcullis")) == 1


# ---------------------------------------------------------------------------- admin listener


async def test_admin_listener_answers_health_readiness_and_metrics_the_public_one_does_not(
    running: Server, http: aiohttp.ClientSession
) -> None:
    assert await get_json(http, running.admin_url + "/healthz") == (200, {"status": "ok"})
    assert await get_json(http, running.admin_url + "/readyz") == (200, {"status": "ready"})
    for path in ("/readyz", "/metrics"):
        async with http.get(running.url + path) as response:
            assert response.status == 404


async def test_no_answer_names_the_software_behind_it(
    running: Server, http: aiohttp.ClientSession
) -> None:
    """Neither listener sends aiohttp's `Server: Python/… aiohttp/…`: pages, JSON, errors,
    404s and the admin listener alike."""
    for url, method in (
        (running.url + "/.well-known/openid-configuration", "GET"),
        (running.url + "/token", "POST"),  # an OAuth error
        (running.url + "/nothing-here", "GET"),  # aiohttp's own 404
        (running.admin_url + "/healthz", "GET"),
        (running.admin_url + "/metrics", "GET"),
    ):
        async with http.request(method, url) as response:
            assert "Server" not in response.headers, (url, response.headers["Server"])


# Each a request aiohttp's parser refuses, with the status it is answered with. The
# Authorization value of the first holds a control character after a token-like value.
_TOKEN_LIKE = "eyJhbGciOiJFUzI1NiJ9.refused-token-value.c2lnbmF0dXJl"
_UNREADABLE = (
    (
        b"GET /jwks HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
        + _TOKEN_LIKE.encode()
        + b"\x01\r\n\r\n",
        400,
    ),
    (b"GET /jwks?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n", 414),
    (b"GET /jwks HTTP/1.1\r\nHost: a\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n", 431),
    (
        b"POST /token HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
)


async def test_a_request_the_parser_refuses_is_answered_without_quoting_it_anywhere(
    running: Server, http: aiohttp.ClientSession
) -> None:
    """aiohttp answers such a request itself in HTTP/1.0, in text that quotes the refused
    bytes, under its Server field, and logs a traceback quoting them too. Here: HTTP/1.1,
    the resource error body, no Server field, the connection closed; one info line without
    a byte of the request; counted as the endpoint `unparsable`."""
    for url in (running.url, running.admin_url):
        for request, status in _UNREADABLE:
            answer = await refused_exchange(url, request)
            assert (answer.version, answer.status) == ("HTTP/1.1", status), (url, request[:40])
            assert "Server" not in answer.headers
            assert answer.headers["Content-Type"] == "application/json"
            code = {400: "bad_request", 414: "uri_too_long", 431: "header_fields_too_large"}
            assert answer.json()["error"]["code"] == code[status]
            assert b"refused-token" not in answer.body and b"vvvv" not in answer.body
    # The server still serves, on a new connection.
    async with http.get(running.url + "/jwks") as response:
        assert response.status == 200
    await eventually(
        lambda: _logged_refusals(running, 2 * len(_UNREADABLE)), what="the refusals' log lines"
    )
    text = running.log.read_text()
    assert "refused-token-value" not in text and "qqqq" not in text and "vvvv" not in text
    assert '"aiohttp.server"' not in text
    refusals = [
        line for line in running.log_lines() if line["message"] == "unparsable request refused"
    ]
    assert {(line["level"], line["status"]) for line in refusals} == {
        ("info", 400),
        ("info", 414),
        ("info", 431),
    }
    samples = await scrape(running.admin_url)
    counted = {
        status: sample(
            samples, "portcullis_authserver_requests_total", endpoint="unparsable", status=status
        )
        for status in ("400", "414", "431")
    }
    # The public listener's alone: the admin listener's are logged, not counted.
    assert counted == {"400": 2, "414": 1, "431": 1}


async def _logged_refusals(server: Server, count: int) -> bool:
    lines = [line for line in server.log_lines() if line["message"] == "unparsable request refused"]
    return len(lines) >= count


async def test_metrics_count_requests_tokens_refresh_reuse_logins_and_store_calls(
    servers: Callable[..., Server], http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["login_throttle"] = {"max_failures": 2, "max_failures_per_address": 100}
    # No grace: the rotated token shown again at once is reuse, not the retry of a lost answer.
    config["refresh_grace"] = "0s"
    server = servers(config)
    server.start()
    await server.wait_ready(http)
    view = server.view()

    for _ in range(2):
        status, body = await client_credentials(http, view)
        assert status == 200, body
    tokens = await tokens_for(http, view)
    grant = {"grant_type": "refresh_token", "client_id": "spa"}
    status, body, _ = await post_token(
        http, view, {**grant, "refresh_token": tokens["refresh_token"]}
    )
    assert status == 200, body
    status, body, _ = await post_token(
        http, view, {**grant, "refresh_token": tokens["refresh_token"]}
    )
    assert (status, body["error"]) == (400, "invalid_grant")  # reuse: the family is revoked
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        for _ in range(2):
            assert (await attempt(browser, view, "bob", "wrong")).status == 400
        assert (await attempt(browser, view, "bob", "wrong")).status == 429
    async with http.get(server.url + "/no/such/path") as response:
        assert response.status == 404
    async with http.request("PROPFIND", server.url + "/token") as response:
        assert response.status == 405

    samples = await scrape(server.admin_url)
    requests = "portcullis_authserver_requests_total"
    assert sample(samples, requests, endpoint="token", status="200") == 4
    assert sample(samples, requests, endpoint="token", status="400") == 1
    assert sample(samples, requests, endpoint="login", status="400") == 2
    assert sample(samples, requests, endpoint="login", status="429") == 1
    assert sample(samples, requests, endpoint="unmatched", status="404") == 1
    assert sample(samples, requests, endpoint="authorize", status="200") >= 4
    issued = "portcullis_authserver_tokens_issued_total"
    assert sample(samples, issued, grant_type="client_credentials") == 2
    assert sample(samples, issued, grant_type="authorization_code") == 1
    assert sample(samples, issued, grant_type="refresh_token") == 1
    assert sample(samples, "portcullis_authserver_refresh_reuse_detected_total") == 1
    assert sample(samples, "portcullis_authserver_logins_failed_total") == 2
    assert sample(samples, "portcullis_authserver_logins_throttled_total") == 1
    store = "portcullis_authserver_store_call_duration_seconds"
    # One store call per issuance; the reuse revokes the family's grant.
    assert sample(samples, store + "_count", operation="rotate_refresh") == 1
    assert sample(samples, store + "_count", operation="redeem_code") == 1
    assert sample(samples, store + "_count", operation="revoke_grant") == 1
    assert sample(samples, store + "_bucket", operation="rotate_refresh", le="+Inf") == 1
    assert sample(samples, store + "_sum", operation="rotate_refresh") > 0
    # Each endpoint's latency, by the route's template, method and status class.
    durations = "portcullis_authserver_request_duration_seconds"
    token = {"endpoint": "token", "path": "/token", "method": "POST"}
    assert sample(samples, durations + "_count", **token, status_class="2xx") == 4
    assert sample(samples, durations + "_count", **token, status_class="4xx") == 1
    assert sample(samples, durations + "_bucket", **token, status_class="2xx", le="+Inf") == 4
    assert sample(samples, durations + "_sum", **token, status_class="2xx") > 0
    unmatched = {"endpoint": "unmatched", "path": "unmatched", "status_class": "4xx"}
    assert sample(samples, durations + "_count", **unmatched, method="GET") == 1
    assert sample(samples, durations + "_count", **unmatched, method="OTHER") == 1  # PROPFIND
    login = {"endpoint": "login", "path": "/login", "method": "POST", "status_class": "4xx"}
    assert sample(samples, durations + "_count", **login) == 3
    # Labels stay bounded: no raw path, no client-chosen value, becomes a label; the only
    # paths are the templates of the routes that served.
    labels = {(name, value) for (_, pairs) in samples for (name, value) in pairs}
    assert not any(value in ("/no/such/path", "PROPFIND") for _, value in labels)
    paths = {value for name, value in labels if name == "path"}
    assert paths == {"/healthz", "/token", "/authorize", "/login", "/consent", "unmatched"}
    assert not any(value.startswith("/") for name, value in labels if name != "path")


async def test_readyz_is_503_naming_the_keys_when_the_signing_keys_are_gone(
    running: Server, http: aiohttp.ClientSession
) -> None:
    keys = Path(running.settings.keys.dir)
    for entry in keys.iterdir():
        entry.unlink()  # the running server notices within a second or two

    async def not_ready() -> bool:
        status, _ = await get_json(http, running.admin_url + "/readyz")
        return status == 503

    await eventually(not_ready, what="/readyz to fail")
    status, body = await get_json(http, running.admin_url + "/readyz")
    assert status == 503
    assert body["status"] == "not_ready"
    assert list(body["reasons"]) == ["keys"]
    assert body["reasons"]["keys"].startswith("no signing key for ES256, RS256")
    # Alive all the same: a liveness probe must not restart it for this.
    assert await get_json(http, running.admin_url + "/healthz") == (200, {"status": "ok"})


async def test_readyz_is_503_naming_the_store_while_it_cannot_answer(
    running: Server, http: aiohttp.ClientSession
) -> None:
    """Another process holds the database's write lock: the server's next write waits for it,
    and so does every store call behind that write, the readiness check's included."""
    database = running.settings.storage.removeprefix("sqlite://")
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    released = False
    try:
        # A new browser session is written to the store: this request waits for the lock.
        waiting = asyncio.create_task(send(http, running.view(), auth_params()))

        async def store_not_ready() -> bool:
            status, body = await get_json(http, running.admin_url + "/readyz")
            return status == 503 and "store" in body["reasons"]

        await eventually(store_not_ready, timeout=4, what="/readyz to name the store")
        holder.execute("ROLLBACK")
        released = True
        assert (await waiting).status == 200
        assert await get_json(http, running.admin_url + "/readyz") == (200, {"status": "ready"})
    finally:
        if not released:
            holder.execute("ROLLBACK")
        holder.close()


# ---------------------------------------------------------------------------- in flight


def received_everything(server_port: int, client_port: int) -> bool:
    """True when the server has read every byte the client sent on that connection, so
    the request it carries is being handled (from /proc/net/tcp: its receive queue)."""
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local = int(fields[1].rsplit(":", 1)[1], 16)
            remote = int(fields[2].rsplit(":", 1)[1], 16)
            if (local, remote) == (server_port, client_port):
                return int(fields[4].split(":")[1], 16) == 0
    return False


@contextlib.contextmanager
def store_locked(server: Server) -> Iterator[Callable[[], None]]:
    """Another process's write lock on the server's database, held until the `release`
    yielded is called (or the block ends): a request that writes waits for it."""
    database = server.settings.storage.removeprefix("sqlite://")
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")

    def release() -> None:
        if holder.in_transaction:
            holder.execute("ROLLBACK")

    try:
        yield release
    finally:
        release()
        holder.close()


class InFlight:
    """One request sent whole on its own connection, answered whenever the server is done."""

    def __init__(self, connection: RawConnection) -> None:
        self.connection = connection

    @classmethod
    async def send(cls, server: Server, request: bytes) -> InFlight:
        connection = await RawConnection.open(server.url)
        # A whole request first: the connection is then surely accepted and served.
        await connection.send(raw_request("GET", "/healthz", host="127.0.0.1"))
        assert (await connection.response()).status == 200
        await connection.send(request)
        port = int(server.url.rsplit(":", 1)[1])
        client_port = connection.writer.get_extra_info("sockname")[1]
        for _ in range(500):
            if received_everything(port, client_port):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the server did not read the request")
        return cls(connection)

    async def answer(self) -> tuple[int, Any]:
        try:
            response = await self.connection.response(timeout=15)
        finally:
            self.connection.close()
        return response.status, response.json()


async def exchange_in_flight(server: Server, code: CodeResult, client_id: str) -> InFlight:
    """The exchange of `code` by `client_id` (a client_secret_basic one): the server reads
    it at once, but cannot finish it while the store is locked (it consumes the code)."""
    body = urlencode(
        {
            "grant_type": "authorization_code",
            "code": code.code,
            "redirect_uri": code.redirect_uri,
            "code_verifier": code.verifier or "",
        }
    ).encode()
    request = raw_request(
        "POST",
        "/token",
        [
            ("Content-Type", "application/x-www-form-urlencoded"),
            ("Content-Length", str(len(body))),
            ("Authorization", basic_auth(client_id, SECRET)),
        ],
        body,
        host="127.0.0.1",
    )
    return await InFlight.send(server, request)


async def test_sigterm_lets_a_request_in_flight_finish_and_refuses_new_connections(
    running: Server, http: aiohttp.ClientSession
) -> None:
    code = await authorize_code(http, running.view(), client_id="web", scope="openid")
    with store_locked(running) as release:
        in_flight = await exchange_in_flight(running, code, "web")
        running.signal(signal.SIGTERM)

        async def refused() -> bool:
            try:
                connection = await RawConnection.open(running.url)
            except (ConnectionRefusedError, ConnectionResetError):
                # A connect racing the listener's close is reset instead of refused: the
                # kernel drops the closing listener's queue. Either way nobody serves it.
                return True
            connection.close()
            return False

        await eventually(refused, what="the public listener to close")
        status, body = await get_json(http, running.admin_url + "/readyz")
        assert status == 503
        assert body["reasons"]["authserver"] == "shutting down"
        assert running.proc is not None and running.proc.poll() is None  # still draining
        release()
        status, tokens = await in_flight.answer()
    assert status == 200, tokens
    assert {"access_token", "id_token"} <= set(tokens)
    assert await running.wait_exit(timeout=15) == 0
    # The request in flight is logged (access line, audit event) between the two.
    logged = [line for line in running.log_lines() if line["logger"] == "portcullis.runtime"]
    assert [line["message"] for line in logged][-2:] == ["draining", "stopped"]


# ---------------------------------------------------------------------------- reload


def reloads(samples: dict[Any, float], result: str) -> float:
    return sample(samples, "portcullis_authserver_config_reloads_total", result=result)


async def wait_logged(server: Server, message: str) -> None:
    """Until the server's log holds a line with `message`: the log reaches its file a little
    after the metrics a test may have waited for."""

    async def done() -> bool:
        return any(line.get("message") == message for line in server.log_lines())

    await eventually(done, what=f"the log line {message!r}")


async def wait_reloads(server: Server, result: str, count: int) -> None:
    async def done() -> bool:
        return reloads(await scrape(server.admin_url), result) >= count

    await eventually(done, what=f"{count} {result} reload(s)")


async def test_sighup_applies_a_new_configuration_keeping_sessions_and_requests_in_flight(
    running: Server, http: aiohttp.ClientSession
) -> None:
    view = running.view()
    # Alice signs in (her session is in the store) and approves the single-page app.
    await authorize_code(http, view)
    code = await authorize_code(http, view, client_id="web", scope="openid")
    with store_locked(running) as release:
        # The exchange is read by the server, which waits for the store to finish it.
        in_flight = await exchange_in_flight(running, code, "web")

        def change(config: dict[str, Any]) -> None:
            config["clients"] = [c for c in config["clients"] if c["client_id"] != "web"]
            config["clients"].append(
                {
                    "client_id": "late",
                    "client_secret": SECRET,
                    "grant_types": ["client_credentials"],
                    "scope": "orders:admin",
                }
            )
            config["scopes"].append({"name": "orders:admin", "description": "Run the shop"})
            config["users"].append({"username": "carol", "password_hash": PASSWORD_HASH})
            config["listen"] = (
                f"127.0.0.1:{reserve_port()}"  # needs a restart: kept, with a warning
            )

        running.rewrite(change)
        running.signal(signal.SIGHUP)
        await wait_reloads(running, "applied", 1)
        release()
        # The request read before the reload finishes on the configuration it began with.
        status, body = await in_flight.answer()
        assert status == 200, body
    # New requests get the new configuration, on the same port.
    status, body = await client_credentials(http, view, client_id="web")
    assert (status, body["error"]) == (401, "invalid_client")
    status, body = await client_credentials(http, view, client_id="late", scope="orders:admin")
    assert status == 200, body
    _, metadata_document = await get_json(http, view.endpoint("/.well-known/openid-configuration"))
    assert "orders:admin" in metadata_document["scopes_supported"]
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        carol = await authorize_code(browser, view, username="carol")  # a user added
        assert carol.code
    # Alice is still signed in: no login page, straight back with a code.
    params = {**auth_params(), "prompt": "none"}
    reply = await send(http, view, params)
    assert reply.status in (302, 303), reply.text[:300]
    assert "code" in reply.redirect_query()

    await wait_logged(running, "config reloaded")
    lines = running.log_lines()
    assert any(
        line["message"] == "a changed setting takes effect only after a restart"
        and line["setting"] == "listen"
        for line in lines
    )
    assert any(line["message"] == "config reloaded" for line in lines)


async def test_sighup_with_an_invalid_file_keeps_the_running_configuration(
    running: Server, http: aiohttp.ClientSession
) -> None:
    view = running.view()
    text = running.config.read_text()
    running.config.write_text(text + "colour: blue\n")
    line = len(text.splitlines()) + 1
    running.signal(signal.SIGHUP)
    await wait_reloads(running, "rejected", 1)
    await wait_logged(running, "config reload rejected; the previous configuration keeps serving")

    problems = [entry for entry in running.log_lines() if entry.get("event") == "config_problem"]
    assert len(problems) == 1
    assert problems[0]["message"].startswith(f"{running.config}:{line}: ")
    assert "unknown key 'colour'" in problems[0]["message"]
    assert any(
        entry["message"] == "config reload rejected; the previous configuration keeps serving"
        for entry in running.log_lines()
    )
    status, body = await client_credentials(http, view)
    assert status == 200, body
    assert await get_json(http, running.admin_url + "/readyz") == (200, {"status": "ready"})
    samples = await scrape(running.admin_url)
    assert (reloads(samples, "applied"), reloads(samples, "rejected")) == (0, 1)


# ---------------------------------------------------------------------------- start-up errors


def run_to_exit(server: Server, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "authserver", "run", "--config", str(server.config), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("which", ["listen", "admin_listen"])
def test_a_port_in_use_is_one_line_naming_it_and_exit_1(
    servers: Callable[..., Server], which: str
) -> None:
    server = servers()
    address = getattr(server.settings, which)
    with socket.socket() as taken:
        taken.bind((address.host, address.port))
        taken.listen()
        result = run_to_exit(server)
    assert result.returncode == 1
    assert last_line(result) == (
        f"cannot listen on {address.host}:{address.port}: address already in use"
    )
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_a_store_that_cannot_be_opened_is_one_line_naming_it_and_exit_1(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    # A directory where the database file should be: `check` finds nothing wrong with the
    # path (its directory exists and is writable), SQLite cannot open it.
    database = tmp_path / "authserver.db"
    database.mkdir()
    config = default_config()
    config["storage"] = f"sqlite://{database}"
    result = run_to_exit(servers(config))
    assert result.returncode == 1
    assert last_line(result) == (
        f"cannot open the store sqlite://{database}: unable to open database file"
    )
    assert "Traceback" not in result.stderr


def test_an_unusable_key_directory_is_one_line_and_debug_adds_the_traceback(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = default_config()
    config["keys"] = {"dir": str(blocker / "keys")}
    server = servers(config)
    expected = f"cannot use the key directory {blocker}/keys: not a directory"

    result = run_to_exit(server)
    assert (result.returncode, last_line(result)) == (1, expected)
    assert "Traceback" not in result.stderr

    debug = run_to_exit(server, "--debug")
    assert (debug.returncode, last_line(debug)) == (1, expected)
    assert "Traceback (most recent call last)" in debug.stderr
    assert "NotADirectoryError" in debug.stderr


def test_every_log_line_before_the_failure_is_json(servers: Callable[..., Server]) -> None:
    server = servers()
    address = server.settings.listen
    with socket.socket() as taken:
        taken.bind((address.host, address.port))
        taken.listen()
        result = run_to_exit(server)
    *logged, _ = result.stderr.strip().splitlines()
    assert logged
    assert all(isinstance(json.loads(line), dict) for line in logged)


async def test_sighup_that_adds_a_browser_client_allows_its_origin_at_once(
    running: Server, http: aiohttp.ClientSession
) -> None:
    view = running.view()
    page = "http://127.0.0.1:4999"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST"}

    async def allowed() -> str | None:
        async with http.options(view.endpoint("/token"), headers=preflight) as response:
            return response.headers.get("Access-Control-Allow-Origin")

    assert await allowed() is None

    def change(config: dict[str, Any]) -> None:
        config["clients"].append(
            {
                "client_id": "late-spa",
                "token_endpoint_auth_method": "none",
                "redirect_uris": [page + "/callback"],
                "grant_types": ["authorization_code"],
                "scope": "openid",
            }
        )

    running.rewrite(change)
    running.signal(signal.SIGHUP)
    await wait_reloads(running, "applied", 1)
    assert await allowed() == page
