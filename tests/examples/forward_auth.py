"""What every front proxy's test does (tests/examples/test_forward_auth_*.py): the gateway's
decision listener in this process, the front proxy started on a free port with the very
configuration committed under examples/forward-auth/, and the same checks through each.

A front proxy's file is used as committed: its `${NAME}` placeholders are filled in as
`envsubst` would fill them (and only those named), or it reads the environment itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from yarl import URL

from tests.deploy.dockerfile import ROOT
from tests.support import (
    EchoUpstream,
    RunningGateway,
    TestIssuer,
    challenges_of,
    gateway_yaml,
    header_values,
    reserve_port,
    running_gateway,
)

EXAMPLES = ROOT / "examples" / "forward-auth"
IDENTITY = ("X-Auth-Subject", "X-Auth-Client-Id", "X-Auth-Scopes", "X-Auth-Issuer")
ROUTES = """
  - {name: admin, path: "/admin/**", scopes: {all: ["admin"]}}
  - {name: limited, path: "/limited/**", rate_limit: {rate: 1/m, burst: 2, key: subject}}
"""
# Requests whose target the front proxy and the rules could read differently: each must be
# refused, never reach the API as the public route it pretends to be.
PATH_TRICKS = (
    "/public/..%2fadmin/x",
    "/public/%2e%2e/admin/x",
    "/admin;x=1/x",
    "/public/..;/admin/x",
)
_PLACEHOLDER = re.compile(r"\$\{([A-Z_]+)\}")


def fill(template: str, values: Mapping[str, str]) -> str:
    """`envsubst '${A} ${B}'`: the named placeholders replaced, everything else as written."""
    missing = set(_PLACEHOLDER.findall(template)) - set(values)
    assert not missing, f"placeholders without a value: {sorted(missing)}"
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def host_port(url: str) -> str:
    parts = URL(url)
    return f"{parts.host}:{parts.port}"


def gateway_config(issuer: str, upstream: str, trusted: str, listen: str = "127.0.0.1:3") -> str:
    return gateway_yaml(
        issuer,
        upstream,
        extra_routes=ROUTES,
        extra=f'ext_authz: {{listen: "{listen}", trusted_callers: ["{trusted}"]}}',
    )


@contextlib.asynccontextmanager
async def decisions(
    issuer: TestIssuer, upstream: EchoUpstream, trusted: str = "127.0.0.1/32"
) -> AsyncIterator[RunningGateway]:
    """The gateway, whose decision listener the front proxy asks."""
    async with running_gateway(gateway_config(issuer.url, upstream.url, trusted)) as gw:
        yield gw


@dataclass
class FrontProxy:
    """A front proxy in its own process, listening on `port`."""

    command: Sequence[str]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, client: aiohttp.ClientSession, ready_path: str = "/public/ready") -> None:
        """Start it and wait until it answers `ready_path` with anything."""
        assert self.log is not None
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(
                list(self.command),
                env={**os.environ, **self.env},
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.command[0]} exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with client.get(
                    self.url + ready_path, timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    await resp.read()
                    if resp.status != 404:  # a proxy without its routes loaded yet: 404
                        return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.command[0]} not ready: {self.log.read_text()[-3000:]}")
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.asynccontextmanager
async def running(
    proxy: FrontProxy,
    client: aiohttp.ClientSession,
    tmp: Path,
    upstream: EchoUpstream,
    ready_path: str = "/public/ready",
) -> AsyncIterator[FrontProxy]:
    """The front proxy, started and answering; what its readiness probe sent upstream is
    forgotten."""
    proxy.log = tmp / "front-proxy.log"
    try:
        await proxy.start(client, ready_path)
        upstream.requests.clear()
        yield proxy
    finally:
        proxy.stop()


@dataclass
class Seen:
    status: int
    headers: Any
    body: bytes


async def get(
    client: aiohttp.ClientSession,
    url: str,
    token: str | None = None,
    headers: Mapping[str, str] | None = None,
    method: str = "GET",
) -> Seen:
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    async with client.request(method, URL(url, encoded=True), headers=sent) as resp:
        return Seen(resp.status, resp.headers, await resp.read())


def forged() -> dict[str, str]:
    return {name: "forged-by-client" for name in IDENTITY}


async def enforces_the_decisions(
    proxy: FrontProxy,
    issuer: TestIssuer,
    upstream: EchoUpstream,
    client: aiohttp.ClientSession,
    *,
    denied_body: bool = True,
) -> None:
    """No token → 401 with the challenge; wrong scope → 403; a valid token → the upstream
    sees its identity and never a forged one; over the rate limit → 429 with Retry-After;
    every path trick refused without reaching the API."""
    url = proxy.url
    # No token: 401 and the challenge, at the client.
    refused = await get(client, url + "/orders/1", headers=forged())
    assert refused.status == 401, refused.body
    # The Bearer challenge first; a DPoP one may follow (nginx passes only the first).
    bearer, *others = refused.headers.getall("WWW-Authenticate")
    assert challenges_of(refused.headers)[0] == 'Bearer realm="portcullis"'
    # Where the resource's metadata is, at the address the client used (RFC 9728 §5.1).
    assert bearer.endswith('/.well-known/oauth-protected-resource/orders"'), bearer
    assert all(
        other.startswith('DPoP realm="portcullis", algs="')
        for other in challenges_of(refused.headers)[1:]
    ), others
    if denied_body:
        assert b'"code":"unauthorized"' in refused.body.replace(b" ", b"")

    # The wrong scope: 403 insufficient_scope, with its challenge.
    reader = issuer.token(scope="orders:read")
    wrong = await get(client, url + "/admin/x", reader)
    assert wrong.status == 403, wrong.body
    assert 'error="insufficient_scope"' in wrong.headers["WWW-Authenticate"]
    assert upstream.requests == []

    # Allowed: the identity the token carries, and never a copy the client made.
    allowed = await get(client, url + "/orders/1", reader, headers=forged())
    assert allowed.status == 200, allowed.body
    (seen,) = upstream.requests
    assert seen["raw_path"] == "/orders/1"
    assert header_values(seen, "X-Auth-Subject") == ["user-123"]
    assert header_values(seen, "X-Auth-Client-Id") == ["webapp"]
    assert header_values(seen, "X-Auth-Scopes") == ["orders:read"]
    assert header_values(seen, "X-Auth-Issuer") == [issuer.url]

    # A token without client_id: the client's forged X-Auth-Client-Id must not survive.
    anonymous_client = issuer.token(scope="orders:read", drop=("client_id",))
    allowed = await get(client, url + "/orders/2", anonymous_client, headers=forged())
    assert allowed.status == 200, allowed.body
    seen = upstream.requests[-1]
    assert header_values(seen, "X-Auth-Client-Id") in ([], [""])
    assert header_values(seen, "X-Auth-Subject") == ["user-123"]

    # A public route: no identity at all, forged or not.
    public = await get(client, url + "/public/x", headers=forged())
    assert public.status == 200, public.body
    seen = upstream.requests[-1]
    for name in IDENTITY:
        assert header_values(seen, name) in ([], [""]), name

    # The rate limit (burst 2 per subject), counted once per request.
    limited = issuer.token(sub="limited-user")
    statuses = [(await get(client, url + "/limited/x", limited)).status for _ in range(2)]
    over = await get(client, url + "/limited/x", limited)
    assert statuses == [200, 200]
    assert over.status == 429, over.body
    assert int(over.headers["Retry-After"]) > 0

    # Path tricks: refused, never forwarded.
    forwarded = len(upstream.requests)
    for trick in PATH_TRICKS:
        answer = await get(client, url + trick)
        assert answer.status >= 400, (trick, answer.status)
    assert len(upstream.requests) == forwarded, upstream.requests[forwarded:]


async def refuses_untrusted_callers(
    proxy: FrontProxy,
    gateway: RunningGateway,
    issuer: TestIssuer,
    upstream: EchoUpstream,
    client: aiohttp.ClientSession,
    expected: int,
) -> None:
    """A gateway whose trusted_callers leave the front proxy out: nothing passes, valid
    token or not, and the decision listener said why."""
    token = issuer.token(scope="orders:read")
    for path in ("/orders/1", "/public/x"):
        answer = await get(client, proxy.url + path, token)
        assert answer.status == expected, (path, answer.status, answer.body)
    assert upstream.requests == []
    assert gateway.gateway.token_cache.misses == 0


async def fails_closed(
    proxy: FrontProxy,
    issuer: TestIssuer,
    upstream: EchoUpstream,
    client: aiohttp.ClientSession,
    expected: int,
) -> None:
    token = issuer.token(scope="orders:read")
    for path in ("/orders/1", "/public/x"):
        answer = await get(client, proxy.url + path, token)
        assert answer.status == expected, (path, answer.status, answer.body)
    assert upstream.requests == []


def reserve_ports(count: int) -> list[int]:
    return [reserve_port() for _ in range(count)]
