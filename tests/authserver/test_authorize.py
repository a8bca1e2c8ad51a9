"""The authorization endpoint over real HTTP: which errors are pages and which redirect, the
loopback rule, PKCE, prompt and max_age, consent memory, and what the code redirect carries.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aiohttp
import pytest
import yarl

from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    SECRET,
    CodeResult,
    MovableClock,
    RunningAuthServer,
    authorize_code,
    default_config,
    exchange_code,
    parse_form,
    pkce_pair,
    verify_jwt,
)

VERIFIER, CHALLENGE = pkce_pair()
STATE = "st-4Kq_9.z~"


@pytest.fixture(scope="session")
def shared_keys(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One key ring for every server of this module: generating RSA keys is the slow part of
    starting one, and nothing here depends on the keys being fresh."""
    return str(tmp_path_factory.mktemp("authorize") / "keys")


@pytest.fixture
def start(start_authserver: Any, shared_keys: str) -> Any:
    async def start_with_shared_keys(
        config: dict[str, Any] | None = None, clock: MovableClock | None = None
    ) -> RunningAuthServer:
        config = default_config() if config is None else config
        config.setdefault("keys", {"dir": shared_keys})
        if clock is None:
            server: RunningAuthServer = await start_authserver(config)
        else:
            server = await start_authserver(config, clock=clock)
        return server

    return start_with_shared_keys


@pytest.fixture
async def authserver(start: Any) -> RunningAuthServer:
    server: RunningAuthServer = await start()
    return server


def config_with(*clients: dict[str, Any]) -> dict[str, Any]:
    config = default_config()
    config["clients"].extend(clients)
    return config


def auth_params(**changes: str | None) -> dict[str, str]:
    """A valid request for the public client `spa`; a None value removes the parameter."""
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": "openid orders:read",
        "state": STATE,
        "code_challenge": CHALLENGE,
        "code_challenge_method": "S256",
    }
    params.update({k: v for k, v in changes.items() if v is not None})
    return {k: v for k, v in params.items() if changes.get(k, "") is not None}


@dataclass
class Reply:
    status: int
    headers: Any
    text: str

    @property
    def location(self) -> str:
        return str(self.headers["Location"])

    def redirect_query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.location).query, keep_blank_values=True)


async def send(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    params: dict[str, str] | list[tuple[str, str]],
    *,
    method: str = "GET",
    path: str = "/authorize",
) -> Reply:
    """One request to the server, parameters in the query (GET) or a form (POST).

    The request goes to the listening socket, whatever host the issuer names; `path` is the
    full path (the issuers of these tests have none of their own).
    """
    if method == "GET":
        url = yarl.URL(server.url + path + "?" + urlencode(params), encoded=True)
        response = await http.get(url, allow_redirects=False)
    else:
        response = await http.post(
            server.url + path,
            data=urlencode(params),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            allow_redirects=False,
        )
    async with response:
        return Reply(response.status, response.headers, await response.text())


def form_action(reply: Reply) -> str:
    action, _ = parse_form(reply.text)
    return urlsplit(action).path


async def submit(
    http: aiohttp.ClientSession, server: RunningAuthServer, reply: Reply, **fields: str
) -> Reply:
    """Post the page's form back with its hidden fields and `fields` added."""
    action, hidden = parse_form(reply.text)
    return await send(http, server, {**hidden, **fields}, method="POST", path=action)


async def sign_in(
    http: aiohttp.ClientSession, server: RunningAuthServer, reply: Reply, username: str = "alice"
) -> Reply:
    assert reply.status == 200 and form_action(reply) == "/login", reply.text[:300]
    return await submit(http, server, reply, username=username, password=PASSWORD)


def issued(code: str, redirect_uri: str = REDIRECT) -> CodeResult:
    """A code from a request made with `auth_params`, ready for `exchange_code`."""
    return CodeResult(code, VERIFIER, redirect_uri, STATE, None, "")


