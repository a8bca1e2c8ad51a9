"""Fixtures for the example clients: the authorization server's own fixtures, and the rest of
the demo's stack — the gateway in front of an echo upstream — on real sockets; and a page in
Debian's Chromium for the browser tests.

`stack` starts an authorization server with the demo's clients (`demo-machine`, `demo-web`
and a few more), a gateway trusting it, and an EchoUpstream behind the gateway. The web
client's port is chosen first, because its redirect URI is registered with it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from examples import legacy_api, spa
from examples.web_client import Config, create_app
from examples.web_client.app import STATE
from examples.web_client.sessions import Session
from tests.authserver.conftest import (
    PASSWORD_HASH,
    SECRET,
    RunningAuthServer,
    StartAuthServer,
    http,
    key_root,
    start_authserver,
)
from tests.support import (
    EchoUpstream,
    RunningGateway,
    bound_socket,
    gateway_yaml,
    start_gateway,
    start_site,
)

__all__ = [
    "RunningWebApp",
    "Stack",
    "demo_clients_config",
    "http",
    "key_root",
    "page",
    "run_web_app",
    "spa_stack",
    "stack",
    "start_authserver",
    "web_app",
]

# Reserved characters in both the id's and the secret's alphabet: RFC 6749 §2.3.1 has them
# form-encoded inside HTTP Basic, and the server decodes them so.
ODD_CLIENT_ID = "odd:client"
ODD_SECRET = "p@ss:word+with/reserved%chars and spaces"
WEB_SECRET = "web-client-secret:with+reserved/chars%20"
EVIL_NAME = '<script>alert("owned")</script> & <b>friends</b>'


def demo_clients_config(web_port: int) -> dict[str, Any]:
    """The demo's users and clients, with a quick password hash for tests."""
    web_base = f"http://127.0.0.1:{web_port}"
    return {
        "default_audience": "orders-api",
        "scopes": [
            {"name": "orders:read", "description": "Read your orders"},
            {"name": "orders:write", "description": "Change your orders"},
        ],
        "users": [
            {
                "username": "alice",
                "password_hash": PASSWORD_HASH,
                "email": "alice@example.com",
                "email_verified": True,
                "name": "Alice Liddell",
            },
            {"username": "mallory", "password_hash": PASSWORD_HASH, "name": EVIL_NAME},
        ],
        "clients": [
            {
                "client_id": "demo-machine",
                "client_secret": SECRET,
                "grant_types": ["client_credentials"],
                "scope": "orders:read orders:write",
            },
            {
                "client_id": ODD_CLIENT_ID,
                "client_secret": ODD_SECRET,
                "grant_types": ["client_credentials"],
                "scope": "orders:read",
            },
            {
                "client_id": "demo-web",
                "client_name": "Demo web app",
                "client_secret": WEB_SECRET,
                "token_endpoint_auth_method": "client_secret_basic",
                "redirect_uris": [f"{web_base}/callback"],
                "post_logout_redirect_uris": [f"{web_base}/signed-out"],
                "grant_types": ["authorization_code", "refresh_token"],
                "scope": "openid profile email offline_access orders:read orders:write",
            },
            {
                "client_id": "resource-server",
                "client_secret": SECRET,
                "grant_types": ["client_credentials"],
                "scope": "",
                "introspection": True,
            },
        ],
    }


@dataclass
class Stack:
    auth: RunningAuthServer
    gateway: RunningGateway
    upstream: EchoUpstream
    web_port: int
    web_socket: socket.socket  # bound to web_port, for the web app to serve

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"


# A route only orders:write opens, for a GET the machine client can make.
EXTRA_ROUTES = """
  - {name: reports, path: "/reports/**", methods: [GET], scopes: {all: ["orders:write"]}}
"""


@pytest.fixture
async def stack(start_authserver: StartAuthServer) -> AsyncIterator[Stack]:
    web_socket = bound_socket()  # the web app's, whose redirect URI names its port
    web_port = web_socket.getsockname()[1]
    auth = await start_authserver(demo_clients_config(web_port))
    upstream = await EchoUpstream().start()
    gateway = await start_gateway(gateway_yaml(auth.url, upstream.url, EXTRA_ROUTES))
    yield Stack(auth, gateway, upstream, web_port, web_socket)
    web_socket.close()
    await gateway.stop()
    await upstream.stop()


