"""The HTML side of the authorization server: security headers on every page, cookie
attributes, the login and consent forms, CSRF, session fixation and autoescaping.
"""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest

from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    RunningAuthServer,
    authorize_code,
    default_config,
    parse_form,
)
from tests.authserver.test_authorize import (
    Reply,
    assert_code_redirect,
    assert_error_redirect,
    auth_params,
    form_action,
    send,
    sign_in,
    submit,
)

COOKIE = "portcullis_session"


@pytest.fixture(scope="session")
def shared_keys(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("pages") / "keys")


@pytest.fixture
def start(start_authserver: Any, shared_keys: str) -> Any:
    async def start_with_shared_keys(config: dict[str, Any] | None = None) -> RunningAuthServer:
        config = default_config() if config is None else config
        config.setdefault("keys", {"dir": shared_keys})
        server: RunningAuthServer = await start_authserver(config)
        return server

    return start_with_shared_keys


@pytest.fixture
async def authserver(start: Any) -> RunningAuthServer:
    server: RunningAuthServer = await start()
    return server


def assert_page_headers(reply: Reply) -> None:
    headers = reply.headers
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    csp = [d.strip() for d in headers["Content-Security-Policy"].split(";")]
    assert "frame-ancestors 'none'" in csp
    assert "default-src 'none'" in csp
    assert not any(d.startswith("script-src") for d in csp)
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert headers["Cache-Control"] == "no-store"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "<script" not in reply.text.lower()


def set_cookies(reply: Reply) -> list[str]:
    return list(reply.headers.getall("Set-Cookie", []))


def cookie_attributes(header: str) -> tuple[str, str, dict[str, str]]:
    """(name, value, {attribute in lower case: value}) of one Set-Cookie header."""
    first, *rest = [part.strip() for part in header.split(";")]
    name, _, value = first.partition("=")
    attributes = {}
    for part in rest:
        key, _, val = part.partition("=")
        attributes[key.lower()] = val
    return name, value, attributes


def session_cookie(http: aiohttp.ClientSession, name: str = COOKIE) -> str | None:
    for cookie in http.cookie_jar:
        if cookie.key == name:
            return cookie.value
    return None


