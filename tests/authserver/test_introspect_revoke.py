"""Introspection (RFC 7662) for configured resource servers, and revocation (RFC 7009) of a
client's own tokens."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from tests.authserver.conftest import (
    JWT_BEARER,
    SECRET,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    basic_auth,
    client_assertion,
    client_credentials,
    client_public_jwks,
    default_config,
    introspect,
    post_token,
    tokens_for,
)
from tests.support import b64url, ecdsa_twin

INACTIVE = {"active": False}


async def post(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    path: str,
    data: dict[str, str],
    auth: tuple[str, str] | None = None,
) -> tuple[int, Any, aiohttp.ClientResponse]:
    headers = {"Authorization": basic_auth(*auth)} if auth else {}
    async with http.post(server.endpoint(path), data=data, headers=headers) as response:
        text = await response.text()
        body = await response.json() if text else None
        return response.status, body, response


async def revoke(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    token: str,
    *,
    client_id: str = "spa",
    auth: tuple[str, str] | None = None,
    **extra: str,
) -> int:
    data = {"token": token, **extra}
    if auth is None:
        data["client_id"] = client_id
    status, body, response = await post(http, server, "/revoke", data, auth)
    assert response.headers["Cache-Control"] == "no-store"
    if status == 200:
        assert body is None
    return status


def forged_access_token(server: RunningAuthServer, **overrides: Any) -> str:
    """A well-formed access token signed by a key the server does not have."""
    now = int(time.time())
    claims = {
        "iss": server.settings.issuer,
        "sub": "someone",
        "aud": "orders-api",
        "exp": now + 300,
        "iat": now,
        "jti": "forged",
        "client_id": "machine",
        "scope": "orders:read",
        **overrides,
    }
    kid = server.services.keyring.active(server.settings.keys.access_token_alg).kid
    return jwt.encode(
        claims,
        ec.generate_private_key(ec.SECP256R1()),
        algorithm="ES256",
        headers={"kid": kid, "typ": "at+jwt"},
    )


# ---------------------------------------------------------------------------- introspection


async def test_introspection_without_client_authentication_is_401(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, body = await client_credentials(http, authserver)
    status, answer, response = await post(
        http, authserver, "/introspect", {"token": body["access_token"]}
    )
    assert (status, answer["error"]) == (401, "invalid_client")
    assert response.headers["WWW-Authenticate"].startswith("Basic ")
    assert "active" not in answer


async def test_introspection_with_a_wrong_secret_is_401(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, body = await client_credentials(http, authserver)
    status, answer, response = await post(
        http,
        authserver,
        "/introspect",
        {"token": body["access_token"]},
        ("resource-server", "x" * 32),
    )
    assert (status, answer["error"]) == (401, "invalid_client")
    assert response.headers["WWW-Authenticate"].startswith("Basic ")


@pytest.mark.parametrize("client", [("machine", SECRET), ("web", SECRET)])
async def test_a_client_not_allowed_to_introspect_is_refused(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, client: tuple[str, str]
) -> None:
    _, body = await client_credentials(http, authserver)
    status, answer, _ = await post(
        http, authserver, "/introspect", {"token": body["access_token"]}, client
    )
    assert status == 403
    assert answer["error"] == "unauthorized_client"
    assert "active" not in answer


async def test_a_public_client_can_never_introspect(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    for client in config["clients"]:
        if client["client_id"] == "spa":
            client["introspection"] = True
    server = await start_authserver(config)
    tokens = await tokens_for(http, server)
    status, answer, _ = await post(
        http, server, "/introspect", {"token": tokens["access_token"], "client_id": "spa"}
    )
    assert status == 403
    assert "active" not in answer


async def test_introspection_of_an_active_access_token_describes_it(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    claims = jwt.decode(tokens["access_token"], options={"verify_signature": False})
    status, answer, response = await post(
        http,
        authserver,
        "/introspect",
        {"token": tokens["access_token"]},
        ("resource-server", SECRET),
    )
    assert status == 200
    assert response.headers["Cache-Control"] == "no-store"
    assert answer["active"] is True
    assert answer["scope"] == tokens["scope"]
    assert answer["client_id"] == "spa"
    assert answer["sub"] == claims["sub"]
    assert answer["exp"] == claims["exp"]
    assert answer["iat"] == claims["iat"]
    assert answer["iss"] == authserver.settings.issuer
    assert answer["aud"] == "orders-api"
    assert answer["token_type"] == "Bearer"


async def test_the_other_spelling_of_an_access_tokens_signature_is_not_active(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    # (r, n - s) verifies too, but this server signs the low-S spelling only and takes no
    # other: one token, one string (portcullis/jose.py).
    token = (await tokens_for(http, authserver))["access_token"]
    for presented, active in ((ecdsa_twin(token), False), (token, True)):
        status, answer, _ = await post(
            http, authserver, "/introspect", {"token": presented}, ("resource-server", SECRET)
        )
        assert status == 200
        assert answer["active"] is active


async def test_an_access_token_is_judged_at_the_servers_time(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["lifetimes"] = {"access_token": "60s"}
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    tokens = await tokens_for(http, server)
    claims = jwt.decode(tokens["access_token"], options={"verify_signature": False})
    clock.advance(claims["exp"] - clock.now - 1)  # a second before exp
    assert (await introspect(http, server, tokens["access_token"]))["active"] is True
    clock.advance(1)  # exp: expired (RFC 7519 §4.1.4, "on or after")
    assert await introspect(http, server, tokens["access_token"]) == {"active": False}


async def test_an_access_token_from_the_servers_future_is_not_active(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    server = await start_authserver(clock=clock)
    tokens = await tokens_for(http, server)
    clock.advance(-5)  # the server's time went back: the token's iat is ahead of it
    assert await introspect(http, server, tokens["access_token"]) == {"active": False}
    clock.advance(5)
    assert (await introspect(http, server, tokens["access_token"]))["active"] is True


async def test_introspection_of_an_active_refresh_token_describes_it(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    answer = await introspect(http, authserver, tokens["refresh_token"])
    assert answer["active"] is True
    assert answer["scope"] == tokens["scope"]
    assert answer["client_id"] == "spa"
    assert answer["sub"] == authserver.subject("alice")
    assert answer["iss"] == authserver.settings.issuer
    assert answer["aud"] == "orders-api"
    assert answer["token_type"] == "refresh_token"
    assert answer["iat"] <= time.time() < answer["exp"]


async def test_introspection_accepts_a_private_key_jwt_resource_server(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["clients"].append(
        {
            "client_id": "rs-jwt",
            "token_endpoint_auth_method": "private_key_jwt",
            "jwks": client_public_jwks(),
            "grant_types": ["client_credentials"],
            "introspection": True,
        }
    )
    server = await start_authserver(config)
    _, body = await client_credentials(http, server)
    assertion = client_assertion(server.settings.issuer, client_id="rs-jwt")
    status, answer, _ = await post(
        http,
        server,
        "/introspect",
        {
            "token": body["access_token"],
            "client_assertion_type": JWT_BEARER,
            "client_assertion": assertion,
        },
    )
    assert status == 200
    assert answer["active"] is True


@pytest.mark.parametrize(
    "kind",
    [
        "garbage",
        "empty_looking",
        "three_dots",
        "forged_signature",
        "expired",
        "id_token",
        "list_kid",
        "alg_none",
    ],
)
async def test_anything_not_an_active_token_is_exactly_active_false(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, kind: str
) -> None:
    tokens = await tokens_for(http, authserver)
    svc = authserver.services
    if kind == "garbage":
        token = "definitely-not-a-token"
    elif kind == "empty_looking":
        token = " "
    elif kind == "three_dots":
        token = "a.b.c"
    elif kind == "forged_signature":
        token = forged_access_token(authserver)
    elif kind == "expired":
        token = svc.minter.access_token(
            subject="s",
            client_id="spa",
            scope="openid",
            audience="orders-api",
            now=time.time() - 3600,
        ).token
    elif kind == "id_token":
        token = tokens["id_token"]
    elif kind == "list_kid":
        _, payload, signature = tokens["access_token"].split(".")
        odd = {"alg": "ES256", "typ": "at+jwt", "kid": ["x"]}
        token = f"{b64url(odd)}.{payload}.{signature}"
    else:  # alg_none
        claims = jwt.decode(tokens["access_token"], options={"verify_signature": False})
        token = jwt.encode(claims, None, algorithm="none", headers={"typ": "at+jwt"})  # type: ignore[arg-type]
    assert await introspect(http, authserver, token) == INACTIVE


async def test_token_type_hint_does_not_change_the_answer(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    for hint in ("refresh_token", "access_token", "something_else"):
        assert (await introspect(http, authserver, tokens["access_token"], token_type_hint=hint))[
            "token_type"
        ] == "Bearer"
        refresh_answer = await introspect(
            http, authserver, tokens["refresh_token"], token_type_hint=hint
        )
        assert refresh_answer["token_type"] == "refresh_token"


async def test_introspection_without_a_token_is_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, answer, _ = await post(http, authserver, "/introspect", {}, ("resource-server", SECRET))
    assert (status, answer["error"]) == (400, "invalid_request")


# ---------------------------------------------------------------------------- revocation


async def test_revoking_a_refresh_token_revokes_its_family_and_access_tokens(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver)
    status, second, _ = await post_token(
        http,
        authserver,
        {
            "grant_type": "refresh_token",
            "refresh_token": first["refresh_token"],
            "client_id": "spa",
        },
    )
    assert status == 200
    assert await revoke(http, authserver, second["refresh_token"]) == 200
    for body in (first, second):
        assert await introspect(http, authserver, body["access_token"]) == INACTIVE
        assert await introspect(http, authserver, body["refresh_token"]) == INACTIVE
    status, answer, _ = await post_token(
        http,
        authserver,
        {
            "grant_type": "refresh_token",
            "refresh_token": second["refresh_token"],
            "client_id": "spa",
        },
    )
    assert (status, answer["error"]) == (400, "invalid_grant")


async def test_revoking_an_access_token_makes_it_inactive_and_spares_the_refresh_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    assert await revoke(http, authserver, tokens["access_token"]) == 200
    assert await introspect(http, authserver, tokens["access_token"]) == INACTIVE
    assert (await introspect(http, authserver, tokens["refresh_token"]))["active"] is True


async def test_confidential_client_revokes_its_client_credentials_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    _, body = await client_credentials(http, authserver)
    assert await revoke(http, authserver, body["access_token"], auth=("machine", SECRET)) == 200
    assert await introspect(http, authserver, body["access_token"]) == INACTIVE


async def test_a_client_cannot_revoke_another_clients_tokens(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    for token in (tokens["access_token"], tokens["refresh_token"]):
        status, answer, _ = await post(
            http, authserver, "/revoke", {"token": token}, ("web", SECRET)
        )
        assert status == 400
        assert answer["error"] == "unauthorized_client"
    assert (await introspect(http, authserver, tokens["access_token"]))["active"] is True
    assert (await introspect(http, authserver, tokens["refresh_token"]))["active"] is True


@pytest.mark.parametrize("token", ["unknown", "a.b.c", "x" * 500])
async def test_revoking_an_unknown_token_answers_200(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, token: str
) -> None:
    assert await revoke(http, authserver, token, auth=("machine", SECRET)) == 200


async def test_revoking_an_already_revoked_token_answers_200(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    assert await revoke(http, authserver, tokens["refresh_token"]) == 200
    assert await revoke(http, authserver, tokens["refresh_token"]) == 200


@pytest.mark.parametrize("hint", ["access_token", "refresh_token", "unknown_type"])
async def test_a_wrong_token_type_hint_does_not_stop_the_revocation(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, hint: str
) -> None:
    tokens = await tokens_for(http, authserver)
    other = "access_token" if hint == "refresh_token" else "refresh_token"
    assert await revoke(http, authserver, tokens[other], token_type_hint=hint) == 200
    assert await introspect(http, authserver, tokens[other]) == INACTIVE


async def test_revocation_needs_client_authentication(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, authserver)
    status, answer, response = await post(
        http, authserver, "/revoke", {"token": tokens["refresh_token"]}
    )
    assert (status, answer["error"]) == (401, "invalid_client")
    assert "WWW-Authenticate" in response.headers
    status, answer, response = await post(
        http, authserver, "/revoke", {"token": tokens["refresh_token"]}, ("web", "wrong" * 8)
    )
    assert (status, answer["error"]) == (401, "invalid_client")
    assert response.headers["WWW-Authenticate"].startswith("Basic ")
    assert (await introspect(http, authserver, tokens["refresh_token"]))["active"] is True


async def test_revocation_without_a_token_is_invalid_request(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, answer, _ = await post(http, authserver, "/revoke", {}, ("machine", SECRET))
    assert (status, answer["error"]) == (400, "invalid_request")
