"""Dynamic client registration (RFC 7591) and its management (RFC 7592), over real HTTP: a
public client registers with no setup and then runs the code flow with the consent, PKCE and
exact redirect rules of every client; what it may not register is refused with nothing
stored; confidential registration needs the initial access token; the registration access
token reads and deletes; a client that never obtains a token expires; registrations are
throttled per address; the admin API lists them and can delete them."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import pytest

from authserver.store.base import MANAGED_BY_DYNAMIC
from tests.authserver.admin_support import (
    Admin,
    StartAdminServer,
    admin_token,
    start_admin_server,
)
from tests.authserver.conftest import (
    PASSWORD,
    SECRET,
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

__all__ = ["start_admin_server"]  # a fixture

MCP = "https://mcp.example.com/mcp"
TOOLS = "mcp:tools"
INITIAL_TOKEN = "initial-access-token-0123456789abcdef"
NATIVE = {
    "client_name": "An MCP agent",
    "application_type": "native",
    "redirect_uris": ["http://127.0.0.1/callback"],
    "token_endpoint_auth_method": "none",
    "grant_types": ["authorization_code", "refresh_token"],
    "response_types": ["code"],
}


def registration_config(**registration: Any) -> dict[str, Any]:
    config = default_config()
    config["scopes"].append({"name": TOOLS, "description": "Use your tools"})
    config["resources"] = [{"uri": MCP, "name": "Tools", "scopes": [TOOLS]}]
    config["registration"] = {"enabled": True, **registration}
    return config


@pytest.fixture
async def server(start_authserver: StartAuthServer) -> RunningAuthServer:
    return await start_authserver(registration_config(initial_access_token=INITIAL_TOKEN))


async def register(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    async with http.post(server.endpoint("/register"), json=body, headers=headers) as response:
        return response.status, await response.json(), response


async def stored_client_ids(server: RunningAuthServer) -> list[str]:
    return [c.client_id for c in await server.services.store.list_clients()]


async def code_flow(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    client_id: str,
    redirect_uri: str,
    *,
    scope: str = f"openid offline_access {TOOLS}",
    resource: str | None = MCP,
) -> dict[str, Any]:
    """Authorize (login and consent forms posted as a browser would), then the code's
    exchange; the token response."""
    verifier, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "scope": scope,
        "state": "st",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    if resource is not None:
        params["resource"] = resource
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
    assert response.status in (302, 303), await response.text()
    query = query_of(response.headers["Location"])
    assert query["iss"] == server.settings.issuer
    # A client that registered itself is asked about like any other: the consent page.
    assert any('value="approve"' in page for page in pages)
    data = {
        "grant_type": "authorization_code",
        "code": query["code"],
        "redirect_uri": redirect_uri,
        "code_verifier": verifier,
        "client_id": client_id,
    }
    if resource is not None:
        data["resource"] = resource
    status, body, _ = await post_token(http, server, data)
    assert status == 200, body
    return body


# ---------------------------------------------------------------------------- discovery


async def test_registration_is_advertised_only_when_enabled(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(registration_config())
    async with http.get(server.endpoint("/.well-known/oauth-authorization-server")) as response:
        meta = await response.json()
    assert meta["registration_endpoint"] == server.endpoint("/register")
    closed = await start_authserver(default_config())
    async with http.get(closed.endpoint("/.well-known/oauth-authorization-server")) as response:
        assert "registration_endpoint" not in await response.json()
    status, _, _ = await register(http, closed, NATIVE)
    assert status == 404
    assert await stored_client_ids(closed) == sorted(
        c["client_id"] for c in default_config()["clients"]
    )


# ---------------------------------------------------------------------------- registering


async def test_a_native_public_client_registers_and_runs_the_code_flow_on_any_loopback_port(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await register(http, server, NATIVE)
    assert status == 201, body
    assert response.headers["Cache-Control"] == "no-store"
    client_id = body["client_id"]
    assert not client_id.startswith("https://")
    assert body["registration_client_uri"] == server.endpoint(f"/register/{client_id}")
    assert response.headers["Location"] == body["registration_client_uri"]
    assert len(body["registration_access_token"]) >= 32
    assert "client_secret" not in body
    assert body["token_endpoint_auth_method"] == "none"
    assert body["redirect_uris"] == NATIVE["redirect_uris"]
    assert body["response_types"] == ["code"]
    # Offered to clients that register themselves: OpenID Connect's and the resources'.
    assert set(body["scope"].split()) == {
        "openid",
        "profile",
        "email",
        "address",
        "phone",
        "offline_access",
        TOOLS,
    }
    record = await server.services.store.get_client(client_id)
    assert record is not None and record.managed_by == MANAGED_BY_DYNAMIC
    # The token is kept only as a digest.
    assert record.registration_token_sha256 is not None
    assert body["registration_access_token"].encode() not in repr(record).encode()

    # RFC 8252 §7.3: the port is the one the app opened when it runs.
    tokens = await code_flow(http, server, client_id, "http://127.0.0.1:51234/callback")
    claims = await verify_jwt(http, server, tokens["access_token"], audience=MCP)
    assert claims["client_id"] == client_id
    # It obtained a token: it is kept from now on.
    kept = await server.services.store.get_client(client_id)
    assert kept is not None and kept.unused_until is None


async def test_a_registered_web_client_has_its_redirect_uri_matched_exactly(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    web = {**NATIVE, "application_type": "web", "redirect_uris": ["https://app.example.com/cb"]}
    status, body, _ = await register(http, server, web)
    assert status == 201, body
    _, challenge = pkce_pair()
    for redirect in ("https://app.example.com/cb/", "https://app.example.com/other"):
        params = {
            "response_type": "code",
            "client_id": body["client_id"],
            "redirect_uri": redirect,
            "scope": "openid",
            "state": "s",
            "code_challenge": challenge,
            "code_challenge_method": "S256",
        }
        async with http.get(
            server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
        ) as response:
            assert response.status == 400  # a page, never a redirect to an unknown URI
            assert "not registered" in await response.text()
    # And PKCE, as for every public client.
    params.update(redirect_uri="https://app.example.com/cb")
    del params["code_challenge"], params["code_challenge_method"]
    async with http.get(
        server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
    ) as response:
        assert query_of(response.headers["Location"])["error"] == "invalid_request"


async def test_scopes_beyond_what_registered_clients_are_offered_are_dropped(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    asked = {
        **NATIVE,
        "scope": f"openid {TOOLS} orders:read roles admin:write",
        # Nothing a client sends makes it first-party, a resource server or an audience.
        "skip_consent": True,
        "introspection": True,
        "resources": ["https://admin.example.com"],
        "client_id": "chosen-by-me",
        "logo_uri": "https://example.com/logo.png",
    }
    status, body, _ = await register(http, server, asked)
    assert status == 201, body
    assert body["scope"] == f"openid {TOOLS}"
    assert body["client_id"] != "chosen-by-me"
    record = await server.services.store.get_client(body["client_id"])
    assert record is not None
    assert record.metadata["skip_consent"] is False
    assert record.metadata["introspection"] is False
    assert record.metadata["resources"] == []
    status, body, _ = await register(http, server, {**NATIVE, "scope": "roles admin:read"})
    assert (status, body["error"]) == (400, "invalid_client_metadata")


WEB = {"application_type": "web"}
REDIRECT_REFUSED = "invalid_redirect_uri"
METADATA_REFUSED = "invalid_client_metadata"
REFUSED = {
    "web-http": ({**WEB, "redirect_uris": ["http://127.0.0.1/cb"]}, REDIRECT_REFUSED),
    "native-localhost": ({"redirect_uris": ["http://localhost:8080/cb"]}, REDIRECT_REFUSED),
    "native-https": ({"redirect_uris": ["https://app.example.com/cb"]}, REDIRECT_REFUSED),
    "native-scheme-without-dot": ({"redirect_uris": ["myapp:/cb"]}, REDIRECT_REFUSED),
    "wildcard": ({**WEB, "redirect_uris": ["https://*.example.com/cb"]}, REDIRECT_REFUSED),
    "fragment": ({**WEB, "redirect_uris": ["https://app.example.com/cb#x"]}, REDIRECT_REFUSED),
    "userinfo": ({**WEB, "redirect_uris": ["https://u:p@app.example.com/cb"]}, REDIRECT_REFUSED),
    "no-redirect": ({"redirect_uris": []}, REDIRECT_REFUSED),
    "not-a-list": ({"redirect_uris": "http://127.0.0.1/cb"}, METADATA_REFUSED),
    "secret-without-token": (
        {"token_endpoint_auth_method": "client_secret_basic"},
        METADATA_REFUSED,
    ),
    # RFC 7591 §2: without a method, client_secret_basic, which needs the initial token.
    "default-method-without-token": ({"token_endpoint_auth_method": None}, METADATA_REFUSED),
    "jwks-uri": (
        {"token_endpoint_auth_method": "private_key_jwt", "jwks_uri": "https://x/jwks"},
        METADATA_REFUSED,
    ),
    "response-type": ({"response_types": ["token"]}, METADATA_REFUSED),
    "grant-type": ({"grant_types": ["implicit"]}, METADATA_REFUSED),
    "client-credentials-public": ({"grant_types": ["client_credentials"]}, METADATA_REFUSED),
    "application-type": ({"application_type": "desktop"}, METADATA_REFUSED),
}


async def test_a_client_registered_for_less_may_ask_later_for_any_scope_offered(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    """Step-up: a client that registered itself with the scope of a first challenge is
    challenged for more later, keeps its registration and asks again; what it may ask for
    is what clients that register themselves are offered, and consent decides."""
    status, body, _ = await register(http, server, {**NATIVE, "scope": "openid"})
    assert status == 201, body
    assert body["scope"] == "openid"  # registered as asked
    tokens = await code_flow(
        http, server, body["client_id"], "http://127.0.0.1:51234/callback", scope=TOOLS
    )
    claims = await verify_jwt(http, server, tokens["access_token"], audience=MCP)
    assert claims["scope"] == TOOLS
    # Never beyond what is offered: `roles` is a configured client's scope only.
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": body["client_id"],
        "redirect_uri": "http://127.0.0.1:51234/callback",
        "scope": f"{TOOLS} roles",
        "state": "st",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    response = await http.get(
        server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
    )
    assert query_of(response.headers["Location"])["error"] == "invalid_scope"


@pytest.mark.parametrize(("changes", "error"), REFUSED.values(), ids=REFUSED)
async def test_what_a_client_may_not_register_is_refused_and_nothing_is_stored(
    server: RunningAuthServer, http: aiohttp.ClientSession, changes: dict[str, Any], error: str
) -> None:
    before = await stored_client_ids(server)
    body = {k: v for k, v in {**NATIVE, **changes}.items() if v is not None}
    status, answer, response = await register(http, server, body)
    assert (status, answer["error"]) == (400, error), answer
    assert answer["error_description"]
    assert response.headers["Cache-Control"] == "no-store"
    assert await stored_client_ids(server) == before


async def test_a_body_that_is_not_a_json_object_is_refused(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    for data, content_type in (
        (b"not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'{"redirect_uris": []}', "application/x-www-form-urlencoded"),
    ):
        async with http.post(
            server.endpoint("/register"), data=data, headers={"Content-Type": content_type}
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"] == "invalid_client_metadata"


async def test_a_confidential_client_registers_only_with_the_initial_access_token(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    machine = {
        "client_name": "Agent backend",
        "grant_types": ["client_credentials"],
        "token_endpoint_auth_method": "client_secret_basic",
        "scope": TOOLS,
    }
    status, body, response = await register(
        http, server, machine, {"Authorization": "Bearer wrong-token"}
    )
    assert (status, body["error"]) == (401, "invalid_token")
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = await register(
        http, server, machine, {"Authorization": f"Bearer {INITIAL_TOKEN}"}
    )
    assert status == 201, body
    assert body["client_secret_expires_at"] == 0
    status, tokens, _ = await post_token(
        http,
        server,
        {"grant_type": "client_credentials", "resource": MCP},
        auth=(body["client_id"], body["client_secret"]),
    )
    assert status == 200, tokens
    claims = await verify_jwt(http, server, tokens["access_token"], audience=MCP)
    assert claims["scope"] == TOOLS


# ---------------------------------------------------------------------------- RFC 7592


async def test_the_registration_access_token_reads_and_deletes_the_registration(
    server: RunningAuthServer, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    status, body, _ = await register(http, server, NATIVE)
    assert status == 201
    uri, token = body["registration_client_uri"], body["registration_access_token"]
    tokens = await code_flow(http, server, body["client_id"], "http://127.0.0.1/callback")
    for wrong in ("Bearer " + token[:-1] + "x", "Basic abc", None):
        headers = {"Authorization": wrong} if wrong else {}
        async with http.get(uri, headers=headers) as response:
            assert response.status == 401
    # Another client's token reads nothing either.
    _, other, _ = await register(http, server, NATIVE)
    bearer = {"Authorization": f"Bearer {other['registration_access_token']}"}
    async with http.get(uri, headers=bearer) as response:
        assert response.status == 401
    bearer = {"Authorization": f"Bearer {token}"}
    async with http.get(uri, headers=bearer) as response:
        assert response.status == 200
        read = await response.json()
    assert read["client_id"] == body["client_id"]
    assert read["redirect_uris"] == NATIVE["redirect_uris"]
    assert "registration_access_token" not in read
    async with http.put(uri, headers=bearer, json=NATIVE) as response:
        assert response.status == 405
    async with http.delete(uri, headers=bearer) as response:
        assert response.status == 204
    assert await server.services.store.get_client(body["client_id"]) is None
    # Its tokens end with it; its registration is unknown from now on.
    assert (await introspect(http, server, tokens["access_token"]))["active"] is False
    async with http.get(uri, headers=bearer) as response:
        assert response.status == 401
    async with http.delete(uri, headers=bearer) as response:
        assert response.status == 401
    # The access log names the client once its registration access token proved it, and
    # only then; the token itself is never written.
    await asyncio.sleep(0.3)  # past the access log's flush interval
    written = capsys.readouterr().err
    assert token not in written
    lines = [json.loads(line) for line in written.splitlines() if line.startswith("{")]
    registered = [
        (line["method"], line["status"], line["client_id"])
        for line in lines
        if line.get("route") == "registered_client"
    ]
    assert ("GET", 200, body["client_id"]) in registered
    assert ("DELETE", 204, body["client_id"]) in registered
    assert all(client_id is None for _, status, client_id in registered if status == 401)


async def test_a_client_that_obtains_no_token_in_time_is_gone_and_one_that_did_is_kept(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    server = await start_authserver(registration_config(unused_client_lifetime="1h"), clock=clock)
    _, idle, _ = await register(http, server, NATIVE)
    _, busy, _ = await register(http, server, NATIVE)
    await code_flow(http, server, busy["client_id"], "http://127.0.0.1/callback")
    clock.advance(3601)
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": idle["client_id"],
        "redirect_uri": "http://127.0.0.1/callback",
        "scope": "openid",
        "state": "s",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    async with http.get(server.endpoint("/authorize?" + urlencode(params))) as response:
        assert response.status == 400
        assert "not registered" in await response.text()
    async with http.get(
        idle["registration_client_uri"],
        headers={"Authorization": f"Bearer {idle['registration_access_token']}"},
    ) as response:
        assert response.status == 401
    assert await server.services.store.purge_expired(clock()) >= 1
    ids = await stored_client_ids(server)
    assert idle["client_id"] not in ids and busy["client_id"] in ids


async def test_registrations_from_one_address_are_throttled(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(registration_config(rate="2/m"))
    for _ in range(2):
        status, _, _ = await register(http, server, NATIVE)
        assert status == 201
    before = await stored_client_ids(server)
    status, body, response = await register(http, server, NATIVE)
    assert status == 429
    assert int(response.headers["Retry-After"]) >= 1
    assert body["error"] == "too_many_requests"
    assert await stored_client_ids(server) == before


# ---------------------------------------------------------------------------- admin API


async def test_the_admin_api_lists_registered_clients_and_can_only_delete_them(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    def enable(config: dict[str, Any]) -> None:
        config["registration"] = {"enabled": True}

    server = await start_admin_server(enable)
    status, body, _ = await register(http, server, NATIVE)
    assert status == 201, body
    client_id = body["client_id"]
    tokens = await code_flow(
        http, server, client_id, "http://127.0.0.1/callback", scope="openid", resource=None
    )
    admin = Admin(http, server, await admin_token(http, server))
    status, page, _ = await admin.get("/clients", params={"managedBy": "dynamic"})
    assert status == 200
    assert [c["clientId"] for c in page["data"]] == [client_id]
    shown = page["data"][0]
    assert (shown["managedBy"], shown["clientName"]) == ("dynamic", NATIVE["client_name"])
    status, error, _ = await admin.patch(f"/clients/{client_id}", {"clientName": "Renamed"})
    assert (status, error["error"]["code"]) == (409, "managed_by_registration")
    status, _, _ = await admin.call("DELETE", f"/clients/{client_id}")
    assert status == 204
    assert (await introspect(http, server, tokens["access_token"]))["active"] is False
    status, _, _ = await admin.get(f"/clients/{client_id}")
    assert status == 404


def test_the_initial_access_token_must_be_long(tmp_path: Any) -> None:
    from portcullis.yamlconf import ConfigError
    from tests.authserver.conftest import load_settings

    with pytest.raises(ConfigError, match="at least 32"):
        load_settings(registration_config(initial_access_token="short"), tmp_path, 9000)
    with pytest.raises(ConfigError, match="whole number"):
        load_settings(registration_config(rate="0.5/s"), tmp_path, 9000)
    assert SECRET  # the configured clients keep their own secrets