def assert_error_page(reply: Reply, message: str) -> None:
    """A 400 HTML page and no redirect of any kind."""
    assert reply.status == 400, reply.text[:300]
    assert "Location" not in reply.headers
    assert reply.headers["Content-Type"].startswith("text/html")
    assert reply.headers["Cache-Control"] == "no-store"
    assert message in reply.text
    assert "code=" not in reply.text


def assert_error_redirect(
    reply: Reply,
    server: RunningAuthServer,
    error: str,
    *,
    state: str | None = STATE,
    redirect_uri: str = REDIRECT,
    status: int = 302,
) -> str:
    """The RFC 6749 §4.1.2.1 error redirect with `iss` (RFC 9207); returns the description."""
    assert reply.status == status, reply.text[:300]
    base, _, _ = reply.location.partition("?")
    assert base == redirect_uri.partition("?")[0]
    query = reply.redirect_query()
    expected = {"error", "error_description", "iss"} | ({"state"} if state is not None else set())
    assert set(query) - {"tenant"} == expected, query
    assert query["error"] == [error]
    assert query["iss"] == [server.settings.issuer]
    if state is not None:
        assert query["state"] == [state]
    assert query["error_description"][0]
    return query["error_description"][0]


def assert_code_redirect(
    reply: Reply, server: RunningAuthServer, *, redirect_uri: str = REDIRECT, state: str = STATE
) -> str:
    assert reply.status in (302, 303), reply.text[:300]
    base, _, _ = reply.location.partition("?")
    assert base == redirect_uri.partition("?")[0]
    query = reply.redirect_query()
    assert set(query) == {"code", "state", "iss"}, query
    assert query["state"] == [state]
    assert query["iss"] == [server.settings.issuer]
    return query["code"][0]


async def signed_in_with_consent(
    http: aiohttp.ClientSession, server: RunningAuthServer, scope: str = "openid orders:read"
) -> None:
    """Give `http` a session for alice who has approved `spa` for `scope`."""
    await authorize_code(http, server, scope=scope)


# ---------------------------------------------------------------------------- pages, not redirects


async def test_unknown_client_id_gets_a_400_page_and_never_a_redirect(authserver, http):
    reply = await send(http, authserver, auth_params(client_id="nobody"))
    assert_error_page(reply, "not registered")


async def test_missing_client_id_gets_a_400_page(authserver, http):
    reply = await send(http, authserver, auth_params(client_id=None))
    assert_error_page(reply, "not registered")


async def test_client_not_allowed_the_code_grant_gets_a_400_page(authserver, http):
    reply = await send(http, authserver, auth_params(client_id="machine"))
    assert_error_page(reply, "may not ask for sign-in")


async def test_missing_redirect_uri_gets_a_400_page(authserver, http):
    reply = await send(http, authserver, auth_params(redirect_uri=None))
    assert_error_page(reply, "no redirect_uri")


@pytest.mark.parametrize(
    "redirect_uri",
    [
        "http://127.0.0.1/cc",  # one character changed
        "http://127.0.0.1/cB",
        "http://127.0.0.2/cb",
        "http://127.0.0.1/cb/",
        "http://127.0.0.1/cbx",
        "https://127.0.0.1/cb",
        "http://127.0.0.1/cb?x=1",
        "http://127.0.0.1/cb#frag",
        "http://127.0.0.1/%63b",
        "http://evil@127.0.0.1/cb",
        "http://127.0.0.1:99999/cb",
        "https://attacker.example/cb",
        "http://localhost/cb",
    ],
)
async def test_redirect_uri_not_registered_gets_a_400_page(authserver, http, redirect_uri):
    # The native client, whose loopback redirects match on any port: the most lenient.
    reply = await send(
        http, authserver, auth_params(client_id="desktop", redirect_uri=redirect_uri)
    )
    assert_error_page(reply, "redirect address is not registered")


