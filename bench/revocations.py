"""Revocation events under load: what a large deny-set costs the warm JWT path, and how long a
revoked token keeps passing the gateway after /revoke has answered.

Starts two authorization servers (SQLite, on the client core) and two gateways (one worker
each, on the server core), each gateway subscribed to one server's revocation events, then:

1. 100 events naming 1,000 tokens each are written to the second server's database (as
   another process would); its gateway reads them within the poll interval, and the script
   waits until /metrics shows 100,000 entries held; the first server's log stays empty;
2. wrk on the warm JWT path (one token, verified-token cache hit) of each gateway in turn,
   three times each: the medians of requests/s and of the gateway's CPU time per request;
3. for each of `--samples` fresh tokens of the second server, one request that passes (the
   token is now cached), `POST /revoke`, and from its answer on, requests in a loop until the
   gateway answers 401: the time from the answer to the first refusal.

Writes a markdown section to `--out` and stdout.

Usage: revocations.py --upstream URL [--server-cpu 0] [--duration 10] [--warmup 2]
                      [--connections 64] [--entries 100000] [--samples 200] --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SECRET = secrets.token_urlsafe(30)
PER_EVENT = 1000


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def basic(client_id: str) -> str:
    return "Basic " + base64.b64encode(f"{client_id}:{SECRET}".encode()).decode()


def authserver_config(tmp: Path, port: int, admin: int) -> Path:
    path = tmp / "authserver.yaml"
    path.write_text(f"""
issuer: "http://127.0.0.1:{port}"
listen: "127.0.0.1:{port}"
admin_listen: "127.0.0.1:{admin}"
storage: "sqlite://{tmp}/authserver.db"
keys: {{dir: "{tmp}/keys", access_token_alg: ES256}}
lifetimes: {{access_token: 1h}}
default_audience: bench-api
scopes: [{{name: "bench:read", description: "Read the bench API"}}]
clients:
  - {{client_id: bench, client_secret: "{SECRET}", grant_types: [client_credentials],
      scope: "bench:read"}}
  - {{client_id: gateway, client_secret: "{SECRET}", grant_types: [client_credentials],
      scope: "", introspection: true}}
log_level: warning
""")
    return path


def gateway_config(tmp: Path, port: int, admin: int, issuer: str, upstream: str) -> Path:
    path = tmp / "gateway.yaml"
    path.write_text(f"""
listen: "127.0.0.1:{port}"
admin_listen: "127.0.0.1:{admin}"
upstream: {{url: "{upstream}"}}
issuers:
  - issuer: "{issuer}"
    audiences: [bench-api]
    algorithms: [ES256]
    revocation_events: {{client_id: gateway, client_secret: "{SECRET}"}}
routes:
  - {{name: api, path: "/api/**", scopes: {{any: ["bench:read"]}}}}
