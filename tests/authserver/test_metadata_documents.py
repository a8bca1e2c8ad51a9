"""Clients identified by the URL of their metadata document
(draft-ietf-oauth-client-id-metadata-document), over real HTTP: the document served over TLS
from loopback (a test CA the server is given as `ca_file`, the origin on the operator's
allow-list), the code flow of such a client with its consent page, caching within bounds,
every way a document is refused with nothing stored or kept, addresses refused before any
connection, host policies, blocking through the admin API, and the fetch outcomes counted.
Then the rules without a server: the special-use address table, document URLs, freshness
and what a document may say."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families

from authserver.metadata_documents import DocumentRefused, client_of_document, freshness
from authserver.protocol.client_ids import document_url, host_matches, names_document
from authserver.protocol.special_use import special_use
from authserver.store.base import MANAGED_BY_METADATA_DOCUMENT
from tests.authserver.admin_support import (
    Admin,
    StartAdminServer,
    admin_token,
    start_admin_server,
)
from tests.authserver.conftest import (
    PASSWORD,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    default_config,
    introspect,
    parse_form,
    pkce_pair,
    post_token,
    query_of,
    verify_jwt,
)
from tests.authserver.document_sites import CALLBACK, TOOLS, ClientSite, client_site

__all__ = ["start_admin_server"]  # a fixture

MCP = "https://mcp.example.com/mcp"


# ---------------------------------------------------------------------------- the client's site


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[ClientSite]:
    async with client_site(tmp_path) as running:
        yield running


def documents_config(site: ClientSite, **documents: Any) -> dict[str, Any]:
    config = default_config()
    config["scopes"].append({"name": TOOLS, "description": "Use your tools"})
    config["resources"] = [{"uri": MCP, "name": "Tools", "scopes": [TOOLS]}]
    config["client_id_metadata_documents"] = {
        "enabled": True,
        **site.allowed(),  # the draft's loopback exception, for development
        "timeout": "1s",
        **documents,
    }
    return config


@pytest.fixture
async def server(start_authserver: StartAuthServer, site: ClientSite) -> RunningAuthServer:
    return await start_authserver(documents_config(site))


def authorize_url(server: RunningAuthServer, client_id: str, redirect: str = CALLBACK) -> str:
    _, challenge = pkce_pair()
    return server.endpoint(
        "/authorize?"
        + urlencode(
            {
                "response_type": "code",
                "client_id": client_id,
                "redirect_uri": redirect,
                "scope": f"openid offline_access {TOOLS}",
                "state": "st",
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                "resource": MCP,
            }
        )
    )


async def code_flow(
    http: aiohttp.ClientSession, server: RunningAuthServer, client_id: str
) -> tuple[dict[str, Any], list[str]]:
    """Authorize, sign in, consent, exchange; the token response and the pages seen."""
    verifier, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": CALLBACK,
        "scope": f"openid offline_access {TOOLS}",
        "state": "st",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "resource": MCP,
    }
    response = await http.get(
        server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
    )
    pages = []
    while response.status == 200:
        text = await response.text()
        pages.append(text)
        action, fields = parse_form(text)
        if action.endswith("/login"):
            fields.update(username="alice", password=PASSWORD)
        else:
            fields["decision"] = "approve"
        response = await http.post(
            server.url + urlsplit(action).path, data=fields, allow_redirects=False
        )
    assert response.status in (302, 303), (response.status, await response.text())
    query = query_of(response.headers["Location"])
    status, body, _ = await post_token(
        http,
        server,
        {
            "grant_type": "authorization_code",
            "code": query["code"],
            "redirect_uri": CALLBACK,
            "code_verifier": verifier,
            "client_id": client_id,
            "resource": MCP,
        },
    )
    assert status == 200, body
    return body, pages


async def refused_page(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url, allow_redirects=False) as response:
        text = await response.text()
        assert response.status == 400, text[:500]
        assert "This sign-in request cannot be handled" in text
        return text


def fetch_counts(server: RunningAuthServer) -> dict[str, float]:
    exposition = server.services.token.metrics.exposition().decode()
    return {
        s.labels["result"]: s.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "portcullis_authserver_client_metadata_documents"
        for s in family.samples
    }


# ---------------------------------------------------------------------------- the flow


async def test_the_server_advertises_metadata_documents_only_when_enabled(
    start_authserver: StartAuthServer, server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(server.endpoint("/.well-known/oauth-authorization-server")) as response:
        assert (await response.json())["client_id_metadata_document_supported"] is True
    plain = await start_authserver(default_config())
    async with http.get(plain.endpoint("/.well-known/oauth-authorization-server")) as response:
        assert "client_id_metadata_document_supported" not in await response.json()
    # Off, a URL is a client_id like any other: unknown, and nothing is fetched.
    await refused_page(http, authorize_url(plain, "https://127.0.0.1:1/client.json"))


async def test_a_client_named_by_its_document_signs_a_user_in_and_gets_a_token_for_a_resource(
    server: RunningAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    client_id = site.publish()
    tokens, pages = await code_flow(http, server, client_id)
    claims = await verify_jwt(http, server, tokens["access_token"], audience=MCP)
    assert claims["client_id"] == client_id
    assert claims["scope"] == f"openid offline_access {TOOLS}"
    consent = next(page for page in pages if 'value="approve"' in page)
    host = client_id.removeprefix("https://").removesuffix("/client.json")
    # The login page already says where the name it shows comes from.
    assert f'described at <strong class="document-host">{host}</strong>' in pages[0]
    # The document's host first, then the name as the document gives it, the redirect
    # host, and the warning that only this machine is redirected to.
    assert f'<strong class="document-host">{host}</strong>' in consent
    assert "<strong>Agent Smith</strong>" in consent
    assert '<strong class="redirect-host">127.0.0.1:7777</strong>' in consent
    assert "Any program running there could claim to be it" in consent
    # Stored, for the admin API and the other endpoints; fetched once for all of it.
    record = await server.services.store.get_client(client_id)
    assert record is not None and record.managed_by == MANAGED_BY_METADATA_DOCUMENT
    assert site.hits == {"/client.json": 1}
    # The refresh token works on the client as stored.
    status, refreshed, _ = await post_token(
        http,
        server,
        {
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": client_id,
        },
    )
    assert status == 200, refreshed
    assert fetch_counts(server) == {"fetched": 1}


async def test_redirect_uris_are_matched_exactly_against_the_document(
    server: RunningAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    client_id = site.publish(application_type="native")
    for other in (
        "http://127.0.0.1:7778/callback",
        CALLBACK + "/",
        "http://localhost:7777/callback",
    ):
        text = await refused_page(http, authorize_url(server, client_id, other))
        assert "not registered" in text


async def test_the_document_is_kept_as_its_cache_control_says_within_the_bounds(
    start_authserver: StartAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    server = await start_authserver(
        documents_config(site, cache_min="1m", cache_max="10m"), clock=clock
    )
    client_id = site.publish()
    site.cache_control = "max-age=86400"  # more than cache_max: kept 10 minutes
    async with http.get(authorize_url(server, client_id)) as response:
        assert response.status == 200
    clock.advance(9 * 60)
    async with http.get(authorize_url(server, client_id)) as response:
        assert response.status == 200
    assert site.hits["/client.json"] == 1
    clock.advance(61)
    site.cache_control = "no-store"  # less than cache_min: kept a minute
    async with http.get(authorize_url(server, client_id)) as response:
        assert response.status == 200
    assert site.hits["/client.json"] == 2
    clock.advance(59)
    async with http.get(authorize_url(server, client_id)) as response:
        assert response.status == 200
    assert site.hits["/client.json"] == 2
    clock.advance(2)
    async with http.get(authorize_url(server, client_id)) as response:
        assert response.status == 200
    assert site.hits["/client.json"] == 3


# ---------------------------------------------------------------------------- refusals


async def _slow(site: ClientSite) -> web.Response:
    await site.stalled.wait()
    return web.Response(status=500)


def _refusals(site: ClientSite) -> dict[str, tuple[Callable[[], str], str, str]]:
    """Each bad document: how it is published (the client_id), what the page says, and the
    outcome counted."""

    def behaving(path: str, behaviour: Callable[[web.Request], Any]) -> Callable[[], str]:
        def publish() -> str:
            site.behaviours[path] = behaviour
            return site.url(path)

        return publish

    return {
        "too-large": (
            lambda: site.publish("/big.json", client_name="x" * 6000),
            "larger than 5120 bytes",
            "too_large",
        ),
        "slow": (behaving("/slow.json", lambda _: _slow(site)), "did not arrive", "timeout"),
        "not-json": (
            behaving("/text.json", lambda _: web.Response(text="{}", content_type="text/plain")),
            "is not JSON",
            "not_json",
        ),
        "malformed-json": (
            behaving(
                "/broken.json", lambda _: web.Response(text="{", content_type="application/json")
            ),
            "is not JSON",
            "not_json",
        ),
        "not-an-object": (
            behaving("/list.json", lambda _: web.json_response([site.url("/list.json")])),
            "is not a JSON object",
            "invalid",
        ),
        "other-client-id": (
            lambda: site.publish("/other.json", client_id=site.url("/other.json") + "?x"),
            "another client_id",
            "invalid",
        ),
        "shared-secret": (
            lambda: site.publish("/secret.json", token_endpoint_auth_method="client_secret_basic"),
            "shared secret",
            "invalid",
        ),
        "client-secret": (
            lambda: site.publish("/with-secret.json", client_secret="s" * 40),
            "client_secret",
            "invalid",
        ),
        "jwks-uri": (
            lambda: site.publish(
                "/jwks-uri.json",
                token_endpoint_auth_method="private_key_jwt",
                jwks_uri="https://agent.example/jwks",
            ),
            "jwks_uri",
            "invalid",
        ),
        "no-redirect-uris": (
            lambda: site.publish("/no-redirects.json", redirect_uris=None),
            "no redirect_uris",
            "invalid",
        ),
        "bad-redirect-uri": (
            lambda: site.publish("/http.json", redirect_uris=["http://agent.example/cb"]),
            "not valid",
            "invalid",
        ),
        "redirect": (
            behaving(
                "/moved.json",
                lambda _: web.Response(status=302, headers={"Location": site.url()}),
            ),
            "redirects elsewhere",
            "redirect",
        ),
        "not-found": (lambda: site.url("/missing.json"), "HTTP 404", "status"),
    }


REFUSALS = (
    "too-large",
    "slow",
    "not-json",
    "malformed-json",
    "not-an-object",
    "other-client-id",
    "shared-secret",
    "client-secret",
    "jwks-uri",
    "no-redirect-uris",
    "bad-redirect-uri",
    "redirect",
    "not-found",
)


@pytest.mark.parametrize("case", REFUSALS)
async def test_a_bad_document_is_refused_with_a_clear_page_and_nothing_stored_or_kept(
    server: RunningAuthServer, site: ClientSite, http: aiohttp.ClientSession, case: str
) -> None:
    site.publish()  # the valid one at /client.json, which a redirect points to
    publish, says, result = _refusals(site)[case]
    client_id = publish()
    text = await refused_page(http, authorize_url(server, client_id))
    assert says in text, text[:2000]
    assert await server.services.store.get_client(client_id) is None
    assert fetch_counts(server) == {result: 1}
    # Never followed: the document a redirect points to was not fetched.
    assert "/client.json" not in site.hits
    # Not kept either: the next request fetches again, and a fixed document is taken.
    path = urlsplit(client_id).path
    site.behaviours.pop(path, None)
    site.publish(path)
    async with http.get(authorize_url(server, client_id)) as response:
        assert response.status == 200, (await response.text())[:500]
    assert site.hits[path] == 2


async def test_a_client_known_before_keeps_working_at_the_token_endpoint_while_its_site_fails(
    start_authserver: StartAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    server = await start_authserver(documents_config(site), clock=clock)
    client_id = site.publish()
    tokens, _ = await code_flow(http, server, client_id)
    site.behaviours["/client.json"] = lambda _: web.Response(status=503)
    clock.advance(86400 + 1)  # past cache_max: fetched again, and failing
    status, refreshed, _ = await post_token(
        http,
        server,
        {
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": client_id,
        },
    )
    assert status == 200, refreshed
    # A new authorization is refused until the document can be read again.
    text = await refused_page(http, authorize_url(server, client_id))
    assert "HTTP 503" in text


# ---------------------------------------------------------------------------- SSRF


@pytest.fixture
def listener_on_127_0_0_2() -> Any:
    """A socket listening on 127.0.0.2, to prove nothing connected to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def accepted_nothing(sock: socket.socket) -> bool:
    try:
        connection, _ = sock.accept()
    except BlockingIOError:
        return True
    connection.close()
    return False