async def test_localhost_is_not_treated_as_loopback_when_the_ip_literal_is_registered(
    authserver, http
):
    reply = await send(
        http, authserver, auth_params(client_id="desktop", redirect_uri="http://localhost:54321/cb")
    )
    assert_error_page(reply, "redirect address is not registered")


async def test_a_registered_localhost_redirect_matches_only_exactly(start, http):
    named = {
        "client_id": "named-loopback",
        "application_type": "native",
        "token_endpoint_auth_method": "none",
        "redirect_uris": ["http://localhost/cb"],
        "scope": "openid",
    }
    server = await start(config_with(named))
    params = auth_params(client_id="named-loopback", scope="openid")
    other_port = await send(http, server, {**params, "redirect_uri": "http://localhost:1234/cb"})
    assert_error_page(other_port, "redirect address is not registered")
    exact = await send(http, server, {**params, "redirect_uri": "http://localhost/cb"})
    assert exact.status == 200 and form_action(exact) == "/login"


async def test_a_native_apps_loopback_ip_redirect_matches_on_any_port_and_receives_the_code(
    authserver, http
):
    redirect_uri = "http://127.0.0.1:54321/cb"
    result = await authorize_code(http, authserver, client_id="desktop", redirect_uri=redirect_uri)
    assert result.location.startswith(redirect_uri + "?")
    status, body = await exchange_code(http, authserver, result, client_id="desktop")
    assert status == 200, body
    assert body["token_type"] == "Bearer"


async def test_loopback_port_rule_does_not_relax_the_path(authserver, http):
    reply = await send(
        http,
        authserver,
        auth_params(client_id="desktop", redirect_uri="http://127.0.0.1:54321/other"),
    )
    assert_error_page(reply, "redirect address is not registered")


def stored_codes(server: RunningAuthServer) -> int:
    """How many authorization codes the server's SQLite database holds."""
    with contextlib.closing(
        sqlite3.connect(server.settings.storage.removeprefix("sqlite://"))
    ) as db:
        (count,) = db.execute("SELECT count(*) FROM codes").fetchone()
    return int(count)


@pytest.mark.parametrize("character", ["\t", "\r", "\n", " ", "\x00", "\x7f", "\x85"])
async def test_a_loopback_redirect_uri_with_a_control_character_gets_a_page_and_no_code(
    authserver, http, character
):
    # Alice has signed in and approved `desktop`: a valid request would get its code at once.
    # URL splitting drops TAB, CR and LF, so such a URI would match the loopback rule, yet
    # its redirect could never be written; RFC 3986 §2 has no place for any control
    # character or space in a URI. Refused on the page before any code is stored.
    loopback = "http://127.0.0.1:54321/cb"
    await authorize_code(
        http, authserver, client_id="desktop", scope="openid orders:read", redirect_uri=loopback
    )
    before = stored_codes(authserver)
    for redirect_uri in (loopback + character, f"http://127.0.0.1:54321/c{character}b"):
        reply = await send(
            http, authserver, auth_params(client_id="desktop", redirect_uri=redirect_uri)
        )
        assert_error_page(reply, "The redirect address is not a valid URI")
    assert stored_codes(authserver) == before
    ok = await send(http, authserver, auth_params(client_id="desktop", redirect_uri=loopback))
    assert_code_redirect(ok, authserver, redirect_uri=loopback)


