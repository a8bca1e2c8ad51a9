"""A server for the admin API's tests: the default configuration plus the admin clients, on
SQLite or on the machine's PostgreSQL (a fresh schema), and helpers to call the API.

`admin_config(port)` adds to `default_config()`:
- `admin-cli`: client_credentials with admin:read and admin:write for `{issuer}/admin/v1`;
- `admin-reader`: the same with admin:read only;
- `console`: a public client whose users may ask for the admin API's audience and scopes;
and gives alice the `admin` role (bob has none).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authserver.conftest import (
    REDIRECT,
    SECRET,
    RunningAuthServer,
    _key_template,
    client_credentials,
    default_config,
    load_settings,
    run_authserver,
)
from tests.authserver.postgres_support import fresh_schema, postgres_url_or_skip
from tests.support import bound_socket

BACKENDS = ["sqlite", "postgresql"]


def admin_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/admin/v1"


def admin_config(port: int) -> dict[str, Any]:
    config = default_config()
    audience = admin_url(port)
    config["users"][0]["roles"] = ["admin", "auditor"]
    config["clients"] += [
        {
            "client_id": "admin-cli",
            "client_secret": SECRET,
            "grant_types": ["client_credentials"],
            "scope": "admin:read admin:write",
            "resources": [audience],
        },
        {
            "client_id": "admin-reader",
            "client_secret": SECRET,
            "grant_types": ["client_credentials"],
            "scope": "admin:read",
            "resources": [audience],
        },
        {
            "client_id": "console",
            "token_endpoint_auth_method": "none",
            "redirect_uris": [REDIRECT],
            "grant_types": ["authorization_code", "refresh_token"],
            "scope": "openid profile email roles offline_access admin:read admin:write",
            "resources": [audience],
            "skip_consent": True,
        },
    ]
    return config


StartAdminServer = Callable[..., Awaitable[RunningAuthServer]]


@pytest.fixture(params=BACKENDS)
async def start_admin_server(
    request: pytest.FixtureRequest, tmp_path: Path, key_root: Path
) -> AsyncIterator[StartAdminServer]:
    """Factory: a server with `admin_config`, on the parametrised backend; servers started
    by one test share one database (replicas)."""
    backend = request.param
    started: list[RunningAuthServer] = []
    # Made before the test's clocks start: a key must exist before a clock's first reading.
    template = _key_template(key_root)
    async with _storage(backend, tmp_path) as storage:

        async def start(
            change: Callable[[dict[str, Any]], None] | None = None,
            clock: Callable[[], float] = time.time,
        ) -> RunningAuthServer:
            directory = tmp_path / f"admin{len(started)}"
            directory.mkdir()
            shutil.copytree(template, directory / "keys")
            sock = bound_socket()
            port = sock.getsockname()[1]
            # Replicas of one deployment share its issuer, that of the first server.
            config = admin_config(started[0].port if started else port)
            config["storage"] = storage
            if started:
                config["issuer"] = started[0].settings.issuer
            if change is not None:
                change(config)
            try:
                server = await run_authserver(load_settings(config, directory, port), clock, sock)
            except BaseException:
                sock.close()
                raise
            started.append(server)
            return server

        yield start
        for server in started:
            await server.stop()


def _storage(backend: str, tmp_path: Path) -> Any:
    import contextlib

    @contextlib.asynccontextmanager
    async def sqlite() -> AsyncIterator[str]:
        yield f"sqlite:///{tmp_path / 'shared.db'}"

    @contextlib.asynccontextmanager
    async def postgresql() -> AsyncIterator[str]:
        url = await postgres_url_or_skip()
        async with fresh_schema(url) as schema:
            yield f"{url}?search_path={schema}"

    return sqlite() if backend == "sqlite" else postgresql()


@pytest.fixture
async def admin_server(start_admin_server: StartAdminServer) -> RunningAuthServer:
    return await start_admin_server()


async def admin_token(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    client_id: str = "admin-cli",
    secret: str = SECRET,
) -> str:
    status, body = await client_credentials(
        http, server, client_id=client_id, secret=secret, resource=api(server)
    )
    assert status == 200, body
    return str(body["access_token"])


def api(server: RunningAuthServer, path: str = "") -> str:
    return server.settings.issuer + "/admin/v1" + path


class Admin:
    """Calls to one server's admin API with one token."""

    def __init__(self, http: aiohttp.ClientSession, server: RunningAuthServer, token: str) -> None:
        self.http = http
        self.server = server
        self.token = token

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        params: Any = None,
        data: bytes | None = None,
        content_type: str | None = None,
    ) -> tuple[int, Any, aiohttp.ClientResponse]:
        sent = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        kwargs: dict[str, Any] = {"headers": sent, "params": params}
        if body is not None:
            import orjson

            kwargs["data"] = orjson.dumps(body)
            sent.setdefault("Content-Type", content_type or "application/json")
        elif data is not None:
            kwargs["data"] = data
            sent.setdefault("Content-Type", content_type or "application/json")
        async with self.http.request(method, api(self.server, path), **kwargs) as response:
            text = await response.read()
            import orjson

            parsed = orjson.loads(text) if text else None
            return response.status, parsed, response

    async def get(self, path: str, **kw: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
        return await self.call("GET", path, **kw)

    async def post(
        self, path: str, body: Any = None, **kw: Any
    ) -> tuple[int, Any, aiohttp.ClientResponse]:
        return await self.call("POST", path, body if body is not None else {}, **kw)

    async def patch(
        self, path: str, body: Any, **kw: Any
    ) -> tuple[int, Any, aiohttp.ClientResponse]:
        return await self.call(
            "PATCH", path, body, content_type="application/merge-patch+json", **kw
        )

    async def put(self, path: str, body: Any, **kw: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
        return await self.call("PUT", path, body, **kw)

    async def delete(self, path: str, **kw: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
        return await self.call("DELETE", path, **kw)


async def admin_for(
    http: aiohttp.ClientSession, server: RunningAuthServer, client_id: str = "admin-cli"
) -> Admin:
    return Admin(http, server, await admin_token(http, server, client_id))
