"""The gateway as a process: readiness, graceful shutdown, workers, refusing a bad config.

Each test starts `python -m gateway run --config FILE` as operators do; the issuer and the
upstream run in the test process. Worker processes and their sockets are found in /proc.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path

import aiohttp
import pytest

from tests.support import (
    TCP_ESTABLISHED,
    TCP_LISTEN,
    CountingUpstream,
    GatewayProcess,
    RawConnection,
    TestIssuer,
    child_pids,
    gateway_yaml,
    raw_exchange,
    raw_request,
    read_json_lines,
    reserve_port,
    sample,
    scrape,
    socket_inodes,
    tcp_sockets,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    server = TestIssuer()
    server.add_key("ES256")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[CountingUpstream]:
    server = CountingUpstream()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def started() -> AsyncIterator[list[GatewayProcess]]:
    """Processes a test starts; whatever is still running at the end is stopped."""
    processes: list[GatewayProcess] = []
    yield processes
    for process in processes:
        await process.stop()


async def get_json(url: str) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def eventually(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- readiness


async def test_admin_port_reports_healthy_and_ready_once_keys_are_loaded(
    issuer, upstream, tmp_path, started
):
    issuer.jwks_status = 503  # the key set cannot be loaded yet
    gateway = GatewayProcess(gateway_yaml(issuer.url, upstream.url), tmp_path)
    started.append(gateway)
    await eventually(lambda: issuer.jwks_fetches > 0)
    for _ in range(100):
        try:
            status, body = await get_json(gateway.admin_url + "/healthz")
            break
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    assert (status, body) == (200, {"status": "ok"})  # alive, though not ready
    status, body = await get_json(gateway.admin_url + "/readyz")
    assert status == 503
    assert body["status"] == "not_ready"
    assert list(body["reasons"]) == [issuer.url]

    issuer.jwks_status = 200
    await gateway.wait_ready()
    assert await get_json(gateway.admin_url + "/readyz") == (200, {"status": "ready"})
    assert await get_json(gateway.admin_url + "/healthz") == (200, {"status": "ok"})
    # Ready means tokens verify: a request with one goes through.
    token = issuer.token()
    async with (
        aiohttp.ClientSession() as session,
        session.get(gateway.url + "/orders/1", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200


# ---------------------------------------------------------------------------- shutdown


async def test_sigterm_drains_an_in_flight_request_then_exits_zero(
    issuer, upstream, tmp_path, started
):
    config = gateway_yaml(issuer.url, upstream.url, extra="shutdown_grace: 5s")
    gateway = GatewayProcess(config, tmp_path)
    started.append(gateway)
    await gateway.wait_ready()

    async def slow_request() -> tuple[int, dict[str, object]]:
        headers = {"Authorization": f"Bearer {issuer.token()}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(gateway.url + "/_slow/1", headers=headers) as resp,
        ):
            return resp.status, await resp.json()

    in_flight = asyncio.create_task(slow_request())
    await eventually(lambda: "/_slow/1" in upstream.arrived)
    gateway.signal(signal.SIGTERM)

    # The listener closes at once, while the slow request is still being served.
    async def refused() -> bool:
        try:
            connection = await RawConnection.open(gateway.url)
        except (ConnectionRefusedError, ConnectionResetError):
            # A connect racing the listener's close is reset instead of refused: the
            # kernel drops the closing listener's queue. Either way nobody serves it.
            return True
        connection.close()
        return False

    for _ in range(100):
        if await refused():
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the gateway still accepts connections after SIGTERM")
    assert not in_flight.done()
    status, body = await get_json(gateway.admin_url + "/readyz")
    assert status == 503
    assert body["reasons"]["gateway"] == "shutting down"

    assert await in_flight == (200, upstream.requests[0])
    assert upstream.requests[0]["raw_path"] == "/_slow/1"
    assert await gateway.wait_exit(timeout=gateway.grace + 2) == 0


async def test_sigterm_with_nothing_in_flight_exits_zero_promptly(
    issuer, upstream, tmp_path, started
):
    config = gateway_yaml(issuer.url, upstream.url, extra="shutdown_grace: 30s")
    gateway = GatewayProcess(config, tmp_path)
    started.append(gateway)
    await gateway.wait_ready()
    idle = await RawConnection.open(gateway.url)  # an idle keep-alive does not hold it up
    try:
        await idle.send(raw_request("GET", "/public/x"))
        assert (await idle.response()).status == 200
        gateway.signal(signal.SIGTERM)
        assert await gateway.wait_exit(timeout=10) == 0
    finally:
        idle.close()


# ---------------------------------------------------------------------------- workers


def listening_workers(supervisor: int, port: int) -> set[int]:
    """Children of the supervisor holding a listening socket on `port`."""
    listening = {s.inode for s in tcp_sockets(port) if s.state == TCP_LISTEN}
    found = set()
    for pid in child_pids(supervisor):
        try:
            if socket_inodes(pid) & listening:
                found.add(pid)
        except OSError:
            continue  # exited meanwhile
    return found


async def test_two_workers_share_the_port_serve_are_replaced_and_stop_on_sigterm(
    issuer, upstream, tmp_path, started
):
    config = gateway_yaml(issuer.url, upstream.url, extra="workers: 2\nshutdown_grace: 5s")
    gateway = GatewayProcess(config, tmp_path)
    started.append(gateway)
    await gateway.wait_ready()
    await eventually(lambda: len(listening_workers(gateway.pid, gateway.port)) == 2)
    workers = listening_workers(gateway.pid, gateway.port)
    assert gateway.pid not in workers  # the supervisor itself does not serve

    # Fresh connections, each served and kept open; the kernel spreads them over the two
    # listening sockets, and /proc tells which worker holds each accepted connection.
    connections = [await RawConnection.open(gateway.url) for _ in range(24)]
    try:
        for connection in connections:
            await connection.send(raw_request("GET", "/public/x"))
            assert (await connection.response()).status == 200
        client_ports = {c.writer.get_extra_info("sockname")[1] for c in connections}
        accepted = {
            s.inode
            for s in tcp_sockets(gateway.port)
            if s.state == TCP_ESTABLISHED and s.remote_port in client_ports
        }
        served_by = {pid: socket_inodes(pid) & accepted for pid in workers}
        assert all(served_by.values()), f"connections per worker: {served_by}"
        assert sum(len(held) for held in served_by.values()) == len(connections)
    finally:
        for connection in connections:
            connection.close()
    assert len(upstream.requests) == len(connections)

    # A worker that dies is replaced; the other one keeps running.
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        now = listening_workers(gateway.pid, gateway.port)
        return len(now) == 2 and victim not in now

    await eventually(replaced, timeout=15)
    current = listening_workers(gateway.pid, gateway.port)
    assert workers - {victim} <= current
    answer = await raw_exchange(gateway.url, raw_request("GET", "/public/after"))
    assert answer.status == 200

    gateway.signal(signal.SIGTERM)
    assert await gateway.wait_exit(timeout=gateway.grace + 7) == 0
    for pid in current:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived the supervisor"


def worker_holding(connection: RawConnection, port: int, workers: set[int]) -> int:
    """The worker that accepted this client connection to `port`."""
    client_port = connection.writer.get_extra_info("sockname")[1]
    inodes = {
        s.inode
        for s in tcp_sockets(port)
        if s.state == TCP_ESTABLISHED and s.remote_port == client_port
    }
    (holder,) = [pid for pid in workers if socket_inodes(pid) & inodes]
    return holder


async def scrape_from(gateway: GatewayProcess, workers: set[int]) -> tuple[int, dict]:
    """One scrape of /metrics on a fresh connection: the worker that answered, the samples."""
    from prometheus_client.parser import text_string_to_metric_families

    connection = await RawConnection.open(gateway.admin_url)
    try:
        await connection.send(raw_request("GET", "/metrics"))
        answer = await connection.response()
        holder = worker_holding(connection, gateway.admin_port, workers)
    finally:
        connection.close()
    assert answer.status == 200
    samples = {
        (found.name, tuple(sorted(found.labels.items()))): found.value
        for family in text_string_to_metric_families(answer.body.decode())
        for found in family.samples
    }
    return holder, samples


def requests_total(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "portcullis_gateway_requests_total")


async def send_on_fresh_connections(
    gateway: GatewayProcess, workers: set[int], requests: list[bytes]
) -> dict[int, int]:
    """Each request on a connection of its own, all open at once so the kernel spreads them
    over the workers; how many each worker served."""
    connections = [await RawConnection.open(gateway.url) for _ in requests]
    served: dict[int, int] = {}
    try:
        for connection, request in zip(connections, requests, strict=True):
            await connection.send(request)
            assert (await connection.response()).status == 200
            holder = worker_holding(connection, gateway.port, workers)
            served[holder] = served.get(holder, 0) + 1
    finally:
        for connection in connections:
            connection.close()
    return served


async def test_with_two_workers_a_scrape_adds_up_every_worker_and_never_goes_down(
    issuer, upstream, tmp_path, started
):
    config = gateway_yaml(issuer.url, upstream.url, extra="workers: 2\nshutdown_grace: 5s")
    gateway = GatewayProcess(config, tmp_path)
    started.append(gateway)
    await gateway.wait_ready()
    await eventually(lambda: len(listening_workers(gateway.pid, gateway.port)) == 2)
    workers = listening_workers(gateway.pid, gateway.port)
    await eventually(lambda: len(listening_workers(gateway.pid, gateway.admin_port)) == 2)
    # The supervisor's private directory, where the workers keep their counts.
    environ = Path(f"/proc/{min(workers)}/environ").read_bytes().split(b"\0")
    (directory,) = [v[25:].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700

    sent = 0
    served: dict[int, int] = {}
    answered_by: set[int] = set()
    totals: list[float] = []
    for batch in range(4):
        requests = [raw_request("GET", f"/public/{batch}-{n}") for n in range(8)]
        for pid, count in (await send_on_fresh_connections(gateway, workers, requests)).items():
            served[pid] = served.get(pid, 0) + count
        sent += len(requests)
        for _ in range(4):
            holder, samples = await scrape_from(gateway, workers)
            answered_by.add(holder)
            totals.append(requests_total(samples))
            assert totals[-1] == sent, f"worker {holder} counted {totals[-1]} of {sent}"
    assert set(served) == workers, f"requests per worker: {served}"
    assert answered_by == workers  # each worker's scrape saw the other's requests too

    # Figures of the live state add up too: a token each, each a cache miss and an entry.
    tokens = [issuer.token() for _ in range(12)]
    requests = [
        raw_request("GET", "/orders/1", [("Authorization", f"Bearer {token}")]) for token in tokens
    ]
    cached_by = await send_on_fresh_connections(gateway, workers, requests)
    sent += len(requests)

    async def state() -> tuple[float, float]:
        _, samples = await scrape_from(gateway, workers)
        return (
            sample(samples, "portcullis_gateway_token_cache_misses_total"),
            sample(samples, "portcullis_gateway_token_cache_entries"),
        )

    for _ in range(100):
        if await state() == (len(tokens), len(tokens)):
            break
        await asyncio.sleep(0.1)
    assert await state() == (len(tokens), len(tokens))

    # A worker killed and replaced: its counts stay in the sum, its gauges leave it.
    victim = max(cached_by, key=lambda pid: cached_by[pid])
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        now = listening_workers(gateway.pid, gateway.port)
        return len(now) == 2 and victim not in now

    await eventually(replaced, timeout=15)
    workers = listening_workers(gateway.pid, gateway.port)
    await eventually(lambda: len(listening_workers(gateway.pid, gateway.admin_port)) == 2)
    for _ in range(6):
        _, samples = await scrape_from(gateway, workers)
        assert requests_total(samples) == sent
        assert sample(samples, "portcullis_gateway_token_cache_misses_total") == len(tokens)
        survivors = len(tokens) - cached_by[victim]
        assert sample(samples, "portcullis_gateway_token_cache_entries") == survivors
    await send_on_fresh_connections(gateway, workers, [raw_request("GET", "/public/after")])
    _, samples = await scrape_from(gateway, workers)
    assert requests_total(samples) == sent + 1

    gateway.signal(signal.SIGTERM)
    assert await gateway.wait_exit(timeout=gateway.grace + 7) == 0
    assert not Path(directory).exists()


# ---------------------------------------------------------------------------- bad config


def test_run_with_a_broken_config_exits_nonzero_with_file_line_messages(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text(
        'listen: "127.0.0.1:18080"\n'
        'admin_listen: "127.0.0.1:18081"\n'
        'upstream: {url: "http://127.0.0.1:9", read_timeout: soon}\n'
        "issuers:\n"
        '  - issuer: "http://127.0.0.1:9"\n'
        "    audiences: [orders-api]\n"
        "colour: blue\n"
        "routes:\n"
        '  - {name: public, path: "/public/**", auth: none}\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"{config}:3", f"{config}:7"]
    assert "read_timeout" in lines[0] and "'soon'" in lines[0]
    assert "colour" in lines[1]
    assert result.stdout == ""


# ---------------------------------------------------------------------------- version


async def test_the_first_log_line_names_the_version_and_build_info_is_a_metric(
    issuer, upstream, tmp_path, started
):
    gateway = GatewayProcess(gateway_yaml(issuer.url, upstream.url), tmp_path)
    started.append(gateway)
    await gateway.wait_ready()
    first = read_json_lines(gateway.log_path)[0]
    assert (first["message"], first["version"]) == ("starting", metadata.version("portcullis"))
    samples = await scrape(gateway.admin_url)
    assert sample(samples, "portcullis_build_info", version=metadata.version("portcullis")) == 1


# ---------------------------------------------------------------------------- start-up errors


def run_to_exit(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def startup_config(tmp_path: Path, extra: str = "") -> tuple[Path, str, str]:
    """A valid config on free ports (nothing needs to answer at start): path, listen,
    admin_listen."""
    listen, admin = f"127.0.0.1:{reserve_port()}", f"127.0.0.1:{reserve_port()}"
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f'listen: "{listen}"\n'
        f'admin_listen: "{admin}"\n'
        'upstream: {url: "http://127.0.0.1:9"}\n'
        "issuers:\n"
        '  - {issuer: "http://127.0.0.1:9", audiences: [orders-api]}\n'
        "routes:\n"
        '  - {name: public, path: "/public/**", auth: none}\n' + extra
    )
    return config, listen, admin


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("which", ["listen", "admin_listen"])
def test_a_port_in_use_is_one_line_naming_it_and_exit_1(tmp_path, workers, which):
    config, listen, admin = startup_config(tmp_path, f"workers: {workers}\n")
    address = listen if which == "listen" else admin
    host, port = address.rsplit(":", 1)
    with socket.socket() as taken:
        taken.bind((host, int(port)))
        taken.listen()
        result = run_to_exit(config)
    assert result.returncode == 1
    *logged, last = result.stderr.strip().splitlines()
    assert last == f"cannot listen on {address}: address already in use"
    assert "Traceback" not in result.stderr
    assert all(isinstance(json.loads(line), dict) for line in logged)  # the log stays JSON
    assert result.stdout == ""


def test_an_access_log_that_cannot_be_opened_is_one_line_and_debug_adds_the_traceback(
    tmp_path,
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    output = blocker / "access.log"
    config, _, _ = startup_config(tmp_path, f'access_log: {{output: "{output}"}}\n')
    expected = f"cannot use {output}: not a directory"

    result = run_to_exit(config)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == expected
    assert "Traceback" not in result.stderr

    debug = run_to_exit(config, "--debug")
    assert debug.returncode == 1
    assert debug.stderr.strip().splitlines()[-1] == expected
    assert "Traceback (most recent call last)" in debug.stderr
    assert "NotADirectoryError" in debug.stderr


def test_a_worker_that_cannot_start_stops_the_supervisor_with_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    output = blocker / "access.log"
    config, _, _ = startup_config(tmp_path, f'workers: 2\naccess_log: {{output: "{output}"}}\n')
    result = run_to_exit(config)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"cannot use {output}: not a directory"
    assert lines.count(lines[-1]) == 1  # said once, by the supervisor, whatever the workers
    assert "Traceback" not in result.stderr