async def test_ipv6_loopback_registered_without_port_matches_any_port(start, http):
    native = {
        "client_id": "native6",
        "application_type": "native",
        "token_endpoint_auth_method": "none",
        "redirect_uris": ["http://[::1]/cb"],
        "grant_types": ["authorization_code"],
        "scope": "openid orders:read",
    }
    server = await start(config_with(native))
    redirect_uri = "http://[::1]:1234/cb"
    result = await authorize_code(
        http, server, client_id="native6", scope="openid orders:read", redirect_uri=redirect_uri
    )
    assert result.location.startswith(redirect_uri + "?")
    status, body = await exchange_code(http, server, result, client_id="native6")
    assert status == 200, body

    v4 = await send(
        http, server, auth_params(client_id="native6", redirect_uri="http://127.0.0.1:1234/cb")
    )
    assert_error_page(v4, "redirect address is not registered")


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize(
    "extra",
    ["state=%FF%FE", "state=ok%C3", "%FF=1", "redirect_uri=http%3A%2F%2F127.0.0.1%2Fc%E9"],
    ids=["state", "truncated-state", "name", "redirect_uri"],
)
async def test_a_parameter_that_is_not_utf8_is_refused_not_replaced(
    authserver, http, method, extra
):
    """Bytes that are not UTF-8 are not turned into U+FFFD: the request is refused with a
    page (its redirect_uri cannot be trusted to be the one the client sent)."""
    name = extra.partition("=")[0]
    query = urlencode(auth_params(**{"state": None, name: None})) + "&" + extra
    if method == "GET":
        url = yarl.URL(authserver.endpoint("/authorize") + "?" + query, encoded=True)
        response = await http.get(url, allow_redirects=False)
    else:
        response = await http.post(
            authserver.endpoint("/authorize"),
            data=query.encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            allow_redirects=False,
        )
    async with response:
        reply = Reply(response.status, response.headers, await response.text())
    assert_error_page(reply, "The request is malformed")


@pytest.mark.parametrize("client_id", ["spa", "web"])
async def test_a_web_clients_loopback_redirect_matches_exactly(authserver, http, client_id):
    """RFC 9700 §2.1: exact matching; the any-port rule of RFC 8252 §7.3 is for native apps."""
    params = auth_params(client_id=client_id)
    other_port = await send(
        http, authserver, {**params, "redirect_uri": "http://127.0.0.1:54321/cb"}
    )
    assert_error_page(other_port, "redirect address is not registered")
    exact = await send(http, authserver, params)
    assert exact.status == 200 and form_action(exact) == "/login"


async def test_a_native_app_holding_a_secret_gets_exact_redirect_matching(start, http):
    kiosk = {
        "client_id": "kiosk",
        "application_type": "native",
        "client_secret": SECRET,
        "redirect_uris": [REDIRECT],
        "scope": "openid",
    }
    server = await start(config_with(kiosk))
    params = auth_params(client_id="kiosk", scope="openid")
    other_port = await send(http, server, {**params, "redirect_uri": "http://127.0.0.1:54321/cb"})
    assert_error_page(other_port, "redirect address is not registered")
    exact = await send(http, server, params)
    assert exact.status == 200 and form_action(exact) == "/login"


@pytest.mark.parametrize("name", ["client_id", "redirect_uri"])
async def test_client_id_or_redirect_uri_given_twice_gets_a_page_not_a_redirect(
    authserver, http, name
):
    params = [*auth_params().items(), (name, auth_params()[name])]
    reply = await send(http, authserver, params)
    assert_error_page(reply, "more than once")