token_cache_size: 100000
shutdown_grace: 1s
log_level: warning
""")
    return path


async def wait_until(check, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if await check():
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def metric(http: aiohttp.ClientSession, admin: str, name: str) -> float:
    async with http.get(admin + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def token(http: aiohttp.ClientSession, issuer: str) -> str:
    async with http.post(
        issuer + "/token",
        data={"grant_type": "client_credentials", "scope": "bench:read"},
        headers={"Authorization": basic("bench")},
    ) as response:
        body = await response.json()
        assert response.status == 200, body
        return str(body["access_token"])


def wrk(url: str, token_: str, args: argparse.Namespace, seconds: int) -> float:
    """Requests per second of one wrk run (on the client core)."""
    command = [
        "taskset", "-c", str(args.client_cpu), "wrk", "-t1", f"-c{args.connections}",
        f"-d{seconds}s", "--latency", url, "-H", f"Authorization: Bearer {token_}",
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert match, out
    return float(match.group(1))


def load_events(database: Path, entries: int) -> None:
    """What 100 grant revocations of 1,000 access tokens each would record, written by
    this process to the server's database (the server finds them within its poll)."""
    now = time.time()
    conn = sqlite3.connect(database, timeout=10)
    with conn:
        for _ in range(entries // PER_EVENT):
            tokens = [[secrets.token_urlsafe(16), now + 3600] for _ in range(PER_EVENT)]
            conn.execute(
                "INSERT INTO revocation_events (kind, reason, tokens, created_at, expires_at)"
                " VALUES ('tokens', 'revoked', ?, ?, ?)",
                (json.dumps(tokens), now, now + 3600),
            )
    conn.close()


async def refusal_times(
    http: aiohttp.ClientSession, issuer: str, gateway: str, samples: int
) -> list[float]:
    tokens = [await token(http, issuer) for _ in range(samples)]
    times = []
    for t in tokens:
        headers = {"Authorization": f"Bearer {t}"}
        async with http.get(gateway + "/api/items", headers=headers) as response:
            assert response.status == 200, response.status
            await response.read()
        async with http.post(
            issuer + "/revoke", data={"token": t}, headers={"Authorization": basic("bench")}
        ) as response:
            assert response.status == 200
            await response.read()
        answered = time.perf_counter()
        while True:
            async with http.get(gateway + "/api/items", headers=headers) as response:
                await response.read()
                if response.status == 401:
                    break
                assert response.status == 200, response.status
            if time.perf_counter() - answered > 10:
                raise SystemExit("a revoked token still passed after 10 s")
        times.append(time.perf_counter() - answered)
    return times


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def check_cost(entries: int, calls: int = 1_000_000) -> float:
    """Nanoseconds per `DenySet.check` of a token that is not revoked, with `entries` other
    tokens revoked (in this process, best of five)."""
    import timeit
    from types import MappingProxyType

    sys.path.insert(0, str(ROOT))
    from gateway.core.principal import Principal
    from gateway.steps.revocations import DenySet

    deny = DenySet()
    issuer = "https://auth.example.com"
    for _ in range(entries):
        deny.revoke_token(issuer, secrets.token_urlsafe(16), time.time() + 3600)
    claims = {"iss": issuer, "sub": "s", "jti": secrets.token_urlsafe(16), "iat": 0}
    principal = Principal(
        issuer, "s", "c", frozenset(), ("a",), time.time() + 3600, MappingProxyType(claims)
    )
    check = deny.check
    best = min(timeit.repeat(lambda: check(principal), number=calls, repeat=5))
    return best / calls * 1e9


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process so far, in clock ticks (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class Started:
    """The processes this script started, stopped in reverse order at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start(self, name: str, cpu: int, *command: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                ["taskset", "-c", str(cpu), PY, "-m", *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


async def run(args: argparse.Namespace, tmp: Path) -> str:
    """Two authorization servers (one whose log stays empty, one given the entries) and one
    gateway subscribed to each; the two gateways are measured in turn, three times each."""
    started = Started(tmp)
    try:
        async with aiohttp.ClientSession() as http:
            sides = {}
            for side in ("none", "full"):
                p_as, p_as_admin, p_gw, p_gw_admin = free_ports(4)
                issuer = f"http://127.0.0.1:{p_as}"
                directory = tmp / side
                directory.mkdir()
                as_config = authserver_config(directory, p_as, p_as_admin)
                started.start(f"authserver-{side}", args.client_cpu, "authserver", "run",
                              "--config", str(as_config))  # fmt: skip

                async def up(issuer: str = issuer) -> bool:
                    async with http.get(issuer + "/healthz") as response:
                        return response.status == 200

                await wait_until(up, "the authorization server")
                gw_config = gateway_config(directory, p_gw, p_gw_admin, issuer, args.upstream)
                gateway = started.start(f"gateway-{side}", args.server_cpu, "gateway", "run",
                                        "--config", str(gw_config))  # fmt: skip
                admin = f"http://127.0.0.1:{p_gw_admin}"

                async def synced(admin: str = admin) -> bool:
                    name = "portcullis_gateway_revocation_stream_synced"
                    return await metric(http, admin, name) == 1

                await wait_until(synced, "the gateway's revocation stream")
                sides[side] = (issuer, f"http://127.0.0.1:{p_gw}", admin, gateway, directory)

            issuer, _, admin, _, directory = sides["full"]
            loaded_at = time.monotonic()
            load_events(directory / "authserver.db", args.entries)

            async def loaded() -> bool:
                held = await metric(http, admin, "portcullis_gateway_revocation_entries")
                return held >= args.entries

            await wait_until(loaded, f"{args.entries} deny entries", timeout=300)
            loading = time.monotonic() - loaded_at
            held = await metric(http, admin, "portcullis_gateway_revocation_entries")

            rates: dict[str, list[float]] = {"none": [], "full": []}
            ticks: dict[str, list[float]] = {"none": [], "full": []}
            tokens = {side: await token(http, sides[side][0]) for side in sides}
            for _ in range(3):
                for side in ("none", "full"):
                    _, url, _, process, _ = sides[side]
                    wrk(url + "/api/items", tokens[side], args, args.warmup)
                    before = cpu_ticks(process.pid)
                    rate = wrk(url + "/api/items", tokens[side], args, args.duration)
                    used = cpu_ticks(process.pid) - before
                    rates[side].append(rate)
                    ticks[side].append(used / (rate * args.duration))

            issuer, gateway_url, *_ = sides["full"]
            times = await refusal_times(http, issuer, gateway_url, args.samples)
    finally:
        started.stop()
    none, full = statistics.median(rates["none"]), statistics.median(rates["full"])
    clk = os.sysconf("SC_CLK_TCK")
    cpu_none = statistics.median(ticks["none"]) / clk * 1e6
    cpu_full = statistics.median(ticks["full"]) / clk * 1e6
    ms = [t * 1000 for t in times]
    empty_ns, full_ns = check_cost(0), check_cost(args.entries)
    runs = ", ".join(
        f"{a:,.0f} / {b:,.0f}" for a, b in zip(rates["none"], rates["full"], strict=True)
    )
    return "\n".join(
        [
            "## Revocation events",
            "",
            f"Two gateway processes on core {args.server_cpu}, each subscribed to its own"
            " authorization server's revocation events (one log empty, the other given"
            f" {args.entries:,} revoked tokens), measured in turn, three times each: wrk -t1"
            f" -c{args.connections}, {args.duration}s after {args.warmup}s of warm-up, one warm"
            " ES256 token each. Medians:",
            "",
            "| scenario | requests/s | gateway CPU per request |",
            "| --- | --- | --- |",
            f"| warm JWT, empty deny-set | {none:,.0f} | {cpu_none:.0f} µs |",
            f"| warm JWT, {int(held):,} deny entries | {full:,.0f} | {cpu_full:.0f} µs |",
            "",
            f"Ratio (100k entries / none): **{full / none:.3f}** by requests/s,"
            f" **{cpu_none / cpu_full:.3f}** by CPU per request (runs, none / 100k: {runs})."
            f" The {args.entries:,} entries ({args.entries // PER_EVENT} events of {PER_EVENT}"
            f" tokens) reached the gateway {loading:.1f}s after they were written.",
            "",
            f"The check itself (`DenySet.check`, a token not revoked, best of 5 × 1M calls in"
            f" one process): {empty_ns:.0f} ns with an empty deny-set, {full_ns:.0f} ns with"
            f" {args.entries:,} entries.",
            "",
            f"Time from the `/revoke` answer to the first 401 at the gateway, {len(ms)} tokens"
            f" (each cached by the gateway first): p50 **{percentile(ms, 50):.1f} ms**,"
            f" p99 **{percentile(ms, 99):.1f} ms**, max {max(ms):.1f} ms, mean"
            f" {statistics.fmean(ms):.1f} ms.",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpu", type=int, default=1)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="portcullis-bench-revocations."))
    try:
        report = asyncio.run(run(args, tmp))
    except BaseException:
        for log in ("authserver.log", "gateway.log"):
            with contextlib.suppress(OSError):
                print(f"--- {log}\n" + (tmp / log).read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
