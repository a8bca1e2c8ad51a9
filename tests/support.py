"""Real peers for tests: a token issuer (discovery + JWKS + signing) and an echo upstream.

Both are aiohttp servers on 127.0.0.1 with OS-assigned ports. Nothing here is mocked: the
gateway under test talks to them over real sockets.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm, get_default_algorithms
from multidict import CIMultiDict

from gateway import settings as gateway_settings
from gateway.app import Gateway, admin_app, decision_server, public_server, upstream_session
from gateway.core.clock import SYSTEM_CLOCK, Clock
from gateway.verifiers.jwks import keys_session
from portcullis import runtime
from portcullis.jose import ECDSA_CURVES, low_s
from portcullis.tls import RotatingCertificate

# Ports: a server in this process listens on a port the OS chooses (port 0, or a socket bound
# to port 0 and passed in), read back once it is bound, so tests never race for one and run
# side by side under pytest-xdist.

# What an in-process gateway's `listen` and `admin_listen` say: start_gateway serves the
# Gateway on ports the OS chooses and never binds these.
UNBOUND_LISTEN = "127.0.0.1:1"
UNBOUND_ADMIN_LISTEN = "127.0.0.1:2"
# The port in a configuration nothing serves (checked, or read by a command that binds none).
UNBOUND_PORT = 1


def bound_socket() -> socket.socket:
    """A TCP socket bound to a port of 127.0.0.1 the OS chose, for a server in this process
    that must name its own port before it is built (an issuer's URL does): serve it with
    `start_site(app, sock=...)`."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port where connections are refused for as long as the block runs: bound (by the
    OS's choice) but not listening, so nothing else can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _port_slice() -> Iterator[int]:
    """This test process's own ports below the ephemeral range, from a random start."""
    high = _ephemeral_floor()
    low = max(1024, high - 12_000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    size = (high - low) // max(1, workers)
    first = low + index * size
    start = secrets.randbelow(size)
    for n in range(size):
        yield first + (start + n) % size


_PORTS = _port_slice()


def reserve_port() -> int:
    """A port for a server in another process, which must be told its port in its
    configuration before it starts (the programs bind the port their configuration names;
    an issuer's URL names it): the one case where a port is chosen rather than bound.

    Chosen below the kernel's ephemeral range, which the OS never hands out for port 0 or
    outgoing connections, from a slice of that range of this xdist worker's own, never the
    same twice in a run, and checked free by binding it. So no other test of the run can
    take it before the server binds it.
    """
    for port in _PORTS:
        if _bindable(port):
            return port
    raise AssertionError("no free port left in this worker's range")


async def start_site(
    app: web.Application | web.Server,
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    *,
    sock: socket.socket | None = None,
    server_header: Callable[[], str] | None = None,
) -> tuple[Any, str]:
    """Serve `app` on 127.0.0.1: on `sock`, else on `port` (0: one the OS chooses); over
    TLS with `ssl_context`. An Application is served as `run` serves it (runtime.app_runner,
    with `server_header` for the answers to requests its parser refuses)."""
    runner: web.BaseRunner
    if isinstance(app, web.Server):
        runner = web.ServerRunner(app, shutdown_timeout=1)
    else:
        runner = runtime.app_runner(app, shutdown_timeout=1, server_header=server_header)
    await runner.setup()
    site: web.BaseSite = (
        web.SockSite(runner, sock, ssl_context=ssl_context)
        if sock is not None
        else web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context)
    )
    await site.start()
    host, bound = runner.addresses[0][:2]
    return runner, f"{'https' if ssl_context else 'http'}://{host}:{bound}"


# ---------------------------------------------------------------------------- issuer


def _new_key(alg: str) -> Any:
    if alg.startswith(("RS", "PS")):
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if alg == "ES256":
        return ec.generate_private_key(ec.SECP256R1())
    if alg == "ES384":
        return ec.generate_private_key(ec.SECP384R1())
    if alg == "EdDSA":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(alg)


def public_jwk(private_key: Any, kid: str, alg: str) -> dict[str, Any]:
    public = private_key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        jwk = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
    jwk.update({"kid": kid, "alg": alg, "use": "sig"})
    return jwk


@dataclass
class SigningKey:
    kid: str
    alg: str
    private: Any
    published: bool = True
    # Members changed in the published JWK; a None value removes the member.
    jwk_overrides: dict[str, Any] = field(default_factory=dict)

    def jwk(self) -> dict[str, Any]:
        jwk = public_jwk(self.private, self.kid, self.alg)
        jwk.update(self.jwk_overrides)
        return {k: v for k, v in jwk.items() if v is not None}


def b64url(data: bytes | str | dict[str, Any]) -> str:
    """Unpadded base64url of bytes, text, or a JSON object."""
    if isinstance(data, dict):
        data = json.dumps(data, separators=(",", ":"))
    if isinstance(data, str):
        data = data.encode()
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def compact(header: dict[str, Any], payload: dict[str, Any], sign: Any = None) -> str:
    """A JWS compact serialisation built by hand; `sign(signing_input) -> bytes` or unsigned."""
    signing_input = f"{b64url(header)}.{b64url(payload)}"
    signature = sign(signing_input.encode()) if sign is not None else b""
    return f"{signing_input}.{b64url(signature)}"


def _b64url_bytes(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def low_s_jws(token: str) -> str:
    """`token` with its ES256/384/512 signature in the low-S spelling (portcullis.jose), the
    one this project's authorization server signs and refuses the other of; any other token
    unchanged."""
    head, _, signature = token.rpartition(".")
    alg = json.loads(_b64url_bytes(head.partition(".")[0])).get("alg")
    return f"{head}.{b64url(low_s(alg, _b64url_bytes(signature)))}"


def ecdsa_twin(token: str) -> str:
    """The other spelling of an ES256/384/512 token's signature, (r, n - s), which verifies
    as well as its own: what anyone holding the token can make of it without the key."""
    head, _, signature = token.rpartition(".")
    order, width = ECDSA_CURVES[json.loads(_b64url_bytes(head.partition(".")[0]))["alg"]]
    raw = _b64url_bytes(signature)
    s = int.from_bytes(raw[width:], "big")
    return f"{head}.{b64url(raw[:width] + (order - s).to_bytes(width, 'big'))}"


@dataclass
class TestIssuer:
    """An OpenID provider as far as a resource server can see: discovery, JWKS, tokens.

    Every request it receives is recorded in `requests` (method and path), whatever the path.
    """

    __test__ = False  # not a pytest test class

    url: str = ""
    keys: list[SigningKey] = field(default_factory=list)
    jwks_fetches: int = 0
    discovery_fetches: int = 0
    jwks_status: int = 200  # anything else: the JWKS endpoint fails with it
    jwks_cache_control: str | None = "max-age=300"
    oidc_discovery: bool = True  # False: only RFC 8414 metadata
    jwks_delay: float = 0.0
    extra_jwks_entries: list[Any] = field(default_factory=list)  # appended to "keys" as given
    requests: list[str] = field(default_factory=list)
    metadata_overrides: dict[str, Any] = field(default_factory=dict)
    runner: Any = None
    held: socket.socket | None = None  # the port, while stopped

    def add_key(
        self,
        alg: str = "ES256",
        kid: str | None = None,
        published: bool = True,
        *,
        private: Any = None,
        jwk_overrides: dict[str, Any] | None = None,
    ) -> SigningKey:
        """A new signing key (`private` to bring one, e.g. a P-384 key for ES256)."""
        key = SigningKey(
            kid or f"{alg.lower()}-{uuid.uuid4().hex[:8]}",
            alg,
            private if private is not None else _new_key(alg),
            published,
            dict(jwk_overrides or {}),
        )
        self.keys.append(key)
        return key

    def key(self, alg: str) -> SigningKey:
        return next(k for k in self.keys if k.alg == alg and k.published)

    def jwks(self) -> dict[str, Any]:
        return {"keys": [k.jwk() for k in self.keys if k.published] + self.extra_jwks_entries}

    def claims(
        self, *, lifetime: float = 300, drop: Iterable[str] = (), **claims: Any
    ) -> dict[str, Any]:
        """The payload `token` signs: a typical access token, changed by `claims` and `drop`."""
        now = int(time.time())
        payload: dict[str, Any] = {
            "iss": self.url,
            "sub": "user-123",
            "aud": "orders-api",
            "client_id": "webapp",
            "scope": "orders:read",
            "iat": now,
            "exp": now + lifetime,
            "jti": uuid.uuid4().hex,
        }
        payload.update(claims)
        for name in drop:
            payload.pop(name, None)
        return payload

    def token(
        self,
        alg: str = "ES256",
        *,
        key: SigningKey | None = None,
        lifetime: float = 300,
        headers: dict[str, Any] | None = None,
        drop: tuple[str, ...] = (),
        **claims: Any,
    ) -> str:
        key = key or self.key(alg)
        payload = self.claims(lifetime=lifetime, drop=drop, **claims)
        header = {"typ": "at+jwt", "kid": key.kid}
        header.update(headers or {})
        # None removes a member; PyJWT itself drops a `typ` that is None instead of adding "JWT".
        header = {k: v for k, v in header.items() if v is not None or k == "typ"}
        return low_s_jws(jwt.encode(payload, key.private, algorithm=key.alg, headers=header))

    def sign_compact(
        self,
        header: dict[str, Any],
        payload: dict[str, Any],
        *,
        key: SigningKey | None = None,
        alg: str | None = None,
    ) -> str:
        """Exactly this header and payload, signed with `key` by algorithm `alg` (default: the
        key's own), whatever the header says: for tokens PyJWT refuses to build."""
        key = key or self.keys[0]
        signing = alg or key.alg
        algorithm = get_default_algorithms()[signing]
        return compact(
            header, payload, lambda data: low_s(signing, algorithm.sign(data, key.private))
        )

    async def start(self, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> TestIssuer:
        """Serve on `port` (0: any free one; give the old port to restart after `stop`),
        over https with `ssl_context`."""
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/.well-known/openid-configuration", self._oidc)
        app.router.add_get("/.well-known/oauth-authorization-server", self._rfc8414)
        app.router.add_get("/jwks", self._jwks)
        held, self.held = self.held, None
        if held is not None and port == held.getsockname()[1]:
            self.runner, self.url = await start_site(app, ssl_context=ssl_context, sock=held)
        else:
            if held is not None:
                held.close()
            self.runner, self.url = await start_site(app, port, ssl_context)
        return self

    async def stop(self, *, keep_port: bool = False) -> None:
        """Stop serving (the port is then refused); safe to call twice. With `keep_port`,
        until `start(port)` serves again the port stays bound to this issuer without
        listening, so no other server of the run can take it meanwhile."""
        if self.held is not None:
            self.held.close()
            self.held = None
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()
            if not keep_port:
                return
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", self.port))
            except OSError:
                sock.close()  # taken in the instant between: a restart will say so
            else:
                self.held = sock

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        response: web.StreamResponse = await handler(request)
        return response

    def metadata(self) -> dict[str, Any]:
        document = {"issuer": self.url, "jwks_uri": f"{self.url}/jwks"}
        document.update(self.metadata_overrides)
        return document

    async def _oidc(self, _: web.Request) -> web.Response:
        self.discovery_fetches += 1
        if not self.oidc_discovery:
            raise web.HTTPNotFound()
        return web.json_response(self.metadata())

    async def _rfc8414(self, _: web.Request) -> web.Response:
        self.discovery_fetches += 1
        return web.json_response(self.metadata())

    async def _jwks(self, _: web.Request) -> web.Response:
        self.jwks_fetches += 1
        if self.jwks_delay:
            await asyncio.sleep(self.jwks_delay)
        if self.jwks_status != 200:
            return web.Response(status=self.jwks_status, text="unavailable")
        headers = {"Cache-Control": self.jwks_cache_control} if self.jwks_cache_control else {}
        return web.json_response(self.jwks(), headers=headers)


# ---------------------------------------------------------------------------- upstream


@dataclass
class EchoUpstream:
    """Reports what it received. Special paths: /_slow/<seconds>, /_bytes/<n> (download)."""

    url: str = ""
    runner: Any = None
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> EchoUpstream:
        self.runner, self.url = await start_site(web.Server(self._handle), 0, ssl_context)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.raw_path.partition("?")[0]
        if path.startswith("/_slow/"):
            await asyncio.sleep(float(path.rsplit("/", 1)[1]))
        if path.startswith("/_bytes/"):
            return await self._download(request, int(path.rsplit("/", 1)[1]))
        digest = hashlib.sha256()
        size = 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
        seen = {
            "method": request.method,
            "raw_path": request.raw_path,
            "headers": [[k, v] for k, v in request.headers.items()],
            "body_size": size,
            "body_sha256": digest.hexdigest(),
        }
        transport = request.transport
        peer = transport.get_extra_info("peercert") if transport is not None else None
        if peer:
            seen["client_cert_subject"] = peer["subject"]  # over TLS with a client certificate
        self.requests.append(seen)
        return web.Response(
            body=json.dumps(seen).encode(),
            content_type="application/json",
            headers={
                "X-Upstream": "echo",
                "Connection": "keep-alive, X-Secret-Hop",
                "X-Secret-Hop": "1",
            },
        )

    async def _download(self, request: web.BaseRequest, size: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        block = b"x" * 65536
        sent = 0 if request.method != "HEAD" else size  # HEAD: the length, no body
        while sent < size:
            part = block[: min(len(block), size - sent)]
            await response.write(part)
            sent += len(part)
        await response.write_eof()
        return response


def header_values(seen: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in seen["headers"] if k.lower() == name.lower()]


# ---------------------------------------------------------------------------- gateway


def issuer_entry(
    url: str,
    audiences: Sequence[str] = ("orders-api",),
    algorithms: Sequence[str] = ("ES256", "RS256", "EdDSA"),
    **options: str,
) -> str:
    """One item of the `issuers` list; `options` are further keys as YAML text (leeway="0s")."""
    lines = [
        f'  - issuer: "{url}"',
        f"    audiences: [{', '.join(audiences)}]",
        f"    algorithms: [{', '.join(algorithms)}]",
    ]
    lines += [f"    {name}: {value}" for name, value in options.items()]
    return "\n".join(lines)


def gateway_yaml(
    issuer: str,
    upstream: str,
    extra_routes: str = "",
    extra: str = "",
    *,
    issuers: Sequence[str] | None = None,
    jwks: str = "{refetch_cooldown: 30s}",
) -> str:
    """A config with a few typical routes; tests add what they need.

    `issuers` replaces the single trusted issuer with entries made by `issuer_entry`;
    `jwks` is the `jwks:` section as YAML text.
    """
    trusted = "\n".join(issuers) if issuers is not None else issuer_entry(issuer)
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}", connect_timeout: 1s, read_timeout: 2s}}
issuers:
{trusted}
jwks: {jwks}
routes:
{extra_routes}
  - {{name: public, path: "/public/**", auth: none}}
  - {{name: orders-read, path: "/orders/**", methods: [GET, HEAD],
      scopes: {{any: ["orders:read", "orders:admin"]}}}}
  - {{name: orders-write, path: "/orders/{{id}}", methods: [PUT, DELETE, POST],
      scopes: {{all: ["orders:write", "orders:read"]}}}}
  - {{name: upload, path: "/upload/**", methods: [POST, PUT], max_body_size: 200MiB}}
  - {{name: small, path: "/small/**", methods: [POST], max_body_size: 1KiB}}
  - {{name: other, path: "/**"}}
{extra}
"""


@dataclass
class RunningGateway:
    gateway: Gateway
    url: str
    admin_url: str
    runners: list[Any]
    sessions: list[Any]
    certificate: RotatingCertificate | None = None  # the public listener's, with `tls`
    watcher: asyncio.Task[None] | None = None
    decision_url: str = ""  # the decision listener's, with `ext_authz`

    async def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watcher
        for runner in self.runners:
            await runner.cleanup()
        await self.gateway.close()
        for session in self.sessions:
            await session.close()


async def start_gateway(
    config_text: str,
    *,
    wait_ready: bool = True,
    config_file: Path | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> RunningGateway:
    """The gateway in this process and event loop, on real sockets.

    With `config_file`, the text is written there and loaded from it, as `run --config`
    does: the gateway then reloads it when it changes. With `clock` (a `ManualClock`'s),
    the gateway's time is what the test makes it.
    """
    if config_file is not None:
        config_file.write_text(config_text)
        settings = gateway_settings.load(str(config_file))
    else:
        settings = gateway_settings.load_text(config_text, "test.yaml")
    up, keys = upstream_session(settings), keys_session()
    gateway = Gateway(settings, up, keys, clock)
    gateway.start()
    # With `tls`, the public listener is served as `run` serves it: rotated files followed.
    certificate = RotatingCertificate(settings.tls) if settings.tls is not None else None
    public_runner, url = await start_site(
        public_server(gateway), 0, certificate.context if certificate is not None else None
    )
    admin_runner, admin_url = await start_site(
        admin_app(gateway), server_header=lambda: gateway.settings.server_header
    )
    runners = [public_runner, admin_runner]
    decision_url = ""
    if settings.ext_authz is not None:
        decision_runner, decision_url = await start_site(decision_server(gateway))
        runners.append(decision_runner)
    running = RunningGateway(
        gateway,
        url,
        admin_url,
        runners,
        [up, keys],
        certificate,
        asyncio.create_task(certificate.watch()) if certificate is not None else None,
        decision_url,
    )
    if wait_ready:
        deadline = time.monotonic() + 10
        while gateway.not_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not ready: {gateway.not_ready()}")
            await asyncio.sleep(0.01)
    return running


@contextlib.asynccontextmanager
async def running_gateway(
    config_text: str,
    *,
    wait_ready: bool = True,
    config_file: Path | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> AsyncIterator[RunningGateway]:
    """`start_gateway` for one `async with` block; stopped however the block ends."""
    running = await start_gateway(
        config_text, wait_ready=wait_ready, config_file=config_file, clock=clock
    )
    try:
        yield running
    finally:
        await running.stop()


class ManualClock:
    """Time a test moves by hand, for a gateway started with `clock=manual.clock`.

    Both readings start at the real ones and move only by `advance`, together: expiries,
    cache lifetimes, cool-downs and refills happen when the test says, however slow the
    machine. Background work that waits on the clock's `sleep` (scheduled key refreshes)
    wakes when the test has moved the time past its deadline.
    """

    def __init__(self) -> None:
        self.wall = time.time()
        self.monotonic = time.monotonic()
        self._moved = asyncio.Event()
        self.clock = Clock(
            wall=lambda: self.wall, monotonic=lambda: self.monotonic, sleep=self.sleep
        )

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.monotonic += seconds
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def sleep(self, seconds: float) -> None:
        """Until the clock has been moved `seconds` on from now."""
        deadline = self.monotonic + seconds
        while self.monotonic < deadline:
            await self._moved.wait()

    def catch_up(self) -> None:
        """Forward to the real time, if it is behind: for a token another process has
        just issued at its real time, which a gateway with no leeway would otherwise find
        issued in its future."""
        self.advance(max(0.0, time.time() - self.wall))


class Background:
    """An event loop on a thread of its own: for servers a module's hypothesis examples
    share, since the examples themselves run one after another in the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def wait_for(condition: Any, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `condition()` every 10 ms until it is true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------- answers


@dataclass
class Answer:
    """What a client got back: status, headers and the body (JSON when it is JSON)."""

    status: int
    headers: Any
    body: Any


async def call(
    client: aiohttp.ClientSession,
    url: str,
    token: str | None = None,
    *,
    method: str = "GET",
) -> Answer:
    """One request with `Authorization: Bearer <token>` when a token is given."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with client.request(method, url, headers=headers) as resp:
        body: Any = await resp.read()
        if resp.content_type == "application/json" and body:
            body = json.loads(body)
        return Answer(resp.status, resp.headers, body)


# The DPoP challenge (RFC 9449 §7.1) every 401 of a route that takes bearer tokens carries
# after the Bearer one, with the default proof algorithms.
DPOP_ALGS = "ES256 ES384 ES512 PS256 PS384 PS512 RS256 RS384 RS512 EdDSA"


# The parameters every challenge of a protected route carries besides its error: the scopes
# the route needs (RFC 6750 §3) and where its resource metadata is (RFC 9728 §5.1).
_ROUTE_PARAMS = re.compile(
    r', (?:scope="[\x21\x23-\x5B\x5D-\x7E ]*"'
    r'|resource_metadata="https?://[^"]+/\.well-known/oauth-protected-resource(?:/[^"]*)?")'
)


_METADATA_PARAM = re.compile(
    r', resource_metadata="https?://[^"]+/\.well-known/oauth-protected-resource(?:/[^"]*)?"'
)


def challenges_of(headers: Any, *, keep_scope: bool = False) -> list[str]:
    """The WWW-Authenticate values of an answer without the `scope` and `resource_metadata`
    parameters a protected route's challenges carry (each well formed, or it stays and the
    comparison fails); `keep_scope` for a 403 whose error names its scope. Tests of those
    parameters read the fields whole."""
    pattern = _METADATA_PARAM if keep_scope else _ROUTE_PARAMS
    return [pattern.sub("", value) for value in headers.getall("WWW-Authenticate", ())]


def assert_invalid_token(answer: Answer, description: str, realm: str = "portcullis") -> None:
    """401 with the RFC 6750 §3 challenge and the resource error body, both naming the rule;
    the DPoP challenge beside it."""
    assert answer.status == 401, answer.body
    assert challenges_of(answer.headers) == [
        f'Bearer realm="{realm}", error="invalid_token", error_description="{description}"',
        f'DPoP realm="{realm}", algs="{DPOP_ALGS}"',
    ]
    assert answer.body == {
        "error": {
            "code": "invalid_token",
            "message": f"The access token was refused: {description}.",
            "details": [],
        }
    }


def assert_unavailable(answer: Answer) -> None:
    """503 with Retry-After and the resource error body; no challenge, the token is not at fault."""
    assert answer.status == 503, answer.body
    assert int(answer.headers["Retry-After"]) > 0
    assert "WWW-Authenticate" not in answer.headers
    assert answer.body == {
        "error": {
            "code": "unavailable",
            "message": "The gateway cannot verify tokens right now; try again shortly.",
            "details": [],
        }
    }


async def drain(stream: AsyncIterator[bytes]) -> int:
    total = 0
    async for chunk in stream:
        total += len(chunk)
    return total


# ---------------------------------------------------------------------------- raw HTTP


@dataclass
class RawResponse:
    """A response read off a raw socket, exactly as it came."""

    status: int
    reason: str
    headers: CIMultiDict[str]
    body: bytes
    version: str = "HTTP/1.1"  # as the status line gave it

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    host: str = "gateway.test",
) -> bytes:
    """A request serialised by hand, so targets and headers reach the server unchanged.

    `Host` is added unless given; nothing else is (no Content-Length: give it when needed).
    """
    lines = [f"{method} {target} HTTP/1.1"]
    if not any(name.lower() == "host" for name, _ in headers):
        lines.append(f"Host: {host}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class RawConnection:
    """One client connection that sends bytes as given: for requests real clients won't make."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str, ssl_context: ssl.SSLContext | None = None) -> RawConnection:
        """A connection to `url`'s host and port; over TLS with `ssl_context`."""
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), ssl=ssl_context)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, *, head: bool = False, timeout: float = 5.0) -> RawResponse:
        """The next response; its body framed by Content-Length, chunked coding or EOF."""
        async with asyncio.timeout(timeout):
            status_line = (await self.reader.readuntil(b"\r\n")).decode("latin-1").rstrip()
            version, status, *reason = status_line.split(" ", 2)
            headers: CIMultiDict[str] = CIMultiDict()
            while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.decode("latin-1").partition(":")
                headers.add(name.strip(), value.strip())
            code = int(status)
            if head or code in (204, 304) or code < 200:
                body = b""
            elif "chunked" in headers.get("Transfer-Encoding", "").lower():
                body = await self._chunked()
            elif "Content-Length" in headers:
                body = await self.reader.readexactly(int(headers["Content-Length"]))
            else:
                body = await self.reader.read()
        return RawResponse(code, reason[0] if reason else "", headers, body, version)

    async def _chunked(self) -> bytes:
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await self.reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailer fields
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    async def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection within `timeout` without sending more."""
        try:
            async with asyncio.timeout(timeout):
                return await self.reader.read(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.writer.transport.abort()


async def raw_exchange(url: str, request: bytes, *, timeout: float = 5.0) -> RawResponse:
    """Send one raw request on a fresh connection and read the answer."""
    connection = await RawConnection.open(url)
    try:
        await connection.send(request)
        return await connection.response(head=request.startswith(b"HEAD "), timeout=timeout)
    finally:
        connection.close()


async def refused_exchange(url: str, request: bytes) -> RawResponse:
    """Send one raw request on a fresh connection, read the answer, and check that the
    server then closed the connection (as it must after a request it could not read)."""
    connection = await RawConnection.open(url)
    try:
        await connection.send(request)
        answer = await connection.response()
        assert await connection.closed_by_peer(), "the connection stayed open"
        return answer
    finally:
        connection.close()


@dataclass
class CountingUpstream(EchoUpstream):
    """An EchoUpstream that also notes each request's target when it arrives, before any
    answer: how a test knows a slow request is in flight."""

    arrived: list[str] = field(default_factory=list)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.arrived.append(request.raw_path)
        return await super()._handle(request)


# ---------------------------------------------------------------------------- processes


def proc_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a mapping (VmRSS, VmHWM, PPid, ...)."""
    with open(f"/proc/{pid}/status") as status:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in status)}