# ---------------------------------------------------------------------------- errors that redirect


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"response_type": "token"}, "unsupported_response_type"),
        ({"response_type": "id_token"}, "unsupported_response_type"),
        ({"response_type": "code id_token"}, "unsupported_response_type"),
        ({"response_type": None}, "invalid_request"),
        ({"request": "eyJhbGciOiJub25lIn0.e30."}, "request_not_supported"),
        ({"request_uri": "https://client.example/req.jwt"}, "request_uri_not_supported"),
        ({"response_mode": "fragment"}, "invalid_request"),
        ({"response_mode": "form_post"}, "invalid_request"),
        ({"scope": "openid orders:delete"}, "invalid_scope"),
        ({"scope": None}, "invalid_scope"),
        ({"code_challenge": None, "code_challenge_method": None}, "invalid_request"),
        ({"code_challenge": None}, "invalid_request"),
        ({"code_challenge_method": "plain"}, "invalid_request"),
        ({"code_challenge_method": None}, "invalid_request"),
        ({"code_challenge_method": "S512"}, "invalid_request"),
        ({"code_challenge": "a" * 42}, "invalid_request"),
        ({"code_challenge": "a" * 129}, "invalid_request"),
        ({"code_challenge": "a" * 42 + "+"}, "invalid_request"),
        ({"code_challenge": "a" * 42 + "="}, "invalid_request"),
        ({"code_challenge": "a" * 42 + "/"}, "invalid_request"),
        ({"prompt": "sometimes"}, "invalid_request"),
        ({"prompt": "none login"}, "invalid_request"),
        ({"max_age": "-1"}, "invalid_request"),
        ({"max_age": "soon"}, "invalid_request"),
        ({"max_age": "\u00b2"}, "invalid_request"),
        ({"resource": "https://not-allowed.example"}, "invalid_target"),
    ],
)
async def test_invalid_request_redirects_with_error_state_and_iss(authserver, http, changes, error):
    reply = await send(http, authserver, auth_params(**changes))
    assert_error_redirect(reply, authserver, error)


async def test_scope_the_client_may_not_ask_for_is_invalid_scope(authserver, http):
    # `web` is not allowed orders:write, although the server knows the scope.
    reply = await send(http, authserver, auth_params(client_id="web", scope="orders:write"))
    description = assert_error_redirect(reply, authserver, "invalid_scope")
    assert "not allowed for this client" in description
    assert "orders:write" not in description  # never quoted back


async def test_plain_pkce_is_refused_with_a_reason(authserver, http):
    reply = await send(
        http, authserver, auth_params(code_challenge=VERIFIER, code_challenge_method="plain")
    )
    description = assert_error_redirect(reply, authserver, "invalid_request")
    assert "S256" in description


@pytest.mark.parametrize("name", ["scope", "response_type", "code_challenge", "nonce"])
async def test_parameter_given_twice_redirects_with_invalid_request(authserver, http, name):
    params = auth_params(nonce="n-1")
    reply = await send(http, authserver, [*params.items(), (name, params[name])])
    description = assert_error_redirect(reply, authserver, "invalid_request")
    assert name in description


async def test_state_given_twice_is_invalid_request_without_echoing_either(authserver, http):
    params = [*auth_params().items(), ("state", "second")]
    reply = await send(http, authserver, params)
    assert_error_redirect(reply, authserver, "invalid_request", state=None)


async def test_error_redirect_after_post_is_303(authserver, http):
    reply = await send(http, authserver, auth_params(response_type="token"), method="POST")
    assert_error_redirect(reply, authserver, "unsupported_response_type", status=303)


async def test_no_state_sent_means_no_state_in_the_error(authserver, http):
    reply = await send(http, authserver, auth_params(state=None, response_type="token"))
    assert_error_redirect(reply, authserver, "unsupported_response_type", state=None)


# ---------------------------------------------------------------------------- PKCE exemption


async def test_confidential_client_exempt_from_pkce_may_omit_it_when_it_sends_a_nonce(
    authserver, http
):
    result = await authorize_code(
        http, authserver, client_id="web-nopkce", scope="openid email", pkce=False, nonce="n-42"
    )
    status, body = await exchange_code(
        http, authserver, result, client_id="web-nopkce", auth=("web-nopkce", SECRET)
    )
    assert status == 200, body
    claims = await verify_jwt(http, authserver, body["id_token"], audience="web-nopkce")
    assert claims["nonce"] == "n-42"


async def test_client_exempt_from_pkce_still_needs_it_without_a_nonce(authserver, http):
    params = auth_params(
        client_id="web-nopkce", scope="openid", code_challenge=None, code_challenge_method=None
    )
    reply = await send(http, authserver, params)
    assert_error_redirect(reply, authserver, "invalid_request")


