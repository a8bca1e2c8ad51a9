"""POST /token: the shared steps (form only, duplicates, grant dispatch, no-store), then the
client_credentials and authorization_code grants end to end over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import Any

import aiohttp
import jwt
import pytest

from tests.authserver.conftest import (
    REDIRECT,
    SECRET,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    authorize_code,
    basic_auth,
    client_credentials,
    default_config,
    exchange_code,
    introspect,
    post_token,
    verify_jwt,
)

FULL_SCOPE = "openid profile email offline_access orders:read"


def assert_no_store(response: aiohttp.ClientResponse) -> None:
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["Pragma"] == "no-cache"


def assert_error(status: int, body: dict[str, Any], expected_status: int, code: str) -> None:
    assert (status, body.get("error")) == (expected_status, code), body
    assert set(body) == {"error", "error_description"}
    assert isinstance(body["error_description"], str) and body["error_description"]


# ---------------------------------------------------------------------------- the endpoint


async def test_json_body_is_refused_with_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        authserver.endpoint("/token"),
        json={"grant_type": "client_credentials"},
        headers={"Authorization": basic_auth("machine", SECRET)},
    ) as response:
        assert_error(response.status, await response.json(), 400, "invalid_request")
        assert_no_store(response)


async def test_multipart_body_is_refused_with_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    form = aiohttp.FormData()
    form.add_field("grant_type", "client_credentials")
    form.add_field("file", b"x", filename="x.bin")
    async with http.post(
        authserver.endpoint("/token"),
        data=form,
        headers={"Authorization": basic_auth("machine", SECRET)},
    ) as response:
        assert_error(response.status, await response.json(), 400, "invalid_request")


@pytest.mark.parametrize(
    "body",
    [
        "grant_type=client_credentials&grant_type=client_credentials",
        "grant_type=client_credentials&scope=orders%3Aread&scope=orders%3Awrite",
        "grant_type=client_credentials&resource=billing-api&resource=orders-api",
    ],
)
async def test_a_parameter_given_twice_is_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, body: str
) -> None:
    async with http.post(
        authserver.endpoint("/token"),
        data=body,
        headers={
            "Content-Type": "application/x-www-form-urlencoded",
            "Authorization": basic_auth("machine", SECRET),
        },
    ) as response:
        assert_error(response.status, await response.json(), 400, "invalid_request")
        assert_no_store(response)


async def test_missing_grant_type_is_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(
        http, authserver, {"scope": "orders:read"}, auth=("machine", SECRET)
    )
    assert_error(status, body, 400, "invalid_request")
    assert_no_store(response)


@pytest.mark.parametrize(
    "grant_type",
    [
        "password",
        "implicit",
        "token",
        "urn:ietf:params:oauth:grant-type:jwt-bearer",
        "CLIENT_CREDENTIALS",
    ],
)
async def test_grant_types_the_server_does_not_have_are_unsupported_grant_type(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, grant_type: str
) -> None:
    status, body, response = await post_token(
        http,
        authserver,
        {"grant_type": grant_type, "username": "alice", "password": "wonderland"},
        auth=("machine", SECRET),
    )
    assert_error(status, body, 400, "unsupported_grant_type")
    assert_no_store(response)


@pytest.mark.parametrize(
    ("client_id", "data"),
    [
        ("web", {"grant_type": "client_credentials"}),  # confidential, code-flow only
        ("machine", {"grant_type": "authorization_code", "code": "x", "redirect_uri": REDIRECT}),
        ("machine", {"grant_type": "refresh_token", "refresh_token": "x"}),
    ],
)
async def test_a_grant_the_client_is_not_registered_for_is_unauthorized_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, client_id: str, data: dict[str, str]
) -> None:
    status, body, response = await post_token(http, authserver, data, auth=(client_id, SECRET))
    assert_error(status, body, 400, "unauthorized_client")
    assert_no_store(response)


async def test_a_public_client_cannot_use_client_credentials(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await post_token(
        http, authserver, {"grant_type": "client_credentials", "client_id": "spa"}
    )
    assert_error(status, body, 400, "unauthorized_client")
    assert "access_token" not in body


async def test_successful_response_is_json_and_never_cached(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, _, response = await post_token(
        http, authserver, {"grant_type": "client_credentials"}, auth=("machine", SECRET)
    )
    assert status == 200
    assert response.content_type == "application/json"
    assert_no_store(response)


async def test_the_form_media_type_with_a_charset_parameter_is_read_as_the_form(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        authserver.endpoint("/token"),
        data="grant_type=client_credentials&scope=orders%3Aread",
        headers={
            "Content-Type": "application/x-www-form-urlencoded; charset=utf-8",
            "Authorization": basic_auth("machine", SECRET),
        },
    ) as response:
        body = await response.json()
        assert response.status == 200, body
        assert body["scope"] == "orders:read"


async def test_a_form_that_is_not_utf_8_is_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        authserver.endpoint("/token"),
        data="grant_type=client_credentials&scope=%ff",
        headers={
            "Content-Type": "application/x-www-form-urlencoded",
            "Authorization": basic_auth("machine", SECRET),
        },
    ) as response:
        assert_error(response.status, await response.json(), 400, "invalid_request")
        assert_no_store(response)


async def test_an_answer_to_a_request_without_origin_varies_by_origin(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    # Only a browser page's request carries Origin: a cache must not give this answer to one.
    for secret in (SECRET, "wrong"):
        _, _, response = await post_token(
            http, authserver, {"grant_type": "client_credentials"}, auth=("machine", secret)
        )
        assert response.headers["Vary"] == "Origin"
        assert "Access-Control-Allow-Origin" not in response.headers


async def test_token_answers_are_counted_by_status(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    requests = authserver.services.token.metrics.requests
    before = dict(requests)
    await post_token(
        http, authserver, {"grant_type": "client_credentials"}, auth=("machine", SECRET)
    )
    await post_token(
        http, authserver, {"grant_type": "client_credentials"}, auth=("machine", "wrong")
    )
    assert requests.get(("token", 200), 0) == before.get(("token", 200), 0) + 1
    assert requests.get(("token", 401), 0) == before.get(("token", 401), 0) + 1


# ---------------------------------------------------------------------------- client_credentials


async def test_client_credentials_issues_an_rfc_9068_access_token_for_the_client_itself(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body = await client_credentials(http, authserver, scope="orders:read")
    assert status == 200
    assert set(body) == {"access_token", "token_type", "expires_in", "scope"}
    assert body["token_type"] == "Bearer"
    assert body["expires_in"] == 300
    assert body["scope"] == "orders:read"
    header = jwt.get_unverified_header(body["access_token"])
    assert header["typ"] == "at+jwt"
    assert header["alg"] == "ES256"
    claims = await verify_jwt(
        http, authserver, body["access_token"], audience="orders-api", typ="at+jwt"
    )
    assert {"iss", "sub", "aud", "exp", "iat", "jti", "client_id", "scope"} <= set(claims)
    assert claims["iss"] == authserver.settings.issuer
    assert claims["sub"] == "machine"
    assert claims["client_id"] == "machine"
    assert claims["aud"] == "orders-api"
    assert claims["scope"] == "orders:read"
    assert claims["exp"] - claims["iat"] == 300


async def test_client_credentials_without_scope_grants_the_registered_scopes(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body = await client_credentials(http, authserver)
    assert status == 200
    assert body["scope"] == "orders:read orders:write"
    claims = await verify_jwt(http, authserver, body["access_token"])
    assert claims["scope"] == "orders:read orders:write"


async def test_each_client_credentials_token_has_its_own_jti(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    results = await asyncio.gather(*(client_credentials(http, authserver) for _ in range(5)))
    jtis = {
        jwt.decode(body["access_token"], options={"verify_signature": False})["jti"]
        for _, body in results
    }
    assert len(jtis) == 5


@pytest.mark.parametrize(
    "scope", ["orders:read admin", "openid", "offline_access orders:read", 'orders"read']
)
async def test_client_credentials_scope_outside_the_client_is_invalid_scope(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, scope: str
) -> None:
    status, body = await client_credentials(http, authserver, scope=scope)
    assert_error(status, body, 400, "invalid_scope")


async def test_client_credentials_resource_becomes_the_audience_when_allowed(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body = await client_credentials(http, authserver, resource="billing-api")
    assert status == 200
    claims = await verify_jwt(http, authserver, body["access_token"], audience="billing-api")
    assert claims["aud"] == "billing-api"


@pytest.mark.parametrize("resource", ["https://elsewhere.example/api", "orders-api-2"])
async def test_client_credentials_resource_not_allowed_is_invalid_target(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, resource: str
) -> None:
    status, body = await client_credentials(http, authserver, resource=resource)
    assert_error(status, body, 400, "invalid_target")


async def test_client_credentials_token_is_active_on_introspection(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, body = await client_credentials(http, authserver)
    info = await introspect(http, authserver, body["access_token"])
    assert info["active"] is True
    assert info["sub"] == info["client_id"] == "machine"


# ---------------------------------------------------------------------------- authorization_code


def at_hash_of(access_token: str) -> str:
    digest = hashlib.sha256(access_token.encode()).digest()
    return base64.urlsafe_b64encode(digest[:16]).rstrip(b"=").decode()


async def test_code_exchange_returns_access_refresh_and_a_correct_id_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, scope=FULL_SCOPE, nonce="nonce-123")
    status, body = await exchange_code(http, authserver, result)
    assert status == 200, body
    assert set(body) == {
        "access_token",
        "token_type",
        "expires_in",
        "scope",
        "refresh_token",
        "id_token",
    }
    assert body["token_type"] == "Bearer"
    assert body["scope"] == FULL_SCOPE

    access = await verify_jwt(
        http, authserver, body["access_token"], audience="orders-api", typ="at+jwt"
    )
    id_claims = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert jwt.get_unverified_header(body["id_token"])["alg"] == "RS256"
    assert id_claims["iss"] == authserver.settings.issuer
    assert id_claims["sub"] == access["sub"] == authserver.subject("alice")
    assert id_claims["sub"] not in ("alice", "alice@example.com") and "@" not in id_claims["sub"]
    assert id_claims["aud"] == "spa"
    assert id_claims["nonce"] == "nonce-123"
    assert id_claims["at_hash"] == at_hash_of(body["access_token"])
    assert id_claims["iat"] <= id_claims["exp"]
    assert abs(id_claims["auth_time"] - id_claims["iat"]) < 60
    assert access["auth_time"] == id_claims["auth_time"]
    assert id_claims["email"] == "alice@example.com"
    assert id_claims["email_verified"] is True
    assert id_claims["name"] == "Alice Liddell"
    assert access["client_id"] == "spa"
    assert access["scope"] == FULL_SCOPE


async def test_id_token_releases_only_the_claims_of_the_granted_scopes(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, scope="openid email")
    _, body = await exchange_code(http, authserver, result)
    claims = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert claims["email"] == "alice@example.com"
    assert "name" not in claims and "given_name" not in claims

    result = await authorize_code(http, authserver, scope="openid profile")
    _, body = await exchange_code(http, authserver, result)
    claims = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert claims["name"] == "Alice Liddell"
    assert "email" not in claims


async def test_openid_request_without_offline_access_gets_no_refresh_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, scope="openid email orders:read")
    status, body = await exchange_code(http, authserver, result)
    assert status == 200
    assert "refresh_token" not in body
    assert "id_token" in body


async def test_plain_oauth_request_gets_a_refresh_token_and_no_id_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, scope="orders:read", nonce=None)
    status, body = await exchange_code(http, authserver, result)
    assert status == 200
    assert "refresh_token" in body
    assert "id_token" not in body


async def test_client_without_the_refresh_grant_gets_no_refresh_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(
        http, authserver, client_id="code-only", scope="openid orders:read"
    )
    status, body = await exchange_code(http, authserver, result, client_id="code-only")
    assert status == 200
    assert "refresh_token" not in body


async def test_id_token_without_nonce_in_the_request_has_no_nonce(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, scope="openid", nonce=None)
    _, body = await exchange_code(http, authserver, result)
    claims = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert "nonce" not in claims


async def test_confidential_client_exchanges_its_code_with_basic_auth(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, client_id="web", scope="openid offline_access")
    status, body = await exchange_code(http, authserver, result, auth=("web", SECRET))
    assert status == 200, body
    assert "refresh_token" in body
    assert (await verify_jwt(http, authserver, body["id_token"], audience="web"))["azp"] == "web"


async def test_replayed_code_is_invalid_grant_and_revokes_what_the_first_exchange_issued(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver)
    status, first = await exchange_code(http, authserver, result)
    assert status == 200
    assert (await introspect(http, authserver, first["access_token"]))["active"] is True

    status, second = await exchange_code(http, authserver, result)
    assert_error(status, second, 400, "invalid_grant")

    assert await introspect(http, authserver, first["access_token"]) == {"active": False}
    assert await introspect(http, authserver, first["refresh_token"]) == {"active": False}
    status, body, _ = await post_token(
        http,
        authserver,
        {
            "grant_type": "refresh_token",
            "refresh_token": first["refresh_token"],
            "client_id": "spa",
        },
    )
    assert_error(status, body, 400, "invalid_grant")


async def test_concurrent_redemptions_of_one_code_give_exactly_one_success(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver)
    outcomes = await asyncio.gather(*(exchange_code(http, authserver, result) for _ in range(4)))
    statuses = sorted(status for status, _ in outcomes)
    assert statuses == [200, 400, 400, 400]
    assert all(body["error"] == "invalid_grant" for status, body in outcomes if status == 400)


async def test_wrong_verifier_is_invalid_grant_and_leaves_the_code_for_the_right_one(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver)
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": REDIRECT,
        "client_id": "spa",
    }
    status, body, _ = await post_token(http, authserver, {**data, "code_verifier": "x" * 43})
    assert_error(status, body, 400, "invalid_grant")
    status, body, _ = await post_token(http, authserver, data)  # no verifier at all
    assert_error(status, body, 400, "invalid_grant")
    status, body = await exchange_code(http, authserver, result)
    assert status == 200, body
    assert (await introspect(http, authserver, body["access_token"]))["active"] is True


async def test_verifier_sent_for_a_code_issued_without_challenge_is_refused(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(
        http, authserver, client_id="web-nopkce", scope="openid", pkce=False, nonce="n-1"
    )
    data = {"grant_type": "authorization_code", "code": result.code, "redirect_uri": REDIRECT}
    status, body, _ = await post_token(
        http, authserver, {**data, "code_verifier": "a" * 43}, auth=("web-nopkce", SECRET)
    )
    assert_error(status, body, 400, "invalid_grant")
    # The code was not consumed: without a verifier the legacy client still gets its tokens.
    status, body, _ = await post_token(http, authserver, data, auth=("web-nopkce", SECRET))
    assert status == 200, body
    claims = await verify_jwt(http, authserver, body["id_token"], audience="web-nopkce")
    assert claims["nonce"] == "n-1"


async def test_client_a_cannot_redeem_the_code_of_client_b(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver, client_id="web", scope="openid")
    status, body = await exchange_code(http, authserver, result, client_id="spa")
    assert_error(status, body, 400, "invalid_grant")
    # The rightful client still can.
    status, body = await exchange_code(http, authserver, result, auth=("web", SECRET))
    assert status == 200, body


@pytest.mark.parametrize(
    "redirect_uri",
    [
        None,
        "http://127.0.0.1/cb/",
        "http://127.0.0.1/cB",
        "http://127.0.0.1:80/cb",
        "http://localhost/cb",
    ],
)
async def test_redirect_uri_not_identical_to_the_authorization_request_is_invalid_grant(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, redirect_uri: str | None
) -> None:
    result = await authorize_code(http, authserver)
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "client_id": "spa",
        "code_verifier": result.verifier or "",
    }
    if redirect_uri is not None:
        data["redirect_uri"] = redirect_uri
    status, body, _ = await post_token(http, authserver, data)
    assert_error(status, body, 400, "invalid_grant")
    status, body = await exchange_code(http, authserver, result)
    assert status == 200


async def test_unknown_or_missing_code_is_refused(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    base = {
        "grant_type": "authorization_code",
        "redirect_uri": REDIRECT,
        "client_id": "spa",
        "code_verifier": "a" * 43,
    }
    status, body, _ = await post_token(http, authserver, {**base, "code": "not-a-code"})
    assert_error(status, body, 400, "invalid_grant")
    status, body, _ = await post_token(http, authserver, base)
    assert_error(status, body, 400, "invalid_request")


async def test_expired_code_is_invalid_grant(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["lifetimes"] = {"authorization_code": "200ms"}
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    result = await authorize_code(http, server)
    clock.advance(0.3)
    status, body = await exchange_code(http, server, result)
    assert_error(status, body, 400, "invalid_grant")


async def test_access_token_lifetime_follows_the_configuration(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["lifetimes"] = {"access_token": "90s"}
    server = await start_authserver(config)
    result = await authorize_code(http, server)
    _, body = await exchange_code(http, server, result)
    assert body["expires_in"] == 90
    claims = await verify_jwt(http, server, body["access_token"])
    assert claims["exp"] - claims["iat"] == 90


async def test_resource_in_the_authorization_request_becomes_the_access_token_audience(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    for client in config["clients"]:
        if client["client_id"] == "spa":
            client["resources"] = ["billing-api"]
    server = await start_authserver(config)
    result = await authorize_code(http, server, extra={"resource": "billing-api"})
    status, body = await exchange_code(http, server, result)
    assert status == 200, body
    claims = await verify_jwt(http, server, body["access_token"], audience="billing-api")
    assert claims["aud"] == "billing-api"
    # The refreshed access token keeps the audience of the grant.
    status, refreshed, _ = await post_token(
        http,
        server,
        {"grant_type": "refresh_token", "refresh_token": body["refresh_token"], "client_id": "spa"},
    )
    assert status == 200
    assert (await verify_jwt(http, server, refreshed["access_token"]))["aud"] == "billing-api"
    assert (await introspect(http, server, refreshed["access_token"]))["aud"] == "billing-api"
