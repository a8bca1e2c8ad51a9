"""`error_description` over real HTTP: only the characters RFC 6749 §4.1.2.1 and §5.2 allow
(%x20-21 / %x23-5B / %x5D-7E) less `<` and `>`, and never a parameter name or value the request
made up, at every endpoint that answers with one."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aiohttp
import pytest
import yarl

from tests.authserver.conftest import (
    REDIRECT,
    SECRET,
    RunningAuthServer,
    StartAuthServer,
    basic_auth,
    pkce_pair,
)
from tests.authserver.device_support import device_config

ALLOWED = re.compile(r"^[\x20\x21\x23-\x5B\x5D-\x7E]*$")
# A name no endpoint knows, holding a quote, markup and non-ASCII: repeated, it is an error.
HOSTILE = 'x"<script>\u00e9\u202e'
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def assert_clean(description: str) -> None:
    assert ALLOWED.match(description), description
    assert "<" not in description and ">" not in description, description
    assert "script" not in description, description


def twice(pairs: list[tuple[str, str]], name: str = HOSTILE) -> str:
    return urlencode([*pairs, (name, "1"), (name, "2")])


@pytest.fixture
async def server(start_authserver: StartAuthServer) -> RunningAuthServer:
    return await start_authserver(device_config())


def authorize_pairs(**changes: str) -> list[tuple[str, str]]:
    _, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": "openid orders:read",
        "state": "st",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        **changes,
    }
    return list(params.items())


def redirect_description(response: aiohttp.ClientResponse) -> str:
    assert response.status in (302, 303), response.status
    location = response.headers["Location"]
    assert location.startswith(REDIRECT + "?")
    query = parse_qs(urlsplit(location).query)
    assert query["error"] == ["invalid_request"], query
    return query["error_description"][0]


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_authorize_error_redirect_does_not_echo_a_hostile_parameter_name(
    server: RunningAuthServer, http: aiohttp.ClientSession, method: str
) -> None:
    query = twice(authorize_pairs())
    if method == "GET":
        url = yarl.URL(server.endpoint("/authorize") + "?" + query, encoded=True)
        response = await http.get(url, allow_redirects=False)
    else:
        response = await http.post(
            server.endpoint("/authorize"), data=query, headers=FORM, allow_redirects=False
        )
    async with response:
        description = redirect_description(response)
    assert_clean(description)
    assert "more than once" in description


async def test_authorize_names_a_repeated_parameter_only_when_it_is_one_it_knows(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    query = twice(authorize_pairs(), "nonce")
    url = yarl.URL(server.endpoint("/authorize") + "?" + query, encoded=True)
    async with http.get(url, allow_redirects=False) as response:
        description = redirect_description(response)
    assert_clean(description)
    assert "nonce" in description


async def test_authorize_does_not_echo_a_refused_scope(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    query = urlencode(authorize_pairs(scope="openid Visit_evil.example!"))
    url = yarl.URL(server.endpoint("/authorize") + "?" + query, encoded=True)
    async with http.get(url, allow_redirects=False) as response:
        location = response.headers["Location"]
    query_back = parse_qs(urlsplit(location).query)
    assert query_back["error"] == ["invalid_scope"]
    description = query_back["error_description"][0]
    assert_clean(description)
    assert "evil" not in description


# Each endpoint that answers with an RFC 6749 §5.2 JSON body, with a request that would be
# accepted but for the repeated hostile name.
JSON_ENDPOINTS: dict[str, tuple[str, list[tuple[str, str]], str | None]] = {
    "token": ("/token", [("grant_type", "client_credentials")], "machine"),
    "introspect": ("/introspect", [("token", "abc")], "resource-server"),
    "revoke": ("/revoke", [("token", "abc")], "web"),
    "device_authorization": (
        "/device_authorization",
        [("client_id", "tv"), ("scope", "openid")],
        None,
    ),
}


@pytest.mark.parametrize("endpoint", list(JSON_ENDPOINTS))
async def test_json_errors_do_not_echo_a_hostile_parameter_name(
    server: RunningAuthServer, http: aiohttp.ClientSession, endpoint: str
) -> None:
    path, pairs, client = JSON_ENDPOINTS[endpoint]
    headers = dict(FORM)
    if client is not None:
        headers["Authorization"] = basic_auth(client, SECRET)
    async with http.post(server.endpoint(path), data=twice(pairs), headers=headers) as response:
        body: dict[str, Any] = await response.json()
    assert (response.status, body["error"]) == (400, "invalid_request"), body
    assert_clean(body["error_description"])


async def test_token_endpoint_names_a_repeated_parameter_it_knows(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    data = twice([("grant_type", "client_credentials")], "scope")
    headers = {**FORM, "Authorization": basic_auth("machine", SECRET)}
    async with http.post(server.endpoint("/token"), data=data, headers=headers) as response:
        body = await response.json()
    assert body["error"] == "invalid_request"
    assert body["error_description"] == "scope is given more than once"


async def test_userinfo_challenge_does_not_echo_a_hostile_parameter_name(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    data = twice([("access_token", "abc")])
    async with http.post(server.endpoint("/userinfo"), data=data, headers=FORM) as response:
        body = await response.json()
        challenge = response.headers["WWW-Authenticate"]
    assert (response.status, body["error"]) == (400, "invalid_request")
    assert_clean(body["error_description"])
    # The quoted-string holds the description and nothing breaks out of it.
    assert challenge == (
        f'Bearer realm="portcullis", error="invalid_request", '
        f'error_description="{body["error_description"]}"'
    )