async def test_client_exempt_from_pkce_gets_its_challenge_checked_when_it_sends_one(
    authserver, http
):
    params = auth_params(client_id="web-nopkce", scope="openid", nonce="n", code_challenge="x")
    reply = await send(http, authserver, params)
    assert_error_redirect(reply, authserver, "invalid_request")


async def test_public_client_with_a_nonce_still_needs_pkce(authserver, http):
    params = auth_params(nonce="n-1", code_challenge=None, code_challenge_method=None)
    reply = await send(http, authserver, params)
    assert_error_redirect(reply, authserver, "invalid_request")


# ---------------------------------------------------------------------------- prompt and max_age


async def test_prompt_none_without_a_session_is_login_required(authserver, http):
    reply = await send(http, authserver, auth_params(prompt="none"))
    assert_error_redirect(reply, authserver, "login_required")


async def test_prompt_none_with_a_session_but_no_consent_is_consent_required(authserver, http):
    await signed_in_with_consent(http, authserver, scope="openid")
    reply = await send(http, authserver, auth_params(prompt="none", scope="openid orders:read"))
    assert_error_redirect(reply, authserver, "consent_required")


async def test_prompt_none_with_session_and_consent_gives_the_code_without_any_page(
    authserver, http
):
    await signed_in_with_consent(http, authserver)
    reply = await send(http, authserver, auth_params(prompt="none"))
    code = assert_code_redirect(reply, authserver)
    assert reply.status == 302
    status, body = await exchange_code(http, authserver, issued(code))
    assert status == 200, body


async def test_prompt_login_shows_the_login_page_despite_a_session(authserver, http):
    await signed_in_with_consent(http, authserver)
    reply = await send(http, authserver, auth_params(prompt="login"))
    assert reply.status == 200
    assert form_action(reply) == "/login"
    after = await sign_in(http, authserver, reply)
    assert_code_redirect(after, authserver)


async def test_prompt_login_flow_completes_through_login_and_consent(authserver, http):
    result = await authorize_code(http, authserver, extra={"prompt": "login"})
    status, body = await exchange_code(http, authserver, result)
    assert status == 200, body


async def test_prompt_consent_asks_again_although_consent_was_given(authserver, http):
    await signed_in_with_consent(http, authserver)
    reply = await send(http, authserver, auth_params(prompt="consent"))
    assert reply.status == 200
    assert form_action(reply) == "/consent"


async def test_max_age_zero_forces_a_new_login_and_updates_auth_time(start, http):
    clock = MovableClock()
    authserver = await start(clock=clock)
    first = await authorize_code(http, authserver, scope="openid orders:read")
    status, body = await exchange_code(http, authserver, first)
    assert status == 200, body
    first_auth = (await verify_jwt(http, authserver, body["id_token"], audience="spa"))["auth_time"]

    # auth_time has whole seconds: start the second login in the next second.
    clock.advance(1.01 - clock.now % 1)
    reply = await send(http, authserver, auth_params(max_age="0", nonce="n-2"))
    assert reply.status == 200 and form_action(reply) == "/login"
    after = await sign_in(http, authserver, reply)
    code = assert_code_redirect(after, authserver)
    status, body = await exchange_code(http, authserver, issued(code))
    assert status == 200, body
    claims = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert claims["auth_time"] > first_auth
    assert claims["nonce"] == "n-2"


async def test_max_age_zero_flow_completes_through_login_and_consent(authserver, http):
    result = await authorize_code(http, authserver, extra={"max_age": "0"})
    status, body = await exchange_code(http, authserver, result)
    assert status == 200, body


async def test_max_age_longer_than_the_session_age_needs_no_login(authserver, http):
    await signed_in_with_consent(http, authserver)
    reply = await send(http, authserver, auth_params(max_age="3600"))
    assert_code_redirect(reply, authserver)


