"""RP-Initiated Logout 1.0: an ID token hint and a registered post_logout_redirect_uri end the
session at once; anything else asks the user to confirm with a CSRF-protected form."""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest
import yarl

from tests.authserver.conftest import (
    REDIRECT,
    RunningAuthServer,
    default_config,
    parse_form,
    tokens_for,
)
from tests.authserver.test_authorize import (
    Reply,
    assert_code_redirect,
    assert_error_page,
    assert_error_redirect,
    auth_params,
    form_action,
    send,
    submit,
)

BYE = "http://127.0.0.1/bye"
BYE_WITH_QUERY = "http://127.0.0.1/bye?from=op"


@pytest.fixture(scope="session")
def shared_keys(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("logout") / "keys")


@pytest.fixture
async def authserver(start_authserver: Any, shared_keys: str) -> RunningAuthServer:
    config = default_config()
    config["keys"] = {"dir": shared_keys}
    config["clients"].append(
        {
            "client_id": "rp",
            "client_name": "Relying Party",
            "token_endpoint_auth_method": "none",
            "redirect_uris": [REDIRECT],
            "post_logout_redirect_uris": [BYE, BYE_WITH_QUERY],
            "scope": "openid profile",
        }
    )
    server: RunningAuthServer = await start_authserver(config)
    return server


async def id_token(
    http: aiohttp.ClientSession, server: RunningAuthServer, username: str = "alice"
) -> str:
    """Sign `http` in through the code flow of client `rp`; the ID token it got."""
    body = await tokens_for(http, server, client_id="rp", scope="openid", username=username)
    return str(body["id_token"])


async def logout(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    method: str = "GET",
    **params: str,
) -> Reply:
    return await send(http, server, params, method=method, path="/logout")


