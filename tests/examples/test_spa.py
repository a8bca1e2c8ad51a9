"""The single-page app's server (examples/spa) on real sockets, with `make demo`'s
authorization server and gateway configs: what it hands the page, the headers that confine
the page, and the authorization server's CORS answers to the page's origin, which let the
page call the token endpoint itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from examples import spa
from tests.examples.conftest import SpaStack
from tests.support import TestIssuer, start_site

STATIC = Path(__file__).resolve().parents[2] / "examples" / "spa" / "static"


async def test_settings_name_the_public_client_the_api_and_the_providers_endpoints(
    spa_stack: SpaStack, http: aiohttp.ClientSession
):
    async with http.get(spa_stack.spa_url + "/config.json") as response:
        assert response.status == 200
        assert response.headers["Cache-Control"] == "no-store"
        settings = await response.json()
    issuer = spa_stack.auth.settings.issuer
    assert settings == {
        "issuer": issuer,
        "clientId": "demo-spa",
        "scope": "openid profile offline_access orders:read",
        "api": spa_stack.gateway.url,
        "redirectUri": spa_stack.spa_url + "/callback",
        "postLogoutRedirectUri": spa_stack.spa_url + "/",
        "authorizationEndpoint": issuer + "/authorize",
        "endSessionEndpoint": issuer + "/logout",
        "issParameterSupported": True,
        # On the authorization server's origin: the page calls them across origins.
        "tokenEndpoint": issuer + "/token",
        "revocationEndpoint": issuer + "/revoke",
    }


async def test_the_page_may_run_only_its_own_script_and_reach_only_itself_the_api_and_the_issuer(
    spa_stack: SpaStack, http: aiohttp.ClientSession
):
    for path in ("/", "/callback"):
        async with http.get(spa_stack.spa_url + path) as response:
            assert response.status == 200
            assert response.content_type == "text/html"
            page = await response.text()
            headers = response.headers
        assert headers["Content-Security-Policy"] == (
            "default-src 'none'; script-src 'self'; style-src 'self'; "
            f"connect-src 'self' {spa_stack.gateway.url} {spa_stack.auth.url}; "
            "form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
        )
        assert headers["Referrer-Policy"] == "no-referrer"
        assert headers["Cache-Control"] == "no-store"
        assert '<script type="module" src="/app.js"></script>' in page
        assert "<script>" not in page and "style=" not in page  # nothing inline
    async with http.get(spa_stack.spa_url + "/app.js") as response:
        assert response.status == 200
        assert response.content_type == "application/javascript"
        assert response.headers["X-Content-Type-Options"] == "nosniff"


async def test_the_authorization_server_lets_the_pages_origin_read_its_token_answers(
    spa_stack: SpaStack, http: aiohttp.ClientSession
):
    # The origin comes from demo-spa's redirect URI in config/authserver.yaml: nothing else
    # configures it.
    form = {
        "grant_type": "refresh_token",
        "refresh_token": "not-a-refresh-token",
        "client_id": "demo-spa",
    }
    for path, status in (("/token", 400), ("/revoke", 200)):
        data = form if path == "/token" else {"token": "x", "client_id": "demo-spa"}
        async with http.post(
            spa_stack.auth.endpoint(path), data=data, headers={"Origin": spa_stack.spa_url}
        ) as response:
            assert response.status == status
            assert response.headers["Access-Control-Allow-Origin"] == spa_stack.spa_url
            assert "Access-Control-Allow-Credentials" not in response.headers
    # Another page gets nothing to read; nor does the page for another client.
    async with http.post(
        spa_stack.auth.endpoint("/token"), data=form, headers={"Origin": "http://localhost:1"}
    ) as response:
        assert "Access-Control-Allow-Origin" not in response.headers
    async with http.post(
        spa_stack.auth.endpoint("/token"),
        data={**form, "client_id": "demo-cli"},
        headers={"Origin": spa_stack.spa_url},
    ) as response:
        assert "Access-Control-Allow-Origin" not in response.headers


async def test_the_apps_server_takes_no_part_in_token_requests(
    spa_stack: SpaStack, http: aiohttp.ClientSession
):
    for path in ("/oauth/token", "/oauth/revoke", "/token"):
        async with http.post(
            spa_stack.spa_url + path,
            data={"grant_type": "refresh_token", "refresh_token": "x", "client_id": "demo-spa"},
            headers={"Origin": spa_stack.spa_url},
        ) as response:
            assert response.status in (404, 405), path


async def test_a_provider_whose_token_endpoint_is_on_another_origin_is_refused_clearly(
    http: aiohttp.ClientSession,
):
    # The page may fetch from the issuer's origin only (its Content-Security-Policy).
    issuer = await TestIssuer().start()
    issuer.metadata_overrides.update(
        authorization_endpoint=issuer.url + "/authorize",
        token_endpoint="https://tokens.example/token",
    )
    config = spa.Config(
        issuer=issuer.url, client_id="demo-spa", api="http://127.0.0.1:1", base_url="x"
    )
    runner, url = await start_site(spa.create_app(config))
    try:
        async with http.get(url + "/config.json") as response:
            assert response.status == 502
            assert await response.json() == {
                "error": "provider_unavailable",
                "error_description": (
                    "the provider's token or revocation endpoint is not on the issuer's origin"
                ),
            }
    finally:
        await runner.cleanup()
        await issuer.stop()


def test_the_script_keeps_tokens_out_of_web_storage():
    script = (STATIC / "app.js").read_text()
    # localStorage outlives the tab: never used at all (comments may name it).
    code = re.sub(r"^\s*//.*$", "", script, flags=re.MULTILINE)
    assert "localStorage" not in code
    # sessionStorage holds only a sign-in or sign-out in progress, under these two keys.
    written = re.findall(r"sessionStorage\.setItem\((\w+),", script)
    assert sorted(written) == ["FLOW_KEY", "SIGN_OUT_KEY"]
    assert "sessionStorage.setItem(FLOW_KEY, JSON.stringify(flow))" in script
    assert re.search(r"const flow = \{ state: .*, nonce: .*, verifier: .* \};", script)
    # No HTML is built from data: text only.
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