async def test_consent_form_without_its_proof_runs_the_login_checks_again(authserver, http):
    """A consent form put together by hand cannot skip the re-login `prompt=login` asks for."""
    await signed_in_with_consent(http, authserver)
    reply = await send(http, authserver, auth_params(prompt="login"))
    _, hidden = parse_form(reply.text)  # the login page: its CSRF token is the session's
    forged = await send(
        http, authserver, {**hidden, "decision": "approve"}, method="POST", path="/consent"
    )
    assert forged.status == 200
    assert form_action(forged) == "/login"


# ---------------------------------------------------------------------------- consent


async def test_consent_page_lists_scopes_with_descriptions_and_the_client_name(authserver, http):
    reply = await send(http, authserver, auth_params(scope="openid orders:read orders:write"))
    consent = await sign_in(http, authserver, reply)
    assert consent.status == 200
    assert form_action(consent) == "/consent"
    assert "Single Page App" in consent.text
    for name, description in [
        ("openid", "Sign you in"),
        ("orders:read", "Read your orders"),
        ("orders:write", "Change your orders"),
    ]:
        assert f'<span class="scope-description">{description}</span> <code>{name}</code>' in (
            consent.text
        )
    assert "Alice Liddell" in consent.text


async def test_client_with_skip_consent_gets_the_code_right_after_login(start, http):
    trusted = {
        "client_id": "first-party",
        "token_endpoint_auth_method": "none",
        "redirect_uris": [REDIRECT],
        "scope": "openid orders:read",
        "skip_consent": True,
    }
    server = await start(config_with(trusted))
    reply = await send(http, server, auth_params(client_id="first-party"))
    after = await sign_in(http, server, reply)
    assert_code_redirect(after, server)


async def test_granted_scopes_skip_consent_and_new_scopes_ask_again(authserver, http):
    await signed_in_with_consent(http, authserver, scope="openid orders:read")

    same = await send(http, authserver, auth_params(scope="orders:read openid"))
    assert_code_redirect(same, authserver)
    fewer = await send(http, authserver, auth_params(scope="orders:read"))
    assert_code_redirect(fewer, authserver)

    more = await send(http, authserver, auth_params(scope="openid orders:read orders:write"))
    assert more.status == 200 and form_action(more) == "/consent"
    assert "Change your orders" in more.text
    approved = await submit(http, authserver, more, decision="approve")
    assert_code_redirect(approved, authserver)

    again = await send(http, authserver, auth_params(scope="openid orders:write"))
    assert_code_redirect(again, authserver)


async def test_consent_is_remembered_per_client(authserver, http):
    await signed_in_with_consent(http, authserver, scope="openid orders:read")
    other = await send(http, authserver, auth_params(client_id="code-only"))
    assert other.status == 200 and form_action(other) == "/consent"


async def test_deny_redirects_with_access_denied_and_state(authserver, http):
    reply = await send(http, authserver, auth_params())
    consent = await sign_in(http, authserver, reply)
    denied = await submit(http, authserver, consent, decision="deny")
    assert_error_redirect(denied, authserver, "access_denied", status=303)
    # Nothing was remembered: the next request asks again.
    again = await send(http, authserver, auth_params())
    assert again.status == 200 and form_action(again) == "/consent"


async def test_consent_without_a_decision_issues_nothing(authserver, http):
    reply = await send(http, authserver, auth_params())
    consent = await sign_in(http, authserver, reply)
    undecided = await submit(http, authserver, consent)
    assert undecided.status == 400
    assert "Location" not in undecided.headers


# ---------------------------------------------------------------------------- what is carried


@pytest.mark.parametrize(
    "state",
    [
        "a b",
        "x&code=forged&iss=https://evil",
        "100% <b>\"quoted\"</b> 'single'",
        "é€😀",
        "?#/=+;,",
        "  leading-and-trailing  ",
    ],
)
async def test_state_is_echoed_unchanged(authserver, http, state):
    error = await send(http, authserver, auth_params(state=state, response_type="token"))
    assert_error_redirect(error, authserver, "unsupported_response_type", state=state)

    reply = await send(http, authserver, auth_params(state=state))
    after = await submit(
        http,
        authserver,
        await sign_in(http, authserver, reply),
        decision="approve",
    )
    assert_code_redirect(after, authserver, state=state)