async def assert_signed_in(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    reply = await send(http, server, auth_params(client_id="rp", scope="openid", prompt="none"))
    assert_code_redirect(reply, server)


async def assert_signed_out(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    reply = await send(http, server, auth_params(client_id="rp", scope="openid", prompt="none"))
    assert_error_redirect(reply, server, "login_required")
    again = await send(http, server, auth_params(client_id="rp", scope="openid"))
    assert again.status == 200 and form_action(again) == "/login"


def assert_cookie_cleared(reply: Reply) -> None:
    [header] = reply.headers.getall("Set-Cookie")
    assert header.startswith("portcullis_session=")
    assert "Max-Age=0" in header


def assert_confirmation_page(reply: Reply) -> dict[str, str]:
    assert reply.status == 200, reply.text[:300]
    assert "Sign out?" in reply.text
    assert form_action(reply) == "/logout"
    assert "Set-Cookie" not in reply.headers
    _, hidden = parse_form(reply.text)
    assert hidden["csrf_token"]
    return hidden


async def test_valid_hint_and_registered_uri_end_the_session_and_redirect_with_state(
    authserver, http
):
    hint = await id_token(http, authserver)
    reply = await logout(
        http, authserver, id_token_hint=hint, post_logout_redirect_uri=BYE, state="s &1"
    )
    assert reply.status == 302
    assert reply.location == BYE + "?state=s+%261"
    assert_cookie_cleared(reply)
    await assert_signed_out(http, authserver)


async def test_post_logout_redirect_keeps_the_registered_query(authserver, http):
    hint = await id_token(http, authserver)
    reply = await logout(
        http, authserver, id_token_hint=hint, post_logout_redirect_uri=BYE_WITH_QUERY, state="x"
    )
    assert reply.status == 302
    query = parse_qs(urlsplit(reply.location).query)
    assert query == {"from": ["op"], "state": ["x"]}


async def test_logout_by_post_with_a_hint_redirects_with_303(authserver, http):
    hint = await id_token(http, authserver)
    reply = await logout(
        http, authserver, method="POST", id_token_hint=hint, post_logout_redirect_uri=BYE
    )
    assert reply.status == 303
    assert reply.location == BYE
    await assert_signed_out(http, authserver)


@pytest.mark.parametrize(
    "uri", ["http://127.0.0.1/byE", "http://127.0.0.1/bye/", "https://evil.example/", REDIRECT]
)
async def test_unregistered_post_logout_redirect_uri_gets_a_400_page_and_keeps_the_session(
    authserver, http, uri
):
    hint = await id_token(http, authserver)
    reply = await logout(http, authserver, id_token_hint=hint, post_logout_redirect_uri=uri)
    assert_error_page(reply, "not registered")
    await assert_signed_in(http, authserver)


async def test_post_logout_redirect_uri_without_hint_or_client_id_is_refused(authserver, http):
    await id_token(http, authserver)
    reply = await logout(http, authserver, post_logout_redirect_uri=BYE)
    assert_error_page(reply, "not registered")
    await assert_signed_in(http, authserver)


async def test_client_id_that_contradicts_the_hint_is_refused(authserver, http):
    hint = await id_token(http, authserver)
    reply = await logout(
        http, authserver, id_token_hint=hint, client_id="spa", post_logout_redirect_uri=BYE
    )
    assert_error_page(reply, "does not match")
    await assert_signed_in(http, authserver)


async def test_tampered_id_token_hint_gets_a_400_page(authserver, http):
    hint = await id_token(http, authserver)
    header, payload, signature = hint.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["sub"] = "someone-else"
    forged_payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    reply = await logout(http, authserver, id_token_hint=f"{header}.{forged_payload}.{signature}")
    assert_error_page(reply, "not valid")
    await assert_signed_in(http, authserver)


@pytest.mark.parametrize(
    "hint", ["not-a-jwt", "e30.e30.", "eyJraWQiOlsxXSwiYWxnIjoiUlMyNTYifQ.e30.AA"]
)
async def test_malformed_id_token_hint_gets_a_400_page(authserver, http, hint):
    reply = await logout(http, authserver, id_token_hint=hint)
    assert_error_page(reply, "not valid")


async def test_an_access_token_is_not_accepted_as_id_token_hint(authserver, http):
    body = await tokens_for(http, authserver, client_id="rp", scope="openid")
    reply = await logout(http, authserver, id_token_hint=body["access_token"])
    assert_error_page(reply, "not valid")
    await assert_signed_in(http, authserver)


async def test_without_a_hint_the_user_confirms_on_a_page_before_anything_ends(authserver, http):
    await id_token(http, authserver)
    reply = await logout(http, authserver)
    assert_confirmation_page(reply)
    await assert_signed_in(http, authserver)


async def test_confirmation_post_with_csrf_token_ends_the_session(authserver, http):
    await id_token(http, authserver)
    confirm = await logout(http, authserver)
    assert_confirmation_page(confirm)
    done = await submit(http, authserver, confirm, confirm="yes")
    assert done.status == 200
    assert "Signed out" in done.text
    assert_cookie_cleared(done)
    await assert_signed_out(http, authserver)


@pytest.mark.parametrize("token", [None, "forged"])
async def test_confirmation_post_without_the_right_csrf_token_ends_nothing(authserver, http, token):
    await id_token(http, authserver)
    hidden = assert_confirmation_page(await logout(http, authserver))
    hidden.pop("csrf_token")
    if token is not None:
        hidden["csrf_token"] = token
    reply = await logout(http, authserver, method="POST", confirm="yes", **hidden)
    assert_confirmation_page(reply)
    await assert_signed_in(http, authserver)


async def test_confirmed_logout_with_client_id_returns_to_the_registered_uri_with_state(
    authserver, http
):
    await id_token(http, authserver)
    confirm = await logout(
        http, authserver, client_id="rp", post_logout_redirect_uri=BYE, state="st"
    )
    hidden = assert_confirmation_page(confirm)
    assert hidden["post_logout_redirect_uri"] == BYE
    csp = confirm.headers["Content-Security-Policy"]
    assert "form-action 'self' http://127.0.0.1;" in csp
    done = await submit(http, authserver, confirm, confirm="yes")
    assert done.status == 303
    assert done.location == BYE + "?state=st"
    await assert_signed_out(http, authserver)


async def test_hint_for_another_user_asks_for_confirmation(authserver, http):
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as bob:
        bobs_hint = await id_token(bob, authserver, username="bob")
    await id_token(http, authserver)
    reply = await logout(http, authserver, id_token_hint=bobs_hint, post_logout_redirect_uri=BYE)
    assert_confirmation_page(reply)
    await assert_signed_in(http, authserver)


async def test_logout_without_a_session_shows_the_signed_out_page(authserver, http):
    reply = await logout(http, authserver)
    assert reply.status == 200
    assert "Signed out" in reply.text


async def test_logout_without_a_session_still_returns_to_a_registered_uri(authserver, http):
    reply = await logout(http, authserver, client_id="rp", post_logout_redirect_uri=BYE)
    assert reply.status == 302
    assert reply.location == BYE


async def test_logout_ends_only_this_browsers_session(authserver, http):
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        await id_token(other, authserver)
        hint = await id_token(http, authserver)
        reply = await logout(http, authserver, id_token_hint=hint, post_logout_redirect_uri=BYE)
        assert reply.status == 302
        await assert_signed_out(http, authserver)
        await assert_signed_in(other, authserver)


async def test_a_logout_query_that_is_not_utf8_is_refused_not_replaced(authserver, http):
    # A state patched with U+FFFD would be handed to the client as if it had sent it.
    await id_token(http, authserver)
    url = yarl.URL(authserver.endpoint("/logout") + "?client_id=web&state=%FF%FE", encoded=True)
    async with http.get(url, allow_redirects=False) as response:
        reply = Reply(response.status, response.headers, await response.text())
    assert_error_page(reply, "malformed")
    await assert_signed_in(http, authserver)