@dataclass
class RunningWebApp:
    app: web.Application
    url: str

    def session(self, cookie: str | None) -> Session:
        """The server-side session a cookie value names."""
        session = self.app[STATE].sessions.get(cookie)
        assert session is not None, "no such session"
        return session


async def run_web_app(config: Config, sock: socket.socket) -> tuple[RunningWebApp, Any]:
    app = create_app(config)
    runner, url = await start_site(app, sock=sock)
    return RunningWebApp(app, url), runner


@pytest.fixture
async def web_app(stack: Stack) -> AsyncIterator[RunningWebApp]:
    """The example web app as the demo runs it: registered as demo-web, calling the gateway."""
    config = Config(
        issuer=stack.auth.settings.issuer,
        client_id="demo-web",
        client_secret=WEB_SECRET,
        api=stack.gateway.url,
        base_url=stack.web_url,
    )
    running, runner = await run_web_app(config, stack.web_socket)
    yield running
    await runner.cleanup()


# ---------------------------------------------------------------------------- the SPA

ROOT = Path(__file__).resolve().parents[2]
SPA_ACCESS_TOKEN_LIFETIME = 6  # seconds: the browser test waits for expiry twice


@dataclass
class SpaStack:
    """`make demo`'s configs, run here: the authorization server and the gateway read
    config/authserver.yaml and config/gateway.yaml (ports from the DEMO_* variables, access
    tokens that live SPA_ACCESS_TOKEN_LIFETIME seconds), the orders API behind the gateway,
    and the single-page app. `api_requests` lists what reached the API: (method, path)."""

    auth: RunningAuthServer
    gateway: RunningGateway
    spa_url: str
    api_requests: list[tuple[str, str]]


def demo_authserver_config() -> dict[str, Any]:
    """config/authserver.yaml less what the test fixture fills in (issuer, listen, storage,
    key directory), with short-lived access tokens."""
    config = yaml.safe_load((ROOT / "config" / "authserver.yaml").read_text())
    for name in ("issuer", "listen", "storage"):
        del config[name]
    del config["keys"]["dir"]
    config["lifetimes"]["access_token"] = f"{SPA_ACCESS_TOKEN_LIFETIME}s"
    return dict(config)


@pytest.fixture
async def spa_stack(
    start_authserver: StartAuthServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[SpaStack]:
    # Bound first: the demo configuration names their ports.
    spa_socket, api_socket = bound_socket(), bound_socket()
    spa_port, api_port = spa_socket.getsockname()[1], api_socket.getsockname()[1]
    for name, port in (("DEMO_SPA_PORT", spa_port), ("DEMO_API_PORT", api_port)):
        monkeypatch.setenv(name, str(port))
    auth = await start_authserver(demo_authserver_config())
    monkeypatch.setenv("DEMO_AUTH_PORT", str(auth.port))

    api_requests: list[tuple[str, str]] = []

    async def record(request: web.Request, _: web.StreamResponse) -> None:
        api_requests.append((request.method, request.path))

    api = legacy_api.create_app()
    api.on_response_prepare.append(record)
    api_runner, _ = await start_site(api, sock=api_socket)
    gateway = await start_gateway((ROOT / "config" / "gateway.yaml").read_text())
    spa_config = spa.Config(
        issuer=auth.settings.issuer,
        client_id="demo-spa",
        api=gateway.url,
        base_url=f"http://127.0.0.1:{spa_port}",
    )
    spa_runner, spa_url = await start_site(spa.create_app(spa_config), sock=spa_socket)
    yield SpaStack(auth, gateway, spa_url, api_requests)
    await spa_runner.cleanup()
    await gateway.stop()
    await api_runner.cleanup()


# ---------------------------------------------------------------------------- the browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def browser_missing(reason: str) -> None:
    """Skip with the reason, except on CI where a missing browser is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the browser tests must run)")
    pytest.skip(reason)


@pytest.fixture
async def page() -> AsyncIterator[tuple[Any, list[str]]]:
    """A fresh browser page, and the console messages about blocked content it logs."""
    if not Path(CHROMIUM).exists():
        browser_missing(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        browser_missing("the playwright package is not installed (pip install playwright)")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = await browser.new_context()
        tab = await context.new_page()
        tab.set_default_timeout(10_000)
        blocked: list[str] = []
        tab.on(
            "console",
            lambda message: (
                blocked.append(message.text)
                if "Content Security Policy" in message.text or "Refused" in message.text
                else None
            ),
        )
        yield tab, blocked
        await context.close()
        await browser.close()