async def test_nonce_is_carried_into_the_id_token(authserver, http):
    result = await authorize_code(http, authserver, nonce="n-\u00e9 odd &nonce")
    status, body = await exchange_code(http, authserver, result)
    assert status == 200, body
    claims = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert claims["nonce"] == "n-\u00e9 odd &nonce"


async def test_unknown_parameters_are_ignored_and_not_carried(authserver, http):
    reply = await send(
        http, authserver, auth_params(foo="bar", claims='{"id_token":{}}', ui_locales="fr")
    )
    assert reply.status == 200 and form_action(reply) == "/login"
    _, hidden = parse_form(reply.text)
    assert not {"foo", "claims", "ui_locales"} & set(hidden)
    consent = await sign_in(http, authserver, reply)
    assert_code_redirect(await submit(http, authserver, consent, decision="approve"), authserver)


async def test_post_to_authorize_works_like_get(authserver, http):
    reply = await send(http, authserver, auth_params(), method="POST")
    assert reply.status == 200 and form_action(reply) == "/login"
    consent = await sign_in(http, authserver, reply)
    code = assert_code_redirect(
        await submit(http, authserver, consent, decision="approve"), authserver
    )
    status, body = await exchange_code(http, authserver, issued(code))
    assert status == 200, body

    again = await send(http, authserver, auth_params(), method="POST")
    assert again.status == 303
    assert_code_redirect(again, authserver)


async def test_code_redirect_is_302_after_get_and_303_after_a_form_never_307(authserver, http):
    reply = await send(http, authserver, auth_params())
    consent = await sign_in(http, authserver, reply)
    approved = await submit(http, authserver, consent, decision="approve")
    assert approved.status == 303
    assert_code_redirect(approved, authserver)
    silent = await send(http, authserver, auth_params())
    assert silent.status == 302
    assert_code_redirect(silent, authserver)


async def test_code_redirect_carries_code_state_and_iss_and_nothing_else(authserver, http):
    result = await authorize_code(http, authserver)
    query = parse_qs(urlsplit(result.location).query)
    assert set(query) == {"code", "state", "iss"}
    assert query["iss"] == [authserver.settings.issuer]
    assert len(query["code"][0]) >= 32


async def test_redirect_uri_with_a_query_keeps_it(start, http):
    redirect_uri = "http://127.0.0.1/cb?tenant=a%20b"
    tenant = {
        "client_id": "tenant-app",
        "token_endpoint_auth_method": "none",
        "redirect_uris": [redirect_uri],
        "scope": "openid",
    }
    server = await start(config_with(tenant))
    result = await authorize_code(
        http, server, client_id="tenant-app", scope="openid", redirect_uri=redirect_uri
    )
    assert result.location.startswith(redirect_uri + "&")
    query = parse_qs(urlsplit(result.location).query)
    assert query["tenant"] == ["a b"]
    assert set(query) == {"tenant", "code", "state", "iss"}

    error = await send(
        http,
        server,
        auth_params(client_id="tenant-app", scope="openid", redirect_uri=redirect_uri, prompt="x"),
    )
    assert_error_redirect(error, server, "invalid_request", redirect_uri=redirect_uri)
    assert parse_qs(urlsplit(error.location).query)["tenant"] == ["a b"]


async def test_code_sent_to_one_loopback_port_is_refused_for_another_port(authserver, http):
    result = await authorize_code(
        http, authserver, client_id="desktop", redirect_uri="http://127.0.0.1:40000/cb"
    )
    result.redirect_uri = "http://127.0.0.1:40001/cb"
    status, body = await exchange_code(http, authserver, result, client_id="desktop")
    assert (status, body["error"]) == (400, "invalid_grant")
