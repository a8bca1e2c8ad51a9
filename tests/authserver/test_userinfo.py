"""UserInfo (OIDC Core §5.3): the token from the header or a POST form body, never both and
never the query; RFC 6750 challenges; claims by granted scope."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from tests.authserver.conftest import (
    RunningAuthServer,
    client_credentials,
    tokens_for,
)

REALM = 'Bearer realm="portcullis"'


async def call(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    method: str = "GET",
    *,
    headers: dict[str, str] | None = None,
    data: Any = None,
    path: str = "/userinfo",
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    async with http.request(
        method, server.endpoint(path), headers=headers or {}, data=data
    ) as response:
        return response.status, await response.json(), response


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_challenge(
    response: aiohttp.ClientResponse, body: dict[str, Any], status: int, error: str | None
) -> None:
    assert response.status == status
    challenge = response.headers["WWW-Authenticate"]
    assert challenge.startswith(REALM)
    if error is None:
        assert "error=" not in challenge
        assert body == {}
    else:
        assert f'error="{error}"' in challenge
        assert body["error"] == error
    assert response.headers["Cache-Control"] == "no-store"


async def test_userinfo_with_the_token_in_the_header_returns_the_released_claims(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    status, body, response = await call(http, authserver, headers=bearer(tokens["access_token"]))
    assert status == 200
    assert response.headers["Cache-Control"] == "no-store"
    assert body == {
        "sub": authserver.subject("alice"),
        "name": "Alice Liddell",
        "given_name": "Alice",
        "email": "alice@example.com",
        "email_verified": True,
    }


async def test_userinfo_with_the_token_in_a_post_form_body(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    status, body, _ = await call(
        http, authserver, "POST", data={"access_token": tokens["access_token"]}
    )
    assert status == 200
    assert body["email"] == "alice@example.com"


async def test_userinfo_by_post_with_the_header(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    status, body, _ = await call(http, authserver, "POST", headers=bearer(tokens["access_token"]))
    assert status == 200
    assert body["sub"] == authserver.subject("alice")


async def test_token_in_both_header_and_body_is_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    _, body, response = await call(
        http,
        authserver,
        "POST",
        headers=bearer(tokens["access_token"]),
        data={"access_token": tokens["access_token"]},
    )
    assert_challenge(response, body, 400, "invalid_request")


async def test_no_token_is_401_with_a_bare_challenge(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, body, response = await call(http, authserver)
    assert_challenge(response, body, 401, None)


async def test_token_in_the_query_string_is_ignored(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    _, body, response = await call(
        http, authserver, path="/userinfo?access_token=" + tokens["access_token"]
    )
    assert_challenge(response, body, 401, None)


@pytest.mark.parametrize("value", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer  ", "Token abc"])
async def test_authorization_that_is_not_a_bearer_token_counts_as_no_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, value: str
) -> None:
    _, body, response = await call(http, authserver, headers={"Authorization": value})
    assert_challenge(response, body, 401, None)


async def test_token_without_openid_is_403_insufficient_scope(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver, scope="orders:read")
    _, body, response = await call(http, authserver, headers=bearer(tokens["access_token"]))
    assert_challenge(response, body, 403, "insufficient_scope")


async def test_client_credentials_token_is_403_insufficient_scope(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, tokens = await client_credentials(http, authserver)
    _, body, response = await call(http, authserver, headers=bearer(tokens["access_token"]))
    assert_challenge(response, body, 403, "insufficient_scope")


@pytest.mark.parametrize("kind", ["garbage", "id_token", "refresh_token", "expired", "revoked"])
async def test_invalid_tokens_are_401_invalid_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, kind: str
) -> None:
    tokens = await tokens_for(http, authserver)
    if kind == "garbage":
        token = "garbage"
    elif kind in ("id_token", "refresh_token"):
        token = tokens[kind]
    elif kind == "expired":
        token = authserver.services.minter.access_token(
            subject=authserver.subject("alice"),
            client_id="spa",
            scope="openid email",
            audience="orders-api",
            now=time.time() - 3600,
        ).token
    else:
        async with http.post(
            authserver.endpoint("/revoke"),
            data={"token": tokens["access_token"], "client_id": "spa"},
        ) as response:
            assert response.status == 200
        token = tokens["access_token"]
    _, body, response = await call(http, authserver, headers=bearer(token))
    assert_challenge(response, body, 401, "invalid_token")


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        ("openid", set()),
        ("openid email", {"email", "email_verified"}),
        ("openid profile", {"name", "given_name"}),
        ("openid profile email", {"name", "given_name", "email", "email_verified"}),
    ],
)
async def test_claims_follow_the_granted_scopes(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, scope: str, expected: set[str]
) -> None:
    tokens = await tokens_for(http, authserver, scope=scope)
    status, body, _ = await call(http, authserver, headers=bearer(tokens["access_token"]))
    assert status == 200
    assert set(body) == {"sub"} | expected


async def test_claims_missing_from_the_user_record_are_left_out(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver, scope="openid profile email", username="bob")
    status, body, _ = await call(http, authserver, headers=bearer(tokens["access_token"]))
    assert status == 200
    assert body == {"sub": authserver.subject("bob"), "name": "Bob", "email": "bob@example.com"}


async def test_userinfo_for_a_narrowed_refresh_follows_the_narrowed_scope(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    async with http.post(
        authserver.endpoint("/token"),
        data={
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": "spa",
            "scope": "openid email",
        },
    ) as response:
        narrowed = await response.json()
    status, body, _ = await call(http, authserver, headers=bearer(narrowed["access_token"]))
    assert status == 200
    assert set(body) == {"sub", "email", "email_verified"}