async def test_a_loopback_address_not_on_the_allow_list_is_refused_before_any_connection(
    server: RunningAuthServer, http: aiohttp.ClientSession, listener_on_127_0_0_2: socket.socket
) -> None:
    port = listener_on_127_0_0_2.getsockname()[1]
    text = await refused_page(http, authorize_url(server, f"https://127.0.0.2:{port}/client.json"))
    assert "does not fetch from" in text
    assert accepted_nothing(listener_on_127_0_0_2)
    assert fetch_counts(server) == {"address_refused": 1}


async def test_a_name_resolving_to_loopback_is_refused_before_any_connection(
    server: RunningAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    # localhost resolves to 127.0.0.1 (and ::1): the site's own address, but the allow-list
    # names the origin https://127.0.0.1:PORT, not https://localhost:PORT.
    port = urlsplit(site.base).port
    site.publish()
    for client_id in (
        f"https://localhost:{port}/client.json",
        f"https://0.0.0.0:{port}/client.json",
        f"https://[::1]:{port}/client.json",
        f"https://[::ffff:127.0.0.1]:{port}/client.json",
    ):
        text = await refused_page(http, authorize_url(server, client_id))
        assert "does not fetch from" in text, client_id
    assert site.hits == {}
    assert fetch_counts(server) == {"address_refused": 4}


async def test_a_denied_host_is_refused_before_it_is_looked_up(
    start_authserver: StartAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(
        documents_config(
            site,
            hosts=[
                {"pattern": "*.example.com", "policy": "allow"},
                {"pattern": "127.0.0.1", "policy": "deny"},
            ],
        )
    )
    client_id = site.publish()
    text = await refused_page(http, authorize_url(server, client_id))
    assert "are not accepted here" in text
    assert site.hits == {}
    assert fetch_counts(server) == {"host_denied": 1}


@pytest.mark.parametrize(
    "client_id",
    [
        "https://agent.example",
        "https://agent.example/",
        "https://agent.example/a/../client.json",
        "https://agent.example/./client.json",
        "https://agent.example/%2e%2e/client.json",
        "https://user:pass@agent.example/client.json",
        "https://agent.example/client.json#frag",
    ],
)
async def test_a_client_id_that_is_no_document_url_is_refused_without_a_fetch(
    server: RunningAuthServer, http: aiohttp.ClientSession, client_id: str
) -> None:
    text = await refused_page(http, authorize_url(server, client_id))
    assert "client_id" in text
    assert fetch_counts(server) == {}


# ---------------------------------------------------------------------------- admin API


async def test_the_admin_api_lists_document_clients_and_blocks_one(
    start_admin_server: StartAdminServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    def with_documents(config: dict[str, Any]) -> None:
        extra = documents_config(site)
        for key in ("client_id_metadata_documents", "resources"):
            config[key] = extra[key]
        config["scopes"].append({"name": TOOLS})

    server = await start_admin_server(with_documents)
    client_id = site.publish()
    tokens, _ = await code_flow(http, server, client_id)
    admin = Admin(http, server, await admin_token(http, server))
    status, page, _ = await admin.get("/clients", params={"managedBy": "metadata_document"})
    assert status == 200
    assert [(c["clientId"], c["clientName"], c["blocked"]) for c in page["data"]] == [
        (client_id, "Agent Smith", False)
    ]
    path = "/clients/" + client_id.replace("/", "%2F").replace(":", "%3A")
    status, error, _ = await admin.patch(path, {"clientName": "Renamed"})
    assert (status, error["error"]["code"]) == (409, "managed_by_metadata_document")
    status, shown, _ = await admin.patch(path, {"blocked": True})
    assert (status, shown["blocked"]) == (200, True), shown
    # Refused wherever it is named, nothing fetched for it; what it obtained ends.
    hits = dict(site.hits)
    text = await refused_page(http, authorize_url(server, client_id))
    assert "blocked" in text
    assert site.hits == hits
    assert (await introspect(http, server, tokens["access_token"]))["active"] is False
    status, body, _ = await post_token(
        http,
        server,
        {
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": client_id,
        },
    )
    assert status in (400, 401), body
    status, shown, _ = await admin.patch(path, {"blocked": False})
    assert (status, shown["blocked"]) == (200, False)
    async with http.get(authorize_url(server, client_id), allow_redirects=False) as response:
        # Alice is still signed in, and her consent was kept: the code at once.
        assert response.status == 302
        assert "code" in query_of(response.headers["Location"])


# ---------------------------------------------------------------------------- the rules

SPECIAL = [
    "127.0.0.1", "127.255.255.254", "0.0.0.0", "0.1.2.3", "10.0.0.1", "10.255.255.255",
    "172.16.0.1", "172.31.255.255", "192.168.0.1", "100.64.0.1", "100.127.255.255",
    "169.254.169.254", "169.254.0.1", "192.0.0.1", "192.0.2.10", "198.18.0.1", "198.19.255.1",
    "198.51.100.7", "203.0.113.9", "192.88.99.1", "224.0.0.251", "239.255.255.250",
    "255.255.255.255", "240.0.0.1", "::", "::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
    "::ffff:169.254.169.254", "::ffff:8.8.8.8", "::127.0.0.1", "fe80::1", "fe80::1%1",
    "fc00::1", "fd00:ec2::254", "ff02::1", "ff05::2", "2001:db8::1", "2002:c0a8:101::1",
    "2001::1", "64:ff9b::a00:1", "64:ff9b:1::1", "100::1", "fec0::1", "3fff::1",
]  # fmt: skip
PUBLIC = [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "172.32.0.1", "100.128.0.1", "11.0.0.1",
    "192.169.0.1", "2606:4700:4700::1111", "2a00:1450:4001:82a::200e", "2620:fe::fe",
]  # fmt: skip


@pytest.mark.parametrize("address", SPECIAL)
def test_a_special_use_address_is_never_connected_to(address: str) -> None:
    assert special_use(address) is not None
    assert special_use(ipaddress.ip_address(address.split("%")[0])) is not None


@pytest.mark.parametrize("address", PUBLIC)
def test_a_global_address_may_be_connected_to(address: str) -> None:
    assert special_use(address) is None


def test_mapped_addresses_are_named_with_what_they_carry() -> None:
    assert special_use("::ffff:169.254.169.254") == (
        "IPv4-mapped (RFC 4291) of 169.254.169.254, cloud instance metadata (link-local)"
    )
    assert special_use("localhost") == "not an IP address"


def test_document_urls_follow_the_draft() -> None:
    target = document_url("https://Agent.Example:8443/oauth/client.json?v=1")
    assert (target.host, target.port, target.origin) == (
        "agent.example",
        8443,
        "https://agent.example:8443",
    )
    assert document_url("https://[::1]/c.json").shown_host == "[::1]"
    assert names_document("https://x/y") and not names_document("http://x/y")
    for bad in (
        "http://agent.example/c.json",
        "https://agent.example/c json",
        "https://agent.example:0x/c",
    ):
        with pytest.raises(ValueError):
            document_url(bad)


def test_host_patterns() -> None:
    assert host_matches("*", "anything.example")
    assert host_matches("*.example.com", "a.b.example.com")
    assert not host_matches("*.example.com", "example.com")
    assert not host_matches("*.example.com", "badexample.com")
    assert host_matches("Agent.Example", "agent.example")


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"Cache-Control": "public, max-age=300"}, 300.0),
        ({"Cache-Control": "no-store"}, 0.0),
        ({"Cache-Control": "max-age=60, no-cache"}, 0.0),
        (
            {"Expires": "Thu, 01 Jan 2026 00:10:00 GMT", "Date": "Thu, 01 Jan 2026 00:00:00 GMT"},
            600.0,
        ),
        ({"Expires": "0"}, 0.0),
        ({}, None),
    ],
)
def test_freshness_is_read_from_cache_control_then_expires(
    headers: dict[str, str], seconds: float | None
) -> None:
    assert freshness(CIMultiDictProxy(CIMultiDict(headers))) == seconds


