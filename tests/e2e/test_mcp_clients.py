"""Official MCP clients, unmodified, against the example MCP server (examples/mcp) behind the
gateway, with tokens from the authorization server: the three started by `make mcp-demo`'s
script (examples/mcp/demo.sh) on reserved ports, and stopped as Ctrl-C stops them.

The Python SDK's client (`mcp.client.auth.OAuthClientProvider` on the Streamable HTTP
transport) is given the MCP server's URL and nothing else about the servers. From the
gateway's 401 it finds the protected resource metadata (RFC 9728), the authorization
server's metadata (RFC 8414), registers itself (RFC 7591), and runs the authorization code
flow with PKCE and the MCP server as `resource` (RFC 8707). The test is the user at the
browser: it opens the authorization URL the SDK hands its redirect handler, signs in as
alice, approves, and gives the redirect's `code`, `state` and `iss` to the SDK's callback
handler, as a client's local callback page would. Every HTTP exchange the SDK makes is
recorded, so the order of discovery is checked too. The TypeScript SDK's client
(`@modelcontextprotocol/sdk`, tests/e2e/mcp_ts_client/client.mjs, installed with `npm ci`
from the committed lock file) goes the same way, the user's part played over its stdio.

A tool whose scope the token lacks gets 403 insufficient_scope; what each SDK does next is
checked: the Python SDK steps up (the user approves again, and the call succeeds); this
TypeScript SDK refreshes and gives up.

Then each SDK is named by the URL of its Client ID Metadata Document instead (the Python
SDK's `client_metadata_url`, the TypeScript provider's `clientMetadataUrl`), against the demo
run with examples/mcp/authserver.yaml plus `client_id_metadata_documents` on: the documents
are served over TLS from loopback by tests/authserver/document_sites.py, whose origin and CA
the authorization server is given. Neither SDK registers; the admin API shows the document's
client and no client registered by RFC 7591.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urljoin, urlsplit

import aiohttp
import httpx2  # the MCP SDK's HTTP client
import pytest
import yaml
from mcp import Client
from mcp.client.auth import (
    AuthorizationCodeResult,
    OAuthClientProvider,
    OAuthRegistrationError,
)
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)
from pydantic import AnyUrl

from tests.authserver.conftest import basic_auth, parse_form, query_of
from tests.authserver.document_sites import ClientSite, client_site
from tests.support import UNBOUND_PORT, Background, reserve_port, service_missing

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "mcp" / "demo.sh"
TS_CLIENT_DIR = Path(__file__).resolve().parent / "mcp_ts_client"
TS_SDK = "@modelcontextprotocol/sdk"
PORT_VARIABLES = (
    "MCP_DEMO_GATEWAY_PORT",
    "MCP_DEMO_ADMIN_PORT",
    "MCP_DEMO_SERVER_PORT",
    "MCP_DEMO_AUTH_PORT",
    "MCP_DEMO_AUTH_ADMIN_PORT",
)
USERNAME, PASSWORD = "alice", "wonderland"  # examples/mcp/authserver.yaml's demo user
# The client's loopback redirect URI. Nothing listens there: the browser below never follows
# the redirect, it reads the Location.
REDIRECT = f"http://127.0.0.1:{UNBOUND_PORT}/callback"

pytestmark = pytest.mark.slow  # three programs started by the demo script


# ---------------------------------------------------------------------------- the demo


@dataclass
class McpDemo:
    """examples/mcp/demo.sh running, with what it printed so far."""

    process: subprocess.Popen[bytes]
    ports: dict[str, str]
    work: Path
    output: bytearray = field(default_factory=bytearray)

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['MCP_DEMO_GATEWAY_PORT']}"

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.ports['MCP_DEMO_AUTH_PORT']}"

    @property
    def mcp_url(self) -> str:
        return self.gateway + "/mcp"

    def read_until(self, marker: bytes, timeout: float) -> None:
        """Read what the script prints until `marker`; fail if it exits or takes longer."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while marker not in self.output:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the demo did not print {marker!r}:\n{self.logs()}")
            ready, _, _ = select.select([fd], [], [], left)
            chunk = os.read(fd, 65536) if ready else b""
            if ready and not chunk:
                raise AssertionError(f"the demo exited {self.process.wait()}:\n{self.logs()}")
            self.output += chunk

    def logs(self) -> str:
        parts = [self.output.decode(errors="replace")]
        for log in sorted(self.work.glob("*/*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)

    def interrupt(self, timeout: float = 20) -> int | None:
        """Ctrl-C: SIGINT to the script, which stops what it started; its exit status."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None


@contextlib.contextmanager
def running_demo(work: Path, **env: str) -> Iterator[McpDemo]:
    """`make mcp-demo`'s script on reserved ports (with `env` besides); its logs and state
    under `work`. Ctrl-C must stop it cleanly, whatever the tests found."""
    ports = {name: str(reserve_port()) for name in PORT_VARIABLES}
    full = {k: v for k, v in os.environ.items() if not k.startswith("MCP_DEMO_")}
    full.update(ports, MCP_DEMO_PYTHON=sys.executable, TMPDIR=str(work), **env)
    process = subprocess.Popen(
        ["bash", str(DEMO)],
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    running = McpDemo(process, ports, work)
    try:
        running.read_until(b"Press Ctrl-C", timeout=40)
        yield running
    finally:
        status = running.interrupt()
        assert status == 0, f"Ctrl-C did not stop the demo cleanly ({status}):\n{running.logs()}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpDemo]:
    """The demo as `make mcp-demo` runs it: examples/mcp's three configurations as they are."""
    with running_demo(tmp_path_factory.mktemp("mcp-demo")) as running:
        yield running


# ---------------------------------------------------------------------------- the user


class AuthorizationRefused(Exception):
    """The authorization server redirected back with an error instead of a code."""


class Browser:
    """alice at her browser, for the SDK's redirect and callback handlers: she opens the
    authorization URL, signs in (fields `username`, `password`), approves the consent page
    (`decision=approve`, with the page's CSRF field), and the redirect's parameters go back
    to the SDK."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.asked: list[dict[str, str]] = []  # the query of each authorization URL opened
        self.consent_pages: list[str] = []
        self.redirects: list[dict[str, str]] = []

    async def open(self, authorization_url: str) -> None:
        """The SDK's redirect handler."""
        self.asked.append(query_of(authorization_url))
        response = await self.session.get(authorization_url, allow_redirects=False)
        for _ in range(3):
            if response.status in (302, 303):
                self.redirects.append(query_of(response.headers["Location"]))
                return
            page = await response.text()
            assert response.status == 200, f"{response.status}: {page[:500]}"
            action, fields = parse_form(page)
            if urlsplit(action).path.endswith("/login"):
                fields.update(username=USERNAME, password=PASSWORD)
            else:
                self.consent_pages.append(page)
                fields["decision"] = "approve"
            response = await self.session.post(
                urljoin(str(response.url), action), data=fields, allow_redirects=False
            )
        raise AssertionError("the authorization did not end in a redirect")

    async def callback(self) -> AuthorizationCodeResult:
        """The SDK's callback handler: what the redirect carried."""
        query = self.redirects[-1]
        if "code" not in query:
            raise AuthorizationRefused(query)
        return AuthorizationCodeResult(code=query["code"], state=query["state"], iss=query["iss"])


class MemoryStorage:
    """The SDK's TokenStorage, in memory: one client's registration and tokens."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client_info: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


@dataclass(frozen=True)
class Exchange:
    method: str
    url: str  # without the query
    status: int
    challenge: str  # WWW-Authenticate, joined
    form: dict[str, str] = field(default_factory=dict)  # a form-encoded request's parameters


FORM = "application/x-www-form-urlencoded"


@dataclass
class Recorder:
    """Every response the SDK's HTTP client receives, its own OAuth requests included."""

    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, response: httpx2.Response) -> None:
        request = response.request
        form = {}
        if request.headers.get("Content-Type", "").startswith(FORM):
            form = dict(parse_qsl(request.content.decode()))
        self.exchanges.append(
            Exchange(
                request.method,
                str(request.url.copy_with(query=None)),
                response.status_code,
                ", ".join(response.headers.get_list("WWW-Authenticate")),
                form,
            )
        )


# What an MCP client on the user's machine registers: a public native app (no secret it
# could keep) receiving the redirect on a loopback port.
NATIVE_APP = OAuthClientMetadata(
    client_name="Portcullis end-to-end test (MCP Python SDK)",
    redirect_uris=[AnyUrl(REDIRECT)],
    token_endpoint_auth_method="none",
)


@contextlib.asynccontextmanager
async def connected(
    mcp_url: str,
    browser: Browser,
    recorder: Recorder,
    metadata: OAuthClientMetadata,
    client_metadata_url: str | None = None,
) -> AsyncIterator[tuple[Client, MemoryStorage]]:
    """The SDK's client connected to the MCP server at `mcp_url` (through the gateway): the
    provider on an httpx2 client, that client under the Streamable HTTP transport, as the SDK
    documents (docs/client/oauth-clients.md); with `client_metadata_url`, the URL of the
    client's metadata document, which the SDK uses as its client_id where the authorization
    server says it may."""
    storage = MemoryStorage()
    provider = OAuthClientProvider(
        server_url=mcp_url,
        client_metadata=metadata.model_copy(deep=True),
        storage=storage,
        redirect_handler=browser.open,
        callback_handler=browser.callback,
        client_metadata_url=client_metadata_url,
    )
    http = httpx2.AsyncClient(
        auth=provider, follow_redirects=True, event_hooks={"response": [recorder]}
    )
    async with http, Client(streamable_http_client(mcp_url, http_client=http)) as client:
        yield client, storage


def cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of `kind` in `exc`, its exception groups and its causes."""
    if isinstance(exc, kind):
        return exc
    inner: list[BaseException] = list(getattr(exc, "exceptions", ()))
    inner += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    for nested in inner:
        found = cause(nested, kind)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------- Python SDK


async def test_the_python_sdk_finds_registers_signs_in_and_calls_tools_as_the_user(
    demo: McpDemo,
) -> None:
    recorder = Recorder()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(session)
        async with connected(demo.mcp_url, browser, recorder, NATIVE_APP) as (client, storage):
            whoami = await client.call_tool("whoami", {})
            orders = await client.call_tool("list_orders", {})

    assert not whoami.is_error, whoami
    caller = whoami.structured_content
    assert caller is not None
    assert caller["subject"] == "alice"
    registered = storage.client_info
    assert registered is not None
    assert caller["clientId"] == registered.client_id
    assert "mcp:tools" in caller["scopes"]
    assert caller["tokenReceived"] is False  # no token passthrough
    assert not orders.is_error, orders
    assert orders.structured_content is not None
    # The orders of alice, in the MCP server for as long as the demo runs: other tests of
    # this module may delete some, never 1003.
    assert "1003" in [o["id"] for o in orders.structured_content["result"]]

    # Discovery, in the order the SDK went: a 401 naming the metadata and the scope; the
    # resource's metadata; the authorization server's; registration; (the browser's
    # authorization;) the token; the retried request.
    gw, auth = demo.gateway, demo.issuer
    first = recorder.exchanges[:6]
    assert [(e.method, e.url, e.status) for e in first] == [
        ("POST", f"{gw}/mcp", 401),
        ("GET", f"{gw}/.well-known/oauth-protected-resource/mcp", 200),
        ("GET", f"{auth}/.well-known/oauth-authorization-server", 200),
        ("POST", f"{auth}/register", 201),
        ("POST", f"{auth}/token", 200),
        ("POST", f"{gw}/mcp", 200),
    ], recorder.exchanges
    challenge = first[0].challenge
    assert f'resource_metadata="{gw}/.well-known/oauth-protected-resource/mcp"' in challenge
    assert 'scope="mcp:tools"' in challenge
    # The authorization request: PKCE S256, the MCP server as resource, the challenge's scope.
    (asked,) = browser.asked
    assert asked["code_challenge_method"] == "S256"
    assert asked["resource"] == demo.mcp_url
    assert "mcp:tools" in asked["scope"].split()
    assert "mcp:admin" not in asked["scope"].split()
    (consent,) = browser.consent_pages
    assert "Example orders MCP server" in consent
    # The registration: a public native client, with the scope the challenge named.
    assert registered.token_endpoint_auth_method == "none"
    assert "mcp:tools" in (registered.scope or "").split()


def assert_stepped_up(demo: McpDemo, recorder: Recorder, browser: Browser) -> None:
    """One 403 insufficient_scope naming mcp:admin, then a second authorization asking for
    what the first asked and mcp:admin (SEP-2350: the union, so no grant is lost)."""
    refused = [e for e in recorder.exchanges if e.status == 403]
    assert len(refused) == 1, recorder.exchanges
    assert refused[0].url == demo.mcp_url
    assert 'error="insufficient_scope"' in refused[0].challenge
    challenged = re.search(r'scope="([^"]*)"', refused[0].challenge)
    assert challenged is not None and "mcp:admin" in challenged.group(1).split()
    assert len(browser.asked) == 2, browser.asked
    first, again = (set(a["scope"].split()) for a in browser.asked)
    assert "mcp:admin" not in first
    assert again == first | set(challenged.group(1).split())
    assert browser.asked[1]["resource"] == demo.mcp_url


async def test_the_python_sdk_steps_up_to_a_tools_scope_when_the_gateway_asks_for_it(
    demo: McpDemo,
) -> None:
    """delete_order needs mcp:admin besides mcp:tools (the gateway's `mcp.calls`). The SDK,
    holding a token without it, gets 403 insufficient_scope naming mcp:admin, sends the user
    to authorize again with mcp:admin added, and retries the call with the new token."""
    recorder = Recorder()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(session)
        try:
            async with connected(demo.mcp_url, browser, recorder, NATIVE_APP) as (client, _):
                before = await client.call_tool("whoami", {})
                assert not before.is_error, before
                deleted = await client.call_tool("delete_order", {"order_id": "1001"})
                orders = await client.call_tool("list_orders", {})
        except BaseException as exc:
            refusal = cause(exc, AuthorizationRefused)
            if refusal is None:
                raise
            # Refused at the authorization server, after the SDK did its part.
            assert_stepped_up(demo, recorder, browser)
            assert browser.redirects[-1]["error"] == "invalid_scope", browser.redirects
            raise refusal from None
    assert_stepped_up(demo, recorder, browser)
    assert not deleted.is_error, deleted
    assert orders.structured_content is not None
    assert "1001" not in [o["id"] for o in orders.structured_content["result"]]


@pytest.mark.parametrize(
    ("redirect", "method", "refused_because"),
    [
        # The SDK's documentation (docs/client/oauth-clients.md) and example client register
        # http://localhost:3030/callback and leave token_endpoint_auth_method out.
        ("http://localhost:3030/callback", None, "initial access token"),
        (REDIRECT, None, "initial access token"),
        ("http://localhost:3030/callback", "none", "not localhost"),
    ],
    ids=["as-documented", "no-auth-method", "localhost"],
)
async def test_the_python_sdk_with_the_metadata_it_documents_is_refused_registration(
    demo: McpDemo, redirect: str, method: str | None, refused_because: str
) -> None:
    """The registration metadata the SDK's documentation shows is refused, by this
    server's registration rules: RFC 7591 §2 makes an omitted token_endpoint_auth_method
    client_secret_basic, a confidential client, which registers only with the initial
    access token; and a native client's redirect URI is on the loopback IP literal, never
    `localhost` (RFC 8252 §8.3). The refusal is a 400 saying so, which the SDK raises before
    any browser opens; NATIVE_APP above is what such a client registers instead."""
    metadata = OAuthClientMetadata(
        client_name="Bookshop Agent",
        redirect_uris=[AnyUrl(redirect)],
        token_endpoint_auth_method=method,  # type: ignore[arg-type]
    )
    recorder = Recorder()
    async with aiohttp.ClientSession() as session:
        browser = Browser(session)
        with pytest.raises(BaseException) as raised:  # examined below
            async with connected(demo.mcp_url, browser, recorder, metadata) as (client, _):
                await client.call_tool("whoami", {})
    error = cause(raised.value, OAuthRegistrationError)
    assert error is not None, raised.value
    assert refused_because in str(error)
    assert recorder.exchanges[-1].url == f"{demo.issuer}/register"
    assert recorder.exchanges[-1].status == 400
    assert browser.asked == []


# ---------------------------------------------------------------------------- metadata documents

AUTH_CONFIG = ROOT / "examples" / "mcp" / "authserver.yaml"
ADMIN_CLIENT, ADMIN_SECRET = "admin-reader", "mcp-e2e-admin-reader-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def document_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientSite]:
    """The MCP clients' web site, publishing their metadata documents over TLS on loopback
    (tests/authserver/document_sites.py), served from an event loop of its own thread so
    that it outlives each test's loop."""
    background = Background()
    site = client_site(tmp_path_factory.mktemp("client-site"))
    try:
        yield background.run(site.__aenter__())
    finally:
        background.run(site.__aexit__(None, None, None))
        background.close()


@pytest.fixture(scope="module")
def documents_demo(
    tmp_path_factory: pytest.TempPathFactory, document_site: ClientSite
) -> Iterator[McpDemo]:
    """The demo with Client ID Metadata Documents on: examples/mcp/authserver.yaml as it is,
    with `client_id_metadata_documents` enabled for the client site (its loopback origin
    allowed, its CA trusted), and a client that may read the admin API."""
    work = tmp_path_factory.mktemp("mcp-demo-documents")
    config = work / "authserver.yaml"
    added = {
        "client_id_metadata_documents": {"enabled": True, **document_site.allowed()},
        "clients": [
            {
                "client_id": ADMIN_CLIENT,
                "client_secret": ADMIN_SECRET,
                "grant_types": ["client_credentials"],
                "scope": "admin:read",
                "resources": ["http://127.0.0.1:${MCP_DEMO_AUTH_PORT}/admin/v1"],
            }
        ],
    }
    example = AUTH_CONFIG.read_text()
    assert not set(added) & set(yaml.safe_load(example)), "the example now sets these itself"
    config.write_text(example + "\n" + yaml.safe_dump(added, sort_keys=False))
    with running_demo(work, MCP_DEMO_AUTH_CONFIG=str(config)) as running:
        yield running


def publish_document(site: ClientSite, path: str, name: str) -> str:
    """A native MCP client's metadata document, redirected to on loopback; its URL."""
    return site.publish(path, client_name=name, client_uri=None, redirect_uris=[REDIRECT])


async def known_clients(session: aiohttp.ClientSession, demo: McpDemo) -> dict[str, str]:
    """clientId → managedBy of every client the authorization server knows, from its admin
    API."""
    admin = f"{demo.issuer}/admin/v1"
    async with session.post(
        f"{demo.issuer}/token",
        data={"grant_type": "client_credentials", "scope": "admin:read", "resource": admin},
        headers={"Authorization": basic_auth(ADMIN_CLIENT, ADMIN_SECRET)},
    ) as response:
        tokens = await response.json()
        assert response.status == 200, tokens
    async with session.get(
        f"{admin}/clients",
        params={"limit": "100", "fields": "clientId,managedBy"},
        headers={"Authorization": f"Bearer {tokens['access_token']}"},
    ) as response:
        listed = await response.json()
        assert response.status == 200, listed
    assert listed["pagination"]["hasMore"] is False
    return {c["clientId"]: c["managedBy"] for c in listed["data"]}


def assert_signed_in_by_document(
    demo: McpDemo, browser: Browser, document: str, name: str, caller: dict[str, Any]
) -> None:
    """One authorization, with the document's URL as client_id and the MCP server as
    resource; a consent page naming the document's host and the name it gives; a tool that
    sees alice and that client."""
    (asked,) = browser.asked
    assert asked["client_id"] == document
    assert asked["redirect_uri"] == REDIRECT
    assert asked["resource"] == demo.mcp_url
    assert asked["code_challenge_method"] == "S256"
    assert "mcp:tools" in asked["scope"].split()
    (consent,) = browser.consent_pages
    host = urlsplit(document).netloc
    assert f'<strong class="document-host">{host}</strong>' in consent
    assert f"<strong>{name}</strong>" in consent
    assert "Example orders MCP server" in consent
    assert caller["subject"] == "alice"
    assert caller["clientId"] == document
    assert "mcp:tools" in caller["scopes"]
    assert caller["tokenReceived"] is False


async def test_the_python_sdk_named_by_its_metadata_document_signs_in_and_calls_tools(
    documents_demo: McpDemo, document_site: ClientSite
) -> None:
    """Given the URL of its metadata document (`client_metadata_url`), the SDK uses it as
    its client_id because the authorization server's metadata says
    client_id_metadata_document_supported, and registers nothing: the authorization server
    fetches the document when the user is sent to it."""
    name = "Portcullis end-to-end test (MCP Python SDK, by its document)"
    document = publish_document(document_site, "/python-sdk.json", name)
    recorder = Recorder()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(session)
        async with connected(documents_demo.mcp_url, browser, recorder, NATIVE_APP, document) as (
            client,
            storage,
        ):
            whoami = await client.call_tool("whoami", {})
        clients = await known_clients(session, documents_demo)

    assert not whoami.is_error, whoami
    assert whoami.structured_content is not None
    assert_signed_in_by_document(documents_demo, browser, document, name, whoami.structured_content)
    assert storage.client_info is not None and storage.client_info.client_id == document

    # 401, the resource's metadata, the authorization server's (which advertises documents),
    # no registration, the token (for the MCP server as resource), the retried request.
    gw, auth = documents_demo.gateway, documents_demo.issuer
    first = recorder.exchanges[:5]
    assert [(e.method, e.url, e.status) for e in first] == [
        ("POST", f"{gw}/mcp", 401),
        ("GET", f"{gw}/.well-known/oauth-protected-resource/mcp", 200),
        ("GET", f"{auth}/.well-known/oauth-authorization-server", 200),
        ("POST", f"{auth}/token", 200),
        ("POST", f"{gw}/mcp", 200),
    ], recorder.exchanges
    assert not [e for e in recorder.exchanges if e.url.startswith(f"{auth}/register")]
    token_request = first[3].form
    assert token_request["grant_type"] == "authorization_code"
    assert token_request["client_id"] == document
    assert token_request["resource"] == documents_demo.mcp_url
    assert "client_secret" not in token_request
    # Fetched once by the authorization server, for the authorization and the token alike.
    assert document_site.hits["/python-sdk.json"] == 1
    # Nothing registered itself: besides the configured reader, the document's client only.
    assert clients == {ADMIN_CLIENT: "config", document: "metadata_document"}


# ---------------------------------------------------------------------------- TypeScript SDK


@pytest.fixture(scope="module")
def ts_client() -> Path:
    """tests/e2e/mcp_ts_client/client.mjs, the SDK installed with `npm ci` from the committed
    lock file when missing. Without node and npm the tests using it skip (fail under CI)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        service_missing("node and npm are needed for the MCP TypeScript SDK (Node.js 20 or later)")
    installed = TS_CLIENT_DIR / "node_modules" / TS_SDK / "package.json"
    lock = json.loads((TS_CLIENT_DIR / "package-lock.json").read_text())
    wanted = lock["packages"][f"node_modules/{TS_SDK}"]["version"]
    if not installed.exists() or json.loads(installed.read_text())["version"] != wanted:
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=TS_CLIENT_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            service_missing(f"npm ci of the MCP TypeScript SDK failed: {done.stderr[-500:]}")
    return TS_CLIENT_DIR / "client.mjs"


async def run_ts_client(
    script: Path,
    demo: McpDemo,
    browser: Browser,
    calls: list[dict[str, Any]],
    client_metadata_url: str | None = None,
) -> dict[str, Any]:
    """The script's last line, the user playing her part whenever it asks for her."""
    request = {
        "url": demo.mcp_url,
        "redirect": REDIRECT,
        "clientName": "Portcullis end-to-end test (MCP TypeScript SDK)",
        "calls": calls,
    }
    if client_metadata_url is not None:
        request["clientMetadataUrl"] = client_metadata_url
    process = await asyncio.create_subprocess_exec(
        "node",
        str(script),
        json.dumps(request),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
    )
    assert process.stdin is not None and process.stdout is not None

    async def converse() -> dict[str, Any]:
        assert process.stdin is not None and process.stdout is not None
        while line := await process.stdout.readline():
            message: dict[str, Any] = json.loads(line)
            if message.get("done"):
                return message
            await browser.open(message["authorize"])
            process.stdin.write(json.dumps(browser.redirects[-1]).encode() + b"\n")
            await process.stdin.drain()
        raise AssertionError("the client stopped without an answer")

    try:
        return await asyncio.wait_for(converse(), timeout=30)
    except BaseException:
        if process.returncode is None:
            process.kill()
        assert process.stderr is not None
        print((await process.stderr.read()).decode(errors="replace")[-3000:])
        raise
    finally:
        await process.wait()


async def test_the_typescript_sdk_finds_registers_signs_in_and_calls_tools_as_the_user(
    demo: McpDemo, ts_client: Path
) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(session)
        answer = await run_ts_client(
            ts_client,
            demo,
            browser,
            [
                {"name": "whoami"},
                {"name": "delete_order", "arguments": {"order_id": "1002"}},
                {"name": "list_orders"},
            ],
        )
    whoami, delete, orders = answer["results"]
    caller = whoami["result"]["structuredContent"]
    assert caller["subject"] == "alice"
    assert caller["clientId"] == answer["clientInformation"]["client_id"]
    assert caller["scopes"] == ["mcp:tools"]
    assert caller["tokenReceived"] is False
    registered = answer["clientInformation"]
    assert registered["token_endpoint_auth_method"] == "none"
    assert registered["scope"] == "mcp:tools"

    exchanges = [(e["method"], e["url"], e["status"]) for e in answer["exchanges"]]
    gw, auth = demo.gateway, demo.issuer
    assert exchanges[:4] == [
        ("POST", f"{gw}/mcp", 401),
        ("GET", f"{gw}/.well-known/oauth-protected-resource/mcp", 200),
        ("GET", f"{auth}/.well-known/oauth-authorization-server", 200),
        ("POST", f"{auth}/register", 201),
    ], exchanges
    (authorization,) = answer["authorizations"]
    asked = query_of(authorization)
    assert asked["code_challenge_method"] == "S256"
    assert asked["resource"] == demo.mcp_url
    assert asked["scope"] == "mcp:tools"

    # delete_order: 403 insufficient_scope naming mcp:admin (and mcp:tools, which the route
    # needs and the token has: asking for what a challenge names loses nothing). This SDK
    # version answers a 403
    # by refreshing its token when it holds a refresh token (the same scopes again) rather
    # than asking the user, meets the same 403, and gives up: the call fails, saying so,
    # and the session goes on.
    refused = [e for e in answer["exchanges"] if e["status"] == 403]
    assert len(refused) == 2, exchanges
    assert all('scope="mcp:admin mcp:tools"' in e["challenge"] for e in refused)
    assert all('error="insufficient_scope"' in e["challenge"] for e in refused)
    first_403 = exchanges.index(("POST", f"{gw}/mcp", 403))
    assert ("POST", f"{auth}/token", 200) in exchanges[first_403:]
    assert "403 after trying upscoping" in delete["error"]
    assert len(browser.asked) == 1  # the user was never asked for mcp:admin
    assert "1002" in [o["id"] for o in orders["result"]["structuredContent"]["result"]]


async def test_the_typescript_sdk_named_by_its_metadata_document_signs_in_and_calls_tools(
    documents_demo: McpDemo, document_site: ClientSite, ts_client: Path
) -> None:
    """The provider's `clientMetadataUrl`: used as the client_id, since the authorization
    server supports metadata documents, and nothing is registered."""
    name = "Portcullis end-to-end test (MCP TypeScript SDK, by its document)"
    document = publish_document(document_site, "/typescript-sdk.json", name)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(session)
        answer = await run_ts_client(
            ts_client, documents_demo, browser, [{"name": "whoami"}], document
        )
        clients = await known_clients(session, documents_demo)

    (whoami,) = answer["results"]
    assert "result" in whoami, whoami
    assert_signed_in_by_document(
        documents_demo, browser, document, name, whoami["result"]["structuredContent"]
    )
    assert answer["clientInformation"]["client_id"] == document
    assert query_of(answer["authorizations"][0])["client_id"] == document

    exchanges = answer["exchanges"]
    gw, auth = documents_demo.gateway, documents_demo.issuer
    # As without a document, but no registration; after the user's part, the SDK's
    # finishAuth discovers both documents again before it asks for the token.
    discovery = [
        ("GET", f"{gw}/.well-known/oauth-protected-resource/mcp", 200),
        ("GET", f"{auth}/.well-known/oauth-authorization-server", 200),
    ]
    assert [(e["method"], e["url"], e["status"]) for e in exchanges[:7]] == [
        ("POST", f"{gw}/mcp", 401),
        *discovery,
        *discovery,
        ("POST", f"{auth}/token", 200),
        ("POST", f"{gw}/mcp", 200),
    ], exchanges
    assert not [e for e in exchanges if e["url"].startswith(f"{auth}/register")]
    token_request = exchanges[5]["form"]
    assert token_request["grant_type"] == "authorization_code"
    assert token_request["client_id"] == document
    assert token_request["resource"] == documents_demo.mcp_url
    assert "client_secret" not in token_request
    assert document_site.hits["/typescript-sdk.json"] == 1
    # This module's other document client may be there too: none registered by RFC 7591.
    assert clients[document] == "metadata_document"
    assert set(clients.values()) <= {"config", "metadata_document"}, clients
