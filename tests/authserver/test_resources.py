"""Protected resources registered with the server (RFC 8707): any client may name one with
`resource` and gets it as `aud`, with the scopes the resource accepts and no others; an
unknown resource is `invalid_target`; a client's own `resources` still count; the consent
page names the resource. The rules themselves (protocol/resources.py) without a server."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import pytest

from authserver.protocol.errors import ErrorCode, OAuthError
from authserver.protocol.resources import (
    Audiences,
    ProtectedResource,
    Target,
    check_scopes,
    within,
)
from authserver.settings import ADMIN_API_PATH
from portcullis.yamlconf import ConfigError
from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    RunningAuthServer,
    StartAuthServer,
    authorize_code,
    client_credentials,
    default_config,
    exchange_code,
    load_settings,
    parse_form,
    pkce_pair,
    post_token,
    query_of,
    verify_jwt,
)

MCP = "https://mcp.example.com/mcp"
MCP_NAME = "Example MCP server"
TOOLS = "mcp:tools"


def resources_config() -> dict[str, Any]:
    config = default_config()
    config["scopes"].append({"name": TOOLS, "description": "Use your tools"})
    config["resources"] = [
        {"uri": MCP, "name": MCP_NAME, "scopes": [TOOLS]},
        {"uri": "https://orders.example.com/", "scopes": ["orders:read"]},
    ]
    for client in config["clients"]:
        if client["client_id"] in ("spa", "machine"):
            client["scope"] += f" {TOOLS}"
    return config


@pytest.fixture
async def server(start_authserver: StartAuthServer) -> RunningAuthServer:
    return await start_authserver(resources_config())


async def test_a_client_that_lists_no_resources_gets_a_registered_one_as_aud(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(
        http, server, scope=f"openid offline_access {TOOLS}", extra={"resource": MCP}
    )
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": str(result.verifier),
        "client_id": "spa",
        # MCP clients name the resource at the token endpoint too (RFC 8707 §2.2).
        "resource": MCP,
    }
    status, body, _ = await post_token(http, server, data)
    assert status == 200, body
    claims = await verify_jwt(http, server, body["access_token"], audience=MCP)
    assert claims["aud"] == MCP
    assert claims["scope"] == f"openid offline_access {TOOLS}"
    # The refresh keeps the family's one resource.
    status, refreshed, _ = await post_token(
        http,
        server,
        {
            "grant_type": "refresh_token",
            "refresh_token": body["refresh_token"],
            "client_id": "spa",
            "resource": MCP,
        },
    )
    assert status == 200, refreshed
    assert (await verify_jwt(http, server, refreshed["access_token"]))["aud"] == MCP


async def test_a_resource_neither_registered_nor_the_clients_own_is_invalid_target(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": "openid",
        "state": "s",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "resource": "https://unknown.example.com/mcp",
    }
    async with http.get(
        server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
    ) as response:
        assert response.status == 302
        query = query_of(response.headers["Location"])
    assert query["error"] == "invalid_target"
    assert query["iss"] == server.settings.issuer
    status, body = await client_credentials(http, server, resource=MCP + "/")
    assert (status, body["error"]) == (400, "invalid_target")


async def test_a_clients_own_resource_is_still_allowed_beside_the_registered_ones(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body = await client_credentials(http, server, resource="billing-api")
    assert status == 200, body
    claims = await verify_jwt(http, server, body["access_token"])
    assert claims["aud"] == "billing-api"
    # Not registered with the server: no scope rule of a registered resource applies.
    assert claims["scope"] == f"orders:read orders:write {TOOLS}"


async def test_a_machine_token_for_a_registered_resource_holds_only_the_scopes_it_accepts(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    # Without `scope`: the registered default (RFC 6749 §3.3) as far as the resource takes it.
    status, body = await client_credentials(http, server, resource=MCP)
    assert status == 200, body
    claims = await verify_jwt(http, server, body["access_token"], audience=MCP)
    assert claims["scope"] == TOOLS
    status, body = await client_credentials(
        http, server, resource=MCP, scope=f"{TOOLS} orders:write"
    )
    assert (status, body["error"]) == (400, "invalid_scope")


async def test_a_scope_the_registered_resource_does_not_accept_is_refused_at_authorize(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": f"openid {TOOLS} orders:read",
        "state": "s",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "resource": MCP,
    }
    async with http.get(
        server.endpoint("/authorize?" + urlencode(params)), allow_redirects=False
    ) as response:
        query = query_of(response.headers["Location"])
    assert query["error"] == "invalid_scope"


async def test_the_token_request_may_name_only_the_resource_the_code_was_authorized_for(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, server, scope=f"openid {TOOLS}", extra={"resource": MCP})
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": str(result.verifier),
        "client_id": "spa",
        "resource": "https://orders.example.com/",
    }
    status, body, _ = await post_token(http, server, data)
    assert (status, body["error"]) == (400, "invalid_target")
    # Refused before the code was consumed: its holder still redeems it.
    status, body = await exchange_code(http, server, result)
    assert status == 200, body
    assert (await verify_jwt(http, server, body["access_token"]))["aud"] == MCP


async def test_a_code_authorized_without_a_resource_cannot_be_widened_at_the_token_endpoint(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, server, scope=f"openid {TOOLS}")
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": str(result.verifier),
        "client_id": "spa",
        "resource": MCP,
    }
    status, body, _ = await post_token(http, server, data)
    assert (status, body["error"]) == (400, "invalid_target")


async def test_the_consent_page_names_the_resource_by_its_name_and_uri(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": f"openid {TOOLS}",
        "state": "s",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "resource": MCP,
    }
    async with http.get(server.endpoint("/authorize?" + urlencode(params))) as response:
        action, fields = parse_form(await response.text())
    fields.update(username="alice", password=PASSWORD)
    async with http.post(
        server.url + urlsplit(action).path, data=fields, allow_redirects=False
    ) as response:
        page = await response.text()
    assert response.status == 200
    assert f'<strong class="resource-name">{MCP_NAME}</strong>' in page
    assert f'<code class="resource-uri">{MCP}</code>' in page
    assert "Use your tools" in page


async def test_a_device_may_ask_for_a_registered_resource(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = resources_config()
    config["clients"].append(
        {
            "client_id": "tv",
            "token_endpoint_auth_method": "none",
            "grant_types": ["urn:ietf:params:oauth:grant-type:device_code"],
            "scope": f"openid {TOOLS}",
        }
    )
    server = await start_authserver(config)
    async with http.post(
        server.endpoint("/device_authorization"),
        data={"client_id": "tv", "scope": TOOLS, "resource": MCP},
    ) as response:
        assert response.status == 200, await response.text()
    async with http.post(
        server.endpoint("/device_authorization"),
        data={"client_id": "tv", "scope": "openid", "resource": "https://else.example/"},
    ) as response:
        assert response.status == 400
        assert (await response.json())["error"] == "invalid_target"


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("resource", "problem"),
    [
        ({"uri": "https://mcp.example.com/mcp#x", "scopes": []}, "fragment"),
        ({"uri": "mcp-server", "scopes": []}, "absolute URI"),
        ({"uri": MCP, "scopes": ["nope"]}, "'nope' is not in the scopes list"),
        ({"uri": MCP, "scopes": ["admin:write"]}, "admin API"),
        ({"uri": "http://127.0.0.1:{port}" + ADMIN_API_PATH}, "admin API's audience"),
    ],
    ids=["fragment", "relative", "unknown-scope", "admin-scope", "admin-audience"],
)
def test_a_resource_the_server_could_not_register_is_refused_at_load(
    tmp_path: Any, resource: dict[str, Any], problem: str
) -> None:
    config = default_config()
    port = 9000
    config["resources"] = [{**resource, "uri": resource["uri"].replace("{port}", str(port))}]
    with pytest.raises(ConfigError) as raised:
        load_settings(config, tmp_path, port)
    assert problem in str(raised.value), str(raised.value)


def test_a_resource_listed_twice_is_refused_and_a_name_defaults_to_the_uri(
    tmp_path: Any,
) -> None:
    config = default_config()
    config["resources"] = [{"uri": MCP}, {"uri": MCP}]
    with pytest.raises(ConfigError, match="listed twice"):
        load_settings(config, tmp_path, 9000)
    config["resources"] = [{"uri": MCP}]
    assert load_settings(config, tmp_path, 9000).resources[0].name == MCP


def test_the_admin_api_path_the_settings_guard_is_the_admin_apis() -> None:
    from authserver.admin.api import PREFIX

    assert ADMIN_API_PATH == PREFIX


# ---------------------------------------------------------------------------- the rules

TOOLS_SERVER = ProtectedResource(MCP, MCP_NAME, frozenset({TOOLS}))
AUDIENCES = Audiences("https://auth.example.com", [TOOLS_SERVER])


@pytest.mark.parametrize(
    ("resource", "own", "audience", "registered"),
    [
        (None, (), "https://auth.example.com", None),
        (MCP, (), MCP, TOOLS_SERVER),
        (MCP, (MCP,), MCP, TOOLS_SERVER),  # listed by both: the registered rule applies
        ("billing-api", ("billing-api",), "billing-api", None),
        ("https://auth.example.com", (), "https://auth.example.com", None),
    ],
)
def test_the_target_of_a_request(
    resource: str | None,
    own: tuple[str, ...],
    audience: str,
    registered: ProtectedResource | None,
) -> None:
    assert AUDIENCES.target(resource, own) == Target(audience, registered)


@pytest.mark.parametrize(
    "resource",
    [MCP + "/", "https://MCP.example.com/mcp", "billing-api", "", "https://mcp.example.com"],
)
def test_only_the_exact_uri_names_a_resource(resource: str) -> None:
    with pytest.raises(OAuthError) as raised:
        AUDIENCES.target(resource, ())
    assert raised.value.code is ErrorCode.INVALID_TARGET


def test_a_registered_resource_takes_its_scopes_and_the_openid_ones_only() -> None:
    target = AUDIENCES.target(MCP, ())
    check_scopes(target, [TOOLS, "openid", "profile", "email", "offline_access"])
    for refused in ("orders:read", "roles", "admin:read"):
        with pytest.raises(OAuthError) as raised:
            check_scopes(target, [TOOLS, refused])
        assert raised.value.code is ErrorCode.INVALID_SCOPE
    assert within(target, ["orders:read", TOOLS, "openid"]) == (TOOLS, "openid")
    # Another audience has no such rule.
    default = AUDIENCES.target(None, ())
    check_scopes(default, ["orders:read", "roles"])
    assert within(default, ["orders:read"]) == ("orders:read",)


def test_the_consent_page_shows_no_resource_for_the_default_audience() -> None:
    assert AUDIENCES.shown("https://auth.example.com") is None
    assert AUDIENCES.shown(MCP) == TOOLS_SERVER
    assert AUDIENCES.shown("billing-api") == ProtectedResource(
        "billing-api", "billing-api", frozenset()
    )