def memory_kib(pid: int, field_name: str) -> int:
    """A memory figure of a process in KiB: VmRSS (now) or VmHWM (the peak so far)."""
    return int(proc_status(pid)[field_name].split()[0])


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid`, from /proc/*/stat."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The command name is in parentheses and may hold spaces: split after it.
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets a process holds open."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


TCP_LISTEN = "0A"
TCP_ESTABLISHED = "01"


@dataclass(frozen=True)
class TcpSocket:
    local_port: int
    remote_port: int
    state: str
    inode: int


def tcp_sockets(local_port: int) -> list[TcpSocket]:
    """IPv4 TCP sockets bound to `local_port` on this host, from /proc/net/tcp."""
    found = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if port == local_port:
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                found.append(TcpSocket(port, remote, fields[3], int(fields[9])))
    return found


_LISTENERS = re.compile(r'^(listen|admin_listen): "127\.0\.0\.1:\d+"$', re.MULTILINE)


def with_reserved_listeners(config_text: str) -> str:
    """The text with its `listen` and `admin_listen` on ports reserved for a process."""
    return _LISTENERS.sub(lambda m: f'{m.group(1)}: "127.0.0.1:{reserve_port()}"', config_text)


class GatewayProcess:
    """`python -m gateway run --config FILE` in a child process, started as operators do.

    The process listens on ports reserved for it (`reserve_port`): whatever ports the
    text's `listen` and `admin_listen` name are replaced.
    """

    def __init__(self, config_text: str, directory: Path) -> None:
        self.config = directory / "gateway.yaml"
        self.config.write_text(with_reserved_listeners(config_text))
        self.log_path = directory / "gateway.log"
        settings = gateway_settings.load(str(self.config))
        self.url = f"{'https' if settings.tls else 'http'}://{settings.listen}"
        self.admin_url = f"http://{settings.admin_listen}"
        self.port = settings.listen.port
        self.admin_port = settings.admin_listen.port
        self.grace = settings.shutdown_grace.total_seconds()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gateway", "run", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_ready(self, timeout: float = 15.0) -> None:
        """Until the admin port answers /readyz with 200; fails early if the process exits."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(f"gateway exited {self.process.returncode}:\n{self.log()}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(self.admin_url + "/readyz") as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise AssertionError(f"gateway not ready in {timeout}s:\n{self.log()}")
                await asyncio.sleep(0.05)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None when the process is still running after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.process.poll()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within its grace."""
        if self.process.poll() is None:
            self.process.terminate()
            if await self.wait_exit(self.grace + 5) is None:
                self.process.kill()
                self.process.wait()


# ---------------------------------------------------------------------------- introspection


def basic_credentials(header: str | None) -> tuple[str, str] | None:
    """(client_id, secret) of an HTTP Basic header, each part form-urldecoded (RFC 6749
    §2.3.1), or None."""
    from urllib.parse import unquote_plus

    if not header or not header.startswith("Basic "):
        return None
    try:
        raw = base64.b64decode(header[6:], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    client_id, sep, secret = raw.partition(":")
    return (unquote_plus(client_id), unquote_plus(secret)) if sep else None


@dataclass
class IntrospectionServer:
    """An RFC 7662 introspection endpoint a test controls, with a discovery document naming it.

    `answers[token]` is the JSON object returned for a token (default `{"active": false}`);
    `delay` holds every answer back; `status` other than 200 answers with that status;
    `garbage` answers that body instead. Each call is recorded in `calls` (the form and the
    client credentials it carried), and `in_flight` counts calls not answered yet.
    """

    __test__ = False

    client_id: str = "gateway"
    client_secret: str = "gateway-secret"
    url: str = ""
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    delay: float = 0.0
    status: int = 200
    garbage: bytes | None = None
    cache_control: str | None = "no-store"
    advertise: bool = True  # False: discovery has no introspection_endpoint
    calls: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    runner: Any = None

    async def start(
        self, port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> IntrospectionServer:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._metadata)
        app.router.add_get("/.well-known/oauth-authorization-server", self._metadata)
        app.router.add_post("/introspect", self._introspect)
        self.runner, self.url = await start_site(app, port, ssl_context)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def endpoint(self) -> str:
        return f"{self.url}/introspect"

    def active(self, token: str, **claims: Any) -> dict[str, Any]:
        """Make `token` active with typical claims, changed by `claims`; returns the answer."""
        now = int(time.time())
        answer: dict[str, Any] = {
            "active": True,
            "iss": self.url,
            "sub": "user-123",
            "aud": "orders-api",
            "client_id": "webapp",
            "scope": "orders:read",
            "token_type": "Bearer",
            "iat": now,
            "exp": now + 300,
        }
        answer.update(claims)
        answer = {k: v for k, v in answer.items() if v is not None}
        self.answers[token] = answer
        return answer

    async def _metadata(self, _: web.Request) -> web.Response:
        document: dict[str, Any] = {"issuer": self.url, "jwks_uri": f"{self.url}/jwks"}
        if self.advertise:
            document["introspection_endpoint"] = self.endpoint
        return web.json_response(document)

    async def _introspect(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        self.calls.append(
            {
                "form": {k: str(v) for k, v in form.items()},
                "credentials": basic_credentials(request.headers.get("Authorization")),
            }
        )
        self.in_flight += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if basic_credentials(request.headers.get("Authorization")) != (
                self.client_id,
                self.client_secret,
            ):
                return web.json_response(
                    {"error": "invalid_client"},
                    status=401,
                    headers={"WWW-Authenticate": 'Basic realm="introspection"'},
                )
            if self.status != 200:
                return web.Response(status=self.status, text="unavailable")
            headers = {"Cache-Control": self.cache_control} if self.cache_control else {}
            if self.garbage is not None:
                return web.Response(
                    body=self.garbage, content_type="application/json", headers=headers
                )
            answer = self.answers.get(str(form.get("token", "")), {"active": False})
            return web.json_response(answer, headers=headers)
        finally:
            self.in_flight -= 1


# ---------------------------------------------------------------------------- Redis

REDIS_URL = "redis://127.0.0.1:6379/0"


async def redis_or_skip() -> Any:
    """A client of the machine's Redis at 127.0.0.1:6379. When it is not reachable the test
    is skipped with the reason, except under CI=true, where that is a failure."""
    import redis.asyncio as redis_asyncio

    client = redis_asyncio.Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        service_missing(f"Redis is not reachable at {REDIS_URL} ({type(exc).__name__})")
    return client


def service_missing(reason: str) -> NoReturn:
    """Skip a test whose service (Redis, PostgreSQL) is not there, saying why; under
    CI=true, where every service must be, fail it instead."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(reason + "; CI=true requires it")
    pytest.skip(reason)


# ---------------------------------------------------------------------------- metrics, logs


async def scrape(admin_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics and parse it: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(admin_url + "/metrics") as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "text/plain"
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """The value of one sample, 0 when absent (a counter nothing has touched yet). The
    gateway's request and denial counts are the public listener's (mode proxy) unless a
    `mode` is given."""
    if name in _MODE_LABELLED and "mode" not in labels:
        labels = {**labels, "mode": "proxy"}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


_MODE_LABELLED = frozenset(
    {"portcullis_gateway_requests_total", "portcullis_gateway_denials_total"}
)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