class _Controls(HTMLParser):
    """Every form control of a page, with its attributes, and each label's `for`."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, str]] = []
        self.controls: list[tuple[str, dict[str, str]]] = []
        self.labels: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append(a)
        elif tag in ("input", "button", "select", "textarea"):
            self.controls.append((tag, a))
        elif tag == "label":
            self.labels.append(a.get("for", ""))


def controls(html: str) -> _Controls:
    parser = _Controls()
    parser.feed(html)
    return parser


async def login_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    reply = await send(http, server, auth_params())
    assert reply.status == 200 and form_action(reply) == "/login", reply.text[:300]
    return reply


async def consent_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    reply = await sign_in(http, server, await login_page(http, server))
    assert reply.status == 200 and form_action(reply) == "/consent", reply.text[:300]
    return reply


async def signed_in(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    await authorize_code(http, server, scope="openid orders:read")


# ---------------------------------------------------------------------------- headers


async def _error_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    return await send(http, server, auth_params(client_id="nobody"))


async def _csrf_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    reply = await login_page(http, server)
    return await submit(http, server, reply, csrf_token="forged", username="alice", password="x")


async def _failed_login_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    reply = await login_page(http, server)
    return await submit(http, server, reply, username="alice", password="wrong")


async def _logout_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    await signed_in(http, server)
    return await send(http, server, {}, path="/logout")


async def _signed_out_page(http: aiohttp.ClientSession, server: RunningAuthServer) -> Reply:
    return await send(http, server, {}, path="/logout")


@pytest.mark.parametrize(
    ("make", "status"),
    [
        (login_page, 200),
        (consent_page, 200),
        (_error_page, 400),
        (_csrf_page, 403),
        (_failed_login_page, 400),
        (_logout_page, 200),
        (_signed_out_page, 200),
    ],
    ids=["login", "consent", "error", "csrf", "failed-login", "logout", "signed-out"],
)
async def test_every_page_carries_the_security_headers(authserver, http, make, status):
    reply = await make(http, authserver)
    assert reply.status == status
    assert_page_headers(reply)


async def test_form_action_allows_the_client_redirect_origin_and_nothing_else(authserver, http):
    reply = await send(
        http, authserver, auth_params(client_id="desktop", redirect_uri="http://127.0.0.1:54321/cb")
    )
    csp = [d.strip() for d in reply.headers["Content-Security-Policy"].split(";")]
    assert "form-action 'self' http://127.0.0.1:54321" in csp
    assert "base-uri 'none'" in csp


async def test_redirects_are_not_cached(authserver, http):
    reply = await send(http, authserver, auth_params(response_type="token"))
    assert reply.status == 302
    assert reply.headers["Cache-Control"] == "no-store"


async def test_stylesheet_is_served_from_the_server_itself(authserver, http):
    reply = await login_page(http, authserver)
    assert '<link rel="stylesheet" href="/static/style.css">' in reply.text
    async with http.get(authserver.url + "/static/style.css") as response:
        assert response.status == 200
        assert response.content_type == "text/css"


# ---------------------------------------------------------------------------- cookies


async def test_session_cookie_is_httponly_lax_host_only_and_not_secure_on_http(authserver, http):
    reply = await login_page(http, authserver)
    cookies = [cookie_attributes(h) for h in set_cookies(reply)]
    assert [name for name, _, _ in cookies] == [COOKIE]
    _, value, attributes = cookies[0]
    assert len(value) >= 40
    assert "httponly" in attributes
    assert attributes["samesite"] == "Lax"
    assert attributes["path"] == "/"
    assert "domain" not in attributes
    assert "secure" not in attributes


async def test_https_issuer_gives_a_secure_host_prefixed_cookie_through_login(start, shared_keys):
    config = default_config()
    config["issuer"] = "https://auth.example.test"
    server = await start(config)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        reply = await send(http, server, auth_params())
        assert reply.status == 200
        [header] = set_cookies(reply)
        name, value, attributes = cookie_attributes(header)
        assert name == "__Host-" + COOKIE
        assert {"secure", "httponly"} <= set(attributes)
        assert attributes["samesite"] == "Lax"
        assert attributes["path"] == "/"
        assert "domain" not in attributes

        _, hidden = parse_form(reply.text)
        response = await http.post(
            server.url + "/login",
            data={**hidden, "username": "alice", "password": PASSWORD},
            headers={"Cookie": f"{name}={value}"},
            allow_redirects=False,
        )
        assert response.status == 200  # the consent page
        [header] = response.headers.getall("Set-Cookie")
        new_name, new_value, attributes = cookie_attributes(header)
        assert (new_name, "secure" in attributes, "httponly" in attributes) == (name, True, True)
        assert new_value != value

        response = await http.get(
            server.url + "/logout",
            headers={"Cookie": f"{name}={new_value}"},
            allow_redirects=False,
        )
        assert response.status == 200  # confirmation page: the cookie signed the user in
        assert "Sign out?" in await response.text()


async def test_signing_out_clears_the_cookie_with_the_same_attributes(authserver, http):
    await signed_in(http, authserver)
    confirm = await send(http, authserver, {}, path="/logout")
    reply = await submit(http, authserver, confirm, confirm="yes")
    [header] = set_cookies(reply)
    name, value, attributes = cookie_attributes(header)
    assert (name, value) == (COOKIE, '""') or (name, value) == (COOKIE, "")
    assert attributes["max-age"] == "0"
    assert "httponly" in attributes
    assert attributes["samesite"] == "Lax"
    assert attributes["path"] == "/"


# ---------------------------------------------------------------------------- forms


async def test_login_form_has_labelled_username_and_password_fields_and_one_submit_button(
    authserver, http
):
    reply = await login_page(http, authserver)
    page = controls(reply.text)
    assert len(page.forms) == 1
    assert page.forms[0]["method"] == "post"
    assert page.forms[0]["action"] == "/login"
    visible = {
        a.get("name"): a for tag, a in page.controls if tag == "input" and a.get("type") != "hidden"
    }
    assert set(visible) == {"username", "password"}
    assert visible["username"]["type"] == "text"
    assert visible["username"]["autocomplete"] == "username"
    assert visible["password"]["type"] == "password"
    assert visible["password"]["autocomplete"] == "current-password"
    for field in visible.values():
        assert field["id"] in page.labels
        assert "required" in field
    submits = [a for tag, a in page.controls if tag == "button" or a.get("type") == "submit"]
    assert len(submits) == 1
    assert submits[0].get("type", "submit") == "submit"
    hidden = {a["name"] for tag, a in page.controls if a.get("type") == "hidden"}
    assert "csrf_token" in hidden
    assert '<meta name="viewport"' in reply.text
    assert '<html lang="en">' in reply.text


async def test_consent_form_has_approve_and_deny_buttons(authserver, http):
    reply = await consent_page(http, authserver)
    page = controls(reply.text)
    assert len(page.forms) == 1
    assert page.forms[0]["method"] == "post"
    assert page.forms[0]["action"] == "/consent"
    buttons = [(a["name"], a["value"], a["type"]) for tag, a in page.controls if tag == "button"]
    assert buttons == [("decision", "approve", "submit"), ("decision", "deny", "submit")]
    hidden = {a["name"] for tag, a in page.controls if a.get("type") == "hidden"}
    assert {"csrf_token", "client_id", "redirect_uri", "state", "code_challenge"} <= hidden


async def test_login_form_keeps_the_username_after_a_failed_attempt(authserver, http):
    reply = await login_page(http, authserver)
    failed = await submit(http, authserver, reply, username="alice", password="wrong")
    assert failed.status == 400
    assert 'value="alice"' in failed.text
    assert "The username or password is not correct." in failed.text
    assert PASSWORD not in failed.text and "wrong" not in failed.text


# ---------------------------------------------------------------------------- CSRF


@pytest.mark.parametrize("token", [None, "", "forged-token", "A" * 43])
async def test_login_without_the_right_csrf_token_is_refused(authserver, http, token):
    reply = await login_page(http, authserver)
    _, hidden = parse_form(reply.text)
    hidden.pop("csrf_token")
    if token is not None:
        hidden["csrf_token"] = token
    refused = await send(
        http,
        authserver,
        {**hidden, "username": "alice", "password": PASSWORD},
        method="POST",
        path="/login",
    )
    assert refused.status == 403
    assert "Location" not in refused.headers
    assert set_cookies(refused) == []
    assert_page_headers(refused)
    # Nobody is signed in.
    check = await send(http, authserver, auth_params(prompt="none"))
    assert_error_redirect(check, authserver, "login_required")


async def test_login_with_the_csrf_token_of_another_session_is_refused(authserver, http):
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        _, theirs = parse_form((await login_page(other, authserver)).text)
    reply = await login_page(http, authserver)
    _, hidden = parse_form(reply.text)
    hidden["csrf_token"] = theirs["csrf_token"]
    refused = await send(
        http,
        authserver,
        {**hidden, "username": "alice", "password": PASSWORD},
        method="POST",
        path="/login",
    )
    assert refused.status == 403


async def test_login_without_a_session_cookie_is_refused(authserver):
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        reply = await login_page(http, authserver)
        refused = await sign_in(http, authserver, reply)
    assert refused.status == 403


@pytest.mark.parametrize("token", [None, "forged-token"])
async def test_consent_without_the_right_csrf_token_issues_no_code(authserver, http, token):
    reply = await consent_page(http, authserver)
    _, hidden = parse_form(reply.text)
    hidden.pop("csrf_token")
    if token is not None:
        hidden["csrf_token"] = token
    refused = await send(
        http, authserver, {**hidden, "decision": "approve"}, method="POST", path="/consent"
    )
    assert refused.status == 403
    assert "Location" not in refused.headers
    assert "code=" not in refused.text
    assert_page_headers(refused)
    # The approval was not recorded either.
    check = await send(http, authserver, auth_params(prompt="none"))
    assert_error_redirect(check, authserver, "consent_required")


async def test_consent_post_from_a_signed_out_browser_is_refused(authserver, http):
    reply = await consent_page(http, authserver)
    _, hidden = parse_form(reply.text)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as stranger:
        refused = await send(
            stranger, authserver, {**hidden, "decision": "approve"}, method="POST", path="/consent"
        )
    assert refused.status == 403


async def test_login_form_sent_as_json_is_refused(authserver, http):
    reply = await login_page(http, authserver)
    _, hidden = parse_form(reply.text)
    async with http.post(
        authserver.url + "/login",
        json={**hidden, "username": "alice", "password": PASSWORD},
        allow_redirects=False,
    ) as response:
        assert response.status == 400
        assert "Location" not in response.headers


# ---------------------------------------------------------------------------- fixation


async def test_login_replaces_the_session_cookie_and_the_old_one_signs_nobody_in(authserver, http):
    reply = await login_page(http, authserver)
    before = session_cookie(http)
    assert before
    consent = await sign_in(http, authserver, reply)
    after = session_cookie(http)
    assert after and after != before
    assert_code_redirect(await submit(http, authserver, consent, decision="approve"), authserver)

    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as old:
        url = authserver.url + "/authorize?" + urlencode(auth_params(prompt="none"))
        async with old.get(
            url, headers={"Cookie": f"{COOKIE}={before}"}, allow_redirects=False
        ) as r:
            assert r.status == 302
            assert "error=login_required" in r.headers["Location"]
        async with old.get(
            url, headers={"Cookie": f"{COOKIE}={after}"}, allow_redirects=False
        ) as r:
            assert r.status == 302
            assert "code=" in r.headers["Location"]


async def test_a_session_id_chosen_by_someone_else_is_never_adopted(authserver, http):
    planted = "attacker-chosen-session-id-0123456789abcdef"
    http.cookie_jar.update_cookies(
        {COOKIE: planted}, response_url=aiohttp.client.URL(authserver.url)
    )
    reply = await login_page(http, authserver)
    [header] = set_cookies(reply)
    _, value, _ = cookie_attributes(header)
    assert value != planted
    await sign_in(http, authserver, reply)
    assert session_cookie(http) not in (planted, value)


async def test_session_cookie_value_that_is_too_long_is_ignored(authserver, http):
    http.cookie_jar.update_cookies(
        {COOKIE: "x" * 5000}, response_url=aiohttp.client.URL(authserver.url)
    )
    reply = await login_page(http, authserver)
    assert len(set_cookies(reply)) == 1


# ---------------------------------------------------------------------------- escaping


async def test_client_name_and_state_are_html_escaped(start, http):
    hostile = {
        "client_id": "hostile",
        "client_name": "<script>alert(1)</script>",
        "token_endpoint_auth_method": "none",
        "redirect_uris": [REDIRECT],
        "scope": "openid",
    }
    config = default_config()
    config["clients"].append(hostile)
    server = await start(config)
    state = '"><script>alert(2)</script>'
    reply = await send(http, server, auth_params(client_id="hostile", scope="openid", state=state))
    assert reply.status == 200
    assert "<script" not in reply.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in reply.text
    assert 'value="&#34;&gt;&lt;script&gt;alert(2)&lt;/script&gt;"' in reply.text
    _, hidden = parse_form(reply.text)
    assert hidden["state"] == state  # the browser gets the value back exactly

    consent = await sign_in(http, server, reply)
    assert consent.status == 200
    assert "<script" not in consent.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in consent.text
    approved = await submit(http, server, consent, decision="approve")
    assert_code_redirect(approved, server, state=state)


async def test_username_echoed_after_a_failed_login_is_escaped(authserver, http):
    reply = await login_page(http, authserver)
    failed = await submit(http, authserver, reply, username='"><script>x</script>', password="p")
    assert failed.status == 400
    assert "<script" not in failed.text
    assert "&lt;script&gt;x&lt;/script&gt;" in failed.text


async def test_error_page_names_the_problem_without_echoing_input(authserver, http):
    reply = await send(http, authserver, auth_params(client_id="<b>nobody</b>"))
    assert reply.status == 400
    assert "<b>" not in reply.text
    assert "The application that sent you here is not registered." in reply.text
