"""The single-page app's server (examples/spa) on real sockets, with `make demo`'s
authorization server and gateway configs: what it hands the page, the headers that confine
the page, and the pass-through to the token endpoint, which must stay a pass-through.
"""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from tests.examples.conftest import SpaStack

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
        # Same-origin: the authorization server gives no CORS answers.
        "tokenEndpoint": "/oauth/token",
        "revocationEndpoint": "/oauth/revoke",
    }


async def test_the_page_may_run_only_its_own_script_and_reach_only_itself_and_the_api(
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
            f"connect-src 'self' {spa_stack.gateway.url}; "
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


async def test_token_requests_pass_through_unchanged_and_uncached(
    spa_stack: SpaStack, http: aiohttp.ClientSession
):
    form = {
        "grant_type": "authorization_code",
        "code": "not-a-code",
        "redirect_uri": spa_stack.spa_url + "/callback",
        "client_id": "demo-spa",
        "code_verifier": "v" * 43,
    }
    headers = {"Origin": spa_stack.spa_url}
    async with http.post(spa_stack.spa_url + "/oauth/token", data=form, headers=headers) as relayed:
        assert relayed.status == 400
        assert relayed.headers["Cache-Control"] == "no-store"
        relayed_body = await relayed.json()
    async with http.post(spa_stack.auth.endpoint("/token"), data=form) as direct:
        assert relayed_body == await direct.json()
    assert relayed_body["error"] == "invalid_grant"


async def test_the_pass_through_serves_only_this_apps_pages_and_forms(
    spa_stack: SpaStack, http: aiohttp.ClientSession
):
    url = spa_stack.spa_url + "/oauth/token"
    form = {"grant_type": "refresh_token", "refresh_token": "x", "client_id": "demo-spa"}
    for headers in ({}, {"Origin": "http://127.0.0.1:1"}, {"Origin": "null"}):
        async with http.post(url, data=form, headers=headers) as response:
            assert response.status == 403, headers
            assert (await response.json())["error"] == "invalid_request"
            assert "Access-Control-Allow-Origin" not in response.headers
    async with http.post(
        url, json=form, headers={"Origin": spa_stack.spa_url}
    ) as response:  # JSON is no token request (RFC 6749 §3.2)
        assert response.status == 415


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
