"""Real peers for tests: a token issuer (discovery + JWKS + signing) and an echo upstream.

Both are aiohttp servers on 127.0.0.1 with OS-assigned ports. Nothing here is mocked: the
gateway under test talks to them over real sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from gateway import settings as gateway_settings
from gateway.app import Gateway, admin_app, keys_session, public_server, upstream_session


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_site(app: web.Application | web.Server, port: int = 0) -> tuple[Any, str]:
    runner: web.BaseRunner
    if isinstance(app, web.Server):
        runner = web.ServerRunner(app, shutdown_timeout=1)
    else:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    host, bound = runner.addresses[0][:2]
    return runner, f"http://{host}:{bound}"


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


@dataclass
class TestIssuer:
    """An OpenID provider as far as a resource server can see: discovery, JWKS, tokens."""

    url: str = ""
    keys: list[SigningKey] = field(default_factory=list)
    jwks_fetches: int = 0
    discovery_fetches: int = 0
    jwks_status: int = 200  # anything else: the JWKS endpoint fails with it
    jwks_cache_control: str | None = "max-age=300"
    oidc_discovery: bool = True  # False: only RFC 8414 metadata
    jwks_delay: float = 0.0
    runner: Any = None

    def add_key(self, alg: str = "ES256", kid: str | None = None, published: bool = True) -> SigningKey:
        key = SigningKey(kid or f"{alg.lower()}-{uuid.uuid4().hex[:8]}", alg, _new_key(alg), published)
        self.keys.append(key)
        return key

    def key(self, alg: str) -> SigningKey:
        return next(k for k in self.keys if k.alg == alg and k.published)

    def jwks(self) -> dict[str, Any]:
        return {"keys": [public_jwk(k.private, k.kid, k.alg) for k in self.keys if k.published]}

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
        header = {"typ": "at+jwt", "kid": key.kid}
        header.update(headers or {})
        header = {k: v for k, v in header.items() if v is not None}
        return jwt.encode(payload, key.private, algorithm=key.alg, headers=header)

    async def start(self) -> TestIssuer:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._oidc)
        app.router.add_get("/.well-known/oauth-authorization-server", self._rfc8414)
        app.router.add_get("/jwks", self._jwks)
        self.runner, self.url = await start_site(app)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    def metadata(self) -> dict[str, Any]:
        return {"issuer": self.url, "jwks_uri": f"{self.url}/jwks"}

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

    async def start(self) -> EchoUpstream:
        self.runner, self.url = await start_site(web.Server(self._handle))
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
        self.requests.append(seen)
        return web.Response(
            body=json.dumps(seen).encode(),
            content_type="application/json",
            headers={"X-Upstream": "echo", "Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1"},
        )

    async def _download(self, request: web.BaseRequest, size: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        block = b"x" * 65536
        sent = 0
        while sent < size:
            part = block[: min(len(block), size - sent)]
            await response.write(part)
            sent += len(part)
        await response.write_eof()
        return response


def header_values(seen: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in seen["headers"] if k.lower() == name.lower()]


# ---------------------------------------------------------------------------- gateway


def gateway_yaml(issuer: str, upstream: str, extra_routes: str = "", extra: str = "") -> str:
    """A config with a few typical routes; tests add what they need."""
    return f"""
listen: "127.0.0.1:{free_port()}"
admin_listen: "127.0.0.1:{free_port()}"
upstream: {{url: "{upstream}", connect_timeout: 1s, read_timeout: 2s}}
issuers:
  - issuer: "{issuer}"
    audiences: [orders-api]
    algorithms: [ES256, RS256, EdDSA]
jwks: {{refetch_cooldown: 30s}}
routes:
{extra_routes}
  - {{name: public, path: "/public/**", auth: none}}
  - {{name: orders-read, path: "/orders/**", methods: [GET, HEAD], scopes: {{any: ["orders:read", "orders:admin"]}}}}
  - {{name: orders-write, path: "/orders/{{id}}", methods: [PUT, DELETE, POST], scopes: {{all: ["orders:write", "orders:read"]}}}}
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

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        await self.gateway.close()
        for session in self.sessions:
            await session.close()


async def start_gateway(config_text: str, *, wait_ready: bool = True) -> RunningGateway:
    """The gateway in this process and event loop, on real sockets."""
    settings = gateway_settings.load_text(config_text, "test.yaml")
    up, keys = upstream_session(settings), keys_session()
    gateway = Gateway(settings, up, keys)
    gateway.start()
    public_runner, url = await start_site(public_server(gateway))
    admin_runner, admin_url = await start_site(admin_app(gateway))
    running = RunningGateway(gateway, url, admin_url, [public_runner, admin_runner], [up, keys])
    if wait_ready:
        deadline = time.monotonic() + 10
        while gateway.not_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not ready: {gateway.not_ready()}")
            await asyncio.sleep(0.01)
    return running


async def drain(stream: AsyncIterator[bytes]) -> int:
    total = 0
    async for chunk in stream:
        total += len(chunk)
    return total
