"""CORS at the authorization server, over real HTTP: which pages may read which answers.

A browser client (public, application_type web) may read its token, revocation and device
authorization answers from the origins of its own redirect URIs and the configured extra
ones, never from another client's; userinfo answers any browser client's origin; discovery
and JWKS answer every origin with `*`; introspection and the pages answer none. The policy's
pure parts (origin serialization, the client a form names) are tested without a server at
the end.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from authserver.protocol.cors import browser_client, origin
from tests.authserver.conftest import (
    REDIRECT,
    SECRET,
    RunningAuthServer,
    StartAuthServer,
    authorize_code,
    basic_auth,
    default_config,
    tokens_for,
)

SPA_ORIGIN = "http://127.0.0.1"  # the origin of REDIRECT, the spa client's redirect URI
OTHER_ORIGIN = "https://other.example"  # another browser client's
EXTRA_ORIGIN = "https://tv.example"  # listed in cors.allow_origins
EVIL_ORIGIN = "https://evil.example"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


def cors_config() -> dict[str, Any]:
    config = default_config()
    config["clients"] += [
        {
            "client_id": "other-spa",
            "token_endpoint_auth_method": "none",
            "redirect_uris": [OTHER_ORIGIN + "/callback"],
            "grant_types": ["authorization_code", "refresh_token"],
            "scope": "openid orders:read",
        },
        {
            # A browser app on a television: the device grant, no redirect URIs, so its
            # pages' origin is known only from the explicit list.
            "client_id": "tv",
            "token_endpoint_auth_method": "none",
            "grant_types": [DEVICE_GRANT],
            "scope": "openid orders:read",
        },
    ]
    config["cors"] = {"allow_origins": [EXTRA_ORIGIN.upper()]}
    return config


@pytest.fixture
async def server(start_authserver: StartAuthServer) -> RunningAuthServer:
    return await start_authserver(cors_config())


async def post(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    path: str,
    data: dict[str, str] | list[tuple[str, str]],
    page: str | None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, aiohttp.ClientResponse]:
    all_headers = {**({"Origin": page} if page else {}), **(headers or {})}
    async with http.post(server.endpoint(path), data=data, headers=all_headers) as response:
        body = await response.json() if response.content_type == "application/json" else None
        return response.status, body, response


async def preflight(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    path: str,
    page: str,
    method: str,
    request_headers: str | None = None,
) -> aiohttp.ClientResponse:
    headers = {"Origin": page, "Access-Control-Request-Method": method}
    if request_headers is not None:
        headers["Access-Control-Request-Headers"] = request_headers
    async with http.options(server.endpoint(path), headers=headers) as response:
        await response.read()
        return response


def assert_readable_by(response: aiohttp.ClientResponse, page: str) -> None:
    assert response.headers.get("Access-Control-Allow-Origin") == page
    assert "Origin" in response.headers.get("Vary", "")
    # Browser clients send no credentials a browser would attach by itself.
    assert "Access-Control-Allow-Credentials" not in response.headers


def assert_no_cors(response: aiohttp.ClientResponse) -> None:
    found = [name for name in response.headers if name.lower().startswith("access-control-")]
    assert found == [], found


def refresh_form(token: str, client_id: str = "spa") -> dict[str, str]:
    return {"grant_type": "refresh_token", "refresh_token": token, "client_id": client_id}


# ---------------------------------------------------------------------------- token, revoke


async def test_a_browser_clients_page_reads_its_token_answers_errors_included(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    code = await authorize_code(http, server)
    form = {
        "grant_type": "authorization_code",
        "code": code.code,
        "redirect_uri": REDIRECT,
        "code_verifier": code.verifier or "",
        "client_id": "spa",
    }
    status, tokens, response = await post(http, server, "/token", form, SPA_ORIGIN)
    assert status == 200, tokens
    assert_readable_by(response, SPA_ORIGIN)
    assert response.headers["Cache-Control"] == "no-store"

    status, refreshed, response = await post(
        http, server, "/token", refresh_form(tokens["refresh_token"]), SPA_ORIGIN
    )
    assert status == 200 and refreshed["access_token"] != tokens["access_token"]
    assert_readable_by(response, SPA_ORIGIN)

    # The page must read invalid_grant to know it has to sign in again.
    status, body, response = await post(
        http, server, "/token", refresh_form("not-a-refresh-token"), SPA_ORIGIN
    )
    assert (status, body["error"]) == (400, "invalid_grant")
    assert_readable_by(response, SPA_ORIGIN)


async def test_a_browser_clients_page_revokes_its_refresh_token_and_reads_the_answer(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    tokens = await tokens_for(http, server)
    form = {"token": tokens["refresh_token"], "client_id": "spa"}
    status, _, response = await post(http, server, "/revoke", form, SPA_ORIGIN)
    assert status == 200
    assert_readable_by(response, SPA_ORIGIN)
    status, body, _ = await post(
        http, server, "/token", refresh_form(tokens["refresh_token"]), None
    )
    assert (status, body["error"]) == (400, "invalid_grant")  # the revocation happened


async def test_a_page_on_another_browser_clients_origin_cannot_read_answers_for_this_client(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    # other.example is a browser origin (other-spa's), but not spa's: a page there may act as
    # other-spa only.
    tokens = await tokens_for(http, server)
    status, body, response = await post(
        http, server, "/token", refresh_form(tokens["refresh_token"]), OTHER_ORIGIN
    )
    assert status == 200, body  # CORS decides what the page may read, not what happens
    assert_no_cors(response)
    assert response.headers["Vary"] == "Origin"
    status, _, response = await post(
        http, server, "/revoke", {"token": body["refresh_token"], "client_id": "spa"}, OTHER_ORIGIN
    )
    assert status == 200
    assert_no_cors(response)

    # Its own client's answers it reads.
    status, body, response = await post(
        http, server, "/token", refresh_form("unknown", "other-spa"), OTHER_ORIGIN
    )
    assert (status, body["error"]) == (400, "invalid_grant")
    assert_readable_by(response, OTHER_ORIGIN)


async def test_confidential_and_native_clients_get_no_cors_even_from_a_browser_origin(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    machine = {"grant_type": "client_credentials", "scope": "orders:read"}
    basic = {"Authorization": basic_auth("machine", SECRET)}
    status, _, response = await post(http, server, "/token", machine, SPA_ORIGIN, basic)
    assert status == 200
    assert_no_cors(response)
    posted = {**machine, "client_id": "machine-post", "client_secret": SECRET}
    status, _, response = await post(http, server, "/token", posted, SPA_ORIGIN)
    assert status == 200
    assert_no_cors(response)
    # desktop is public but native: its loopback redirect shares spa's origin, yet no page
    # is it.
    status, _, response = await post(
        http, server, "/token", refresh_form("unknown", "desktop"), SPA_ORIGIN
    )
    assert status == 400
    assert_no_cors(response)
    # spa's client_id alongside a credential is no browser client's request.
    status, _, response = await post(
        http, server, "/token", refresh_form("unknown"), SPA_ORIGIN, basic
    )
    assert status in (400, 401)
    assert_no_cors(response)
    # Nor is a client_id given twice.
    status, _, response = await post(
        http,
        server,
        "/token",
        [*refresh_form("unknown").items(), ("client_id", "spa")],
        SPA_ORIGIN,
    )
    assert status == 400
    assert_no_cors(response)


async def test_a_disallowed_origin_gets_no_cors_header_anywhere(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    tokens = await tokens_for(http, server)
    for page in (EVIL_ORIGIN, "null", SPA_ORIGIN + ":8080", "https://127.0.0.1"):
        status, _, response = await post(http, server, "/token", refresh_form("x"), page)
        assert status == 400
        assert_no_cors(response)
        status, _, response = await post(
            http, server, "/revoke", {"token": "x", "client_id": "spa"}, page
        )
        assert status == 200
        assert_no_cors(response)
        async with http.get(
            server.endpoint("/userinfo"),
            headers={"Origin": page, "Authorization": f"Bearer {tokens['access_token']}"},
        ) as response:
            assert response.status == 200
            assert_no_cors(response)
        for path, method, asked in (
            ("/token", "POST", "content-type"),
            ("/revoke", "POST", None),
            ("/userinfo", "GET", "authorization"),
            ("/device_authorization", "POST", None),
        ):
            refused = await preflight(http, server, path, page, method, asked)
            assert refused.status == 403, (page, path)
            assert_no_cors(refused)
    async with http.options(
        server.endpoint("/token"),
        headers={"Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST"},
    ) as response:
        assert (await response.json()) == {
            "error": "cors_refused",
            "error_description": "Not allowed: the origin is not allowed.",
        }


# ---------------------------------------------------------------------------- preflights


async def test_preflights_from_a_browser_origin_are_answered_with_what_each_endpoint_allows(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    response = await preflight(http, server, "/token", SPA_ORIGIN, "POST", "Content-Type")
    assert response.status == 204
    assert {k: v for k, v in response.headers.items() if k.startswith("Access-Control-")} == {
        "Access-Control-Allow-Origin": SPA_ORIGIN,
        "Access-Control-Allow-Methods": "POST",
        "Access-Control-Allow-Headers": "Content-Type, DPoP",
        "Access-Control-Max-Age": "600",
    }
    assert response.headers["Vary"] == (
        "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
    )
    for path in ("/revoke", "/device_authorization"):
        response = await preflight(http, server, path, OTHER_ORIGIN, "POST")
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == OTHER_ORIGIN

    for method in ("GET", "POST"):
        response = await preflight(
            http, server, "/userinfo", EXTRA_ORIGIN, method, "authorization, content-type"
        )
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == EXTRA_ORIGIN
        assert response.headers["Access-Control-Allow-Methods"] == "GET, POST"
        assert (
            response.headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type, DPoP"
        )
        assert "Access-Control-Allow-Credentials" not in response.headers

    # What an endpoint does not take is refused, with no CORS header.
    for path, method, asked in (
        ("/token", "PUT", None),
        ("/token", "POST", "authorization"),  # browser clients send no credentials
        ("/token", "POST", "content-type, x-requested-with"),
        ("/userinfo", "DELETE", "authorization"),
    ):
        response = await preflight(http, server, path, SPA_ORIGIN, method, asked)
        assert response.status == 403, (path, method, asked)
        assert_no_cors(response)


async def test_userinfo_answers_every_browser_clients_origin_and_exposes_its_challenge(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    tokens = await tokens_for(http, server)
    bearer = {"Authorization": f"Bearer {tokens['access_token']}"}
    for page in (SPA_ORIGIN, OTHER_ORIGIN, EXTRA_ORIGIN):
        async with http.get(
            server.endpoint("/userinfo"), headers={"Origin": page, **bearer}
        ) as response:
            assert response.status == 200
            assert_readable_by(response, page)
            assert (
                response.headers["Access-Control-Expose-Headers"] == "WWW-Authenticate, DPoP-Nonce"
            )
    status, body, response = await post(
        http, server, "/userinfo", {"access_token": tokens["access_token"]}, SPA_ORIGIN
    )
    assert status == 200 and body["sub"]
    assert_readable_by(response, SPA_ORIGIN)
    async with http.get(
        server.endpoint("/userinfo"),
        headers={"Origin": SPA_ORIGIN, "Authorization": "Bearer not-a-token"},
    ) as response:
        assert response.status == 401
        assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
        assert_readable_by(response, SPA_ORIGIN)
        assert response.headers["Access-Control-Expose-Headers"] == "WWW-Authenticate, DPoP-Nonce"


# ---------------------------------------------------------------------------- never, always


async def test_introspection_never_answers_cors(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    tokens = await tokens_for(http, server)
    status, body, response = await post(
        http,
        server,
        "/introspect",
        {"token": tokens["access_token"]},
        SPA_ORIGIN,
        {"Authorization": basic_auth("resource-server", SECRET)},
    )
    assert status == 200 and body["active"] is True
    assert_no_cors(response)
    response = await preflight(http, server, "/introspect", SPA_ORIGIN, "POST", "authorization")
    assert response.status == 405
    assert_no_cors(response)


async def test_discovery_and_jwks_are_readable_by_every_page(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    for path in (
        "/.well-known/openid-configuration",
        "/.well-known/oauth-authorization-server",
        "/jwks",
    ):
        for headers in ({"Origin": EVIL_ORIGIN}, {"Origin": "null"}, {}):
            async with http.get(server.endpoint(path), headers=headers) as response:
                assert response.status == 200
                assert response.headers["Access-Control-Allow-Origin"] == "*"
                assert "Access-Control-Allow-Credentials" not in response.headers
                etag = response.headers["ETag"]
        async with http.get(
            server.endpoint(path), headers={"Origin": EVIL_ORIGIN, "If-None-Match": etag}
        ) as response:
            assert response.status == 304
            assert response.headers["Access-Control-Allow-Origin"] == "*"
        response = await preflight(http, server, path, EVIL_ORIGIN, "GET", "if-none-match")
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert response.headers["Access-Control-Allow-Methods"] == "GET, HEAD"
        response = await preflight(http, server, path, EVIL_ORIGIN, "POST")
        assert response.status == 403
        assert_no_cors(response)


async def test_pages_answer_no_cors(server: RunningAuthServer, http: aiohttp.ClientSession):
    headers = {"Origin": SPA_ORIGIN}
    query = "?response_type=code&client_id=spa&redirect_uri=http%3A%2F%2F127.0.0.1%2Fcb"
    for method, path in (
        ("GET", "/authorize" + query),
        ("POST", "/login"),
        ("POST", "/consent"),
        ("GET", "/device"),
        ("GET", "/logout"),
        ("GET", "/healthz"),
    ):
        async with http.request(
            method, server.endpoint(path), headers=headers, allow_redirects=False
        ) as response:
            assert_no_cors(response)
            assert "Origin" not in response.headers.get("Vary", "")
    for path in ("/authorize", "/login", "/device", "/logout"):
        response = await preflight(http, server, path, SPA_ORIGIN, "POST", "content-type")
        assert response.status == 405
        assert_no_cors(response)


async def test_an_extra_origin_may_call_for_every_browser_client_and_only_for_those(
    server: RunningAuthServer, http: aiohttp.ClientSession
):
    form = {"client_id": "tv", "scope": "openid orders:read"}
    status, body, response = await post(http, server, "/device_authorization", form, EXTRA_ORIGIN)
    assert status == 200 and body["user_code"]
    assert_readable_by(response, EXTRA_ORIGIN)
    poll = {"grant_type": DEVICE_GRANT, "device_code": body["device_code"], "client_id": "tv"}
    status, body, response = await post(http, server, "/token", poll, EXTRA_ORIGIN)
    assert (status, body["error"]) == (400, "authorization_pending")
    assert_readable_by(response, EXTRA_ORIGIN)
    # tv's pages are on the extra origin only: spa's origin is not its.
    status, _, response = await post(http, server, "/device_authorization", form, SPA_ORIGIN)
    assert status == 200
    assert_no_cors(response)
    # The extra origin serves spa too (listed by the operator for every browser client) ...
    status, _, response = await post(http, server, "/token", refresh_form("x"), EXTRA_ORIGIN)
    assert status == 400
    assert_readable_by(response, EXTRA_ORIGIN)
    # ... but never a confidential client.
    status, _, response = await post(
        http,
        server,
        "/token",
        {"grant_type": "client_credentials"},
        EXTRA_ORIGIN,
        {"Authorization": basic_auth("machine", SECRET)},
    )
    assert status == 200
    assert_no_cors(response)


async def test_cors_follows_an_issuer_with_a_path(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
):
    config = cors_config()
    config["issuer"] = "http://127.0.0.1:{port}/tenant"
    server = await start_authserver(config)
    status, _, response = await post(http, server, "/token", refresh_form("x"), SPA_ORIGIN)
    assert status == 400
    assert_readable_by(response, SPA_ORIGIN)
    response = await preflight(http, server, "/userinfo", SPA_ORIGIN, "GET", "authorization")
    assert response.status == 204
    # RFC 8414 §3.1 and §5: the well-known segment before the issuer's path.
    for well_known in ("oauth-authorization-server", "openid-configuration"):
        async with http.get(
            server.url + f"/.well-known/{well_known}/tenant",
            headers={"Origin": EVIL_ORIGIN},
        ) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == "*"


# ---------------------------------------------------------------------------- the pure parts


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1/cb", "http://127.0.0.1"),
        ("http://127.0.0.1:80/cb", "http://127.0.0.1"),
        ("https://App.Example.COM:443/callback?x=1", "https://app.example.com"),
        ("HTTPS://app.example.com:8443", "https://app.example.com:8443"),
        ("http://[0:0:0:0:0:0:0:1]:8083/cb", "http://[::1]:8083"),
        ("https://bücher.example/cb", "https://xn--bcher-kva.example"),
        ("com.example.app:/callback", None),
        ("https:///no-host", None),
        ("https://app.example.com:99999/cb", None),
    ],
)
def test_an_origin_is_serialized_as_browsers_send_it(url: str, expected: str | None) -> None:
    assert origin(url) == expected


@pytest.mark.parametrize(
    ("body", "authorization", "expected"),
    [
        (b"grant_type=refresh_token&refresh_token=r&client_id=spa", [], "spa"),
        (b"client_id=spa&client_id=spa", [], None),
        (b"client_id=", [], None),
        (b"grant_type=refresh_token", [], None),
        (b"client_id=spa", ["Basic c3BhOng="], None),
        (b"client_id=spa&client_secret=s", [], None),
        (b"client_id=spa&client_assertion=a", [], None),
        (b"client_id=%ff", [], None),
    ],
)
def test_the_browser_client_is_the_one_a_form_names_without_any_credential(
    body: bytes, authorization: list[str], expected: str | None
) -> None:
    assert browser_client(body, authorization) == expected