def test_a_document_describes_a_public_client_with_only_what_it_may_say() -> None:
    target = document_url("https://agent.example/client.json")
    offered = frozenset({"openid", TOOLS})
    document = {
        "client_id": target.url,
        "client_name": "Agent",
        "redirect_uris": ["https://agent.example/cb"],
        "scope": f"openid {TOOLS} admin:write",
        "skip_consent": True,
        "introspection": True,
        "resources": ["https://elsewhere"],
    }
    record = client_of_document(target, document, offered, 1.0)
    assert record.client_id == target.url
    assert record.secret_sha256 is None
    assert record.metadata["scope"] == f"openid {TOOLS}"
    assert (record.metadata["skip_consent"], record.metadata["introspection"]) == (False, False)
    assert record.metadata["resources"] == []
    assert record.metadata["token_endpoint_auth_method"] == "none"
    for change in (
        {"client_id": target.url + "/"},
        {"client_id": "https://AGENT.example/client.json"},
        {"token_endpoint_auth_method": "client_secret_post"},
        {"token_endpoint_auth_method": "private_key_jwt"},  # without jwks
        {"grant_types": ["client_credentials"]},
        {"response_types": ["code", "token"]},
        {"client_name": 5},
    ):
        with pytest.raises(DocumentRefused) as refused:
            client_of_document(target, {**document, **change}, offered, 1.0)
        assert refused.value.result == "invalid", change
    json.dumps(record.metadata)  # stored as JSON


async def test_a_document_that_changes_its_keys_cuts_off_what_the_old_one_obtained(
    start_authserver: StartAuthServer, site: ClientSite, http: aiohttp.ClientSession
) -> None:
    from tests.authserver.conftest import client_public_jwks

    clock = MovableClock()
    server = await start_authserver(documents_config(site), clock=clock)
    client_id = site.publish()
    tokens, _ = await code_flow(http, server, client_id)
    assert (await introspect(http, server, tokens["access_token"]))["active"] is True
    site.publish(token_endpoint_auth_method="private_key_jwt", jwks=client_public_jwks())
    clock.advance(86400 + 1)
    async with http.get(authorize_url(server, client_id), allow_redirects=False) as response:
        assert response.status in (200, 302)
    record = await server.services.store.get_client(client_id)
    assert record is not None
    assert record.metadata["token_endpoint_auth_method"] == "private_key_jwt"
    assert (await introspect(http, server, tokens["access_token"]))["active"] is False
