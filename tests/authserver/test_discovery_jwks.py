"""Discovery (RFC 8414, OpenID Connect Discovery 1.0) and the JWK Set: complete, truthful,
cacheable; keys public only, persisted, private files unreadable by others."""

from __future__ import annotations

import json
import stat
import time
from typing import Any

import aiohttp
import jwt
import pytest

from authserver.keys import KeyRing
from tests.authserver.conftest import (
    RunningAuthServer,
    StartAuthServer,
    client_credentials,
    default_config,
    fetch_jwks,
    introspect,
    tokens_for,
    verify_jwt,
)

WELL_KNOWN = ("/.well-known/openid-configuration", "/.well-known/oauth-authorization-server")

REQUIRED_FIELDS = (
    "issuer",
    "authorization_endpoint",
    "token_endpoint",
    "userinfo_endpoint",
    "jwks_uri",
    "revocation_endpoint",
    "introspection_endpoint",
    "revocation_events_endpoint",
    "end_session_endpoint",
    "scopes_supported",
    "response_types_supported",
    "response_modes_supported",
    "grant_types_supported",
    "code_challenge_methods_supported",
    "token_endpoint_auth_methods_supported",
    "revocation_endpoint_auth_methods_supported",
    "introspection_endpoint_auth_methods_supported",
    "id_token_signing_alg_values_supported",
    "subject_types_supported",
    "claims_supported",
    "authorization_response_iss_parameter_supported",
)

PRIVATE_MEMBERS = {"d", "p", "q", "dp", "dq", "qi", "oth", "k"}


async def get_metadata(
    http: aiohttp.ClientSession, server: RunningAuthServer, path: str
) -> dict[str, Any]:
    async with http.get(server.url + path) as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        body: dict[str, Any] = await response.json()
        return body


@pytest.mark.parametrize("path", WELL_KNOWN)
async def test_metadata_at_each_well_known_path_has_every_required_field(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, path: str
) -> None:
    meta = await get_metadata(http, authserver, path)
    missing = [name for name in REQUIRED_FIELDS if name not in meta]
    assert missing == []
    issuer = authserver.settings.issuer
    assert meta["issuer"] == issuer
    assert meta["response_types_supported"] == ["code"]
    assert "query" in meta["response_modes_supported"]
    assert meta["code_challenge_methods_supported"] == ["S256"]
    assert "RS256" in meta["id_token_signing_alg_values_supported"]
    assert meta["authorization_response_iss_parameter_supported"] is True
    assert "public" in meta["subject_types_supported"]
    assert set(meta["grant_types_supported"]) == {
        "authorization_code",
        "client_credentials",
        "refresh_token",
        "urn:ietf:params:oauth:grant-type:device_code",
    }
    assert meta["device_authorization_endpoint"] == f"{issuer}/device_authorization"
    assert "password" not in meta["grant_types_supported"]
    assert "implicit" not in meta["grant_types_supported"]
    assert set(meta["token_endpoint_auth_methods_supported"]) == {
        "client_secret_basic",
        "client_secret_post",
        "private_key_jwt",
        "none",
    }
    # Every configured scope and the OpenID ones are advertised.
    assert {"openid", "profile", "email", "offline_access", "orders:read", "orders:write"} <= set(
        meta["scopes_supported"]
    )
    assert {
        "sub",
        "iss",
        "aud",
        "exp",
        "iat",
        "auth_time",
        "nonce",
        "at_hash",
        "email",
        "name",
    } <= set(meta["claims_supported"])


async def test_both_well_known_paths_serve_the_same_document(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first, second = [await get_metadata(http, authserver, path) for path in WELL_KNOWN]
    assert first == second


# The method a client uses at each endpoint, and statuses that prove the endpoint is there
# and refused only the empty request.
ENDPOINT_PROBES = {
    "authorization_endpoint": ("GET", {400}),
    "token_endpoint": ("POST", {400, 401}),
    "userinfo_endpoint": ("GET", {401}),
    "jwks_uri": ("GET", {200}),
    "revocation_endpoint": ("POST", {400, 401}),
    "introspection_endpoint": ("POST", {400, 401}),
    "revocation_events_endpoint": ("GET", {401}),
    "end_session_endpoint": ("GET", {200, 400}),
}


@pytest.mark.parametrize("field", sorted(ENDPOINT_PROBES))
async def test_every_advertised_endpoint_answers_at_its_advertised_url(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, field: str
) -> None:
    meta = await get_metadata(http, authserver, WELL_KNOWN[0])
    url = meta[field]
    assert url.startswith(authserver.settings.issuer + "/")
    method, statuses = ENDPOINT_PROBES[field]
    kwargs: dict[str, Any] = {"data": {}} if method == "POST" else {}
    async with http.request(method, url, allow_redirects=False, **kwargs) as response:
        assert response.status in statuses, (url, response.status, await response.text())


@pytest.mark.parametrize("path", WELL_KNOWN)
async def test_metadata_is_cacheable_and_revalidates_with_304(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, path: str
) -> None:
    async with http.get(authserver.url + path) as response:
        etag = response.headers["ETag"]
        assert etag.startswith('"') and etag.endswith('"')
        assert "max-age=" in response.headers["Cache-Control"]
        body = await response.read()
    async with http.get(authserver.url + path, headers={"If-None-Match": etag}) as response:
        assert response.status == 304
        assert response.headers["ETag"] == etag
        assert await response.read() == b""
    async with http.get(
        authserver.url + path, headers={"If-None-Match": '"something-else"'}
    ) as response:
        assert response.status == 200
        assert await response.read() == body


@pytest.mark.parametrize("path", [WELL_KNOWN[0], "/jwks"])
async def test_if_none_match_uses_the_weak_comparison_over_a_list_of_tags(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, path: str
) -> None:
    async with http.get(authserver.url + path) as response:
        etag = response.headers["ETag"]
    for header in ("*", f'"other", {etag}', f"W/{etag}", f' "x" ,W/{etag} '):
        async with http.get(authserver.url + path, headers={"If-None-Match": header}) as response:
            assert response.status == 304, header
    # Tags that differ from ours by one character do not match.
    for header in (f'"x{etag[1:]}', etag[:-1] + 'x"'):
        async with http.get(authserver.url + path, headers={"If-None-Match": header}) as response:
            assert response.status == 200, header


async def test_metadata_of_an_issuer_with_a_path_names_endpoints_under_that_path(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["issuer"] = "http://127.0.0.1:{port}/tenant"
    server = await start_authserver(config)
    meta = await get_metadata(http, server, "/tenant/.well-known/openid-configuration")
    assert meta["issuer"] == server.settings.issuer
    assert meta["token_endpoint"] == server.settings.issuer + "/token"
    status, body = await client_credentials(http, server)
    assert status == 200
    assert (await verify_jwt(http, server, body["access_token"]))["iss"] == server.settings.issuer


async def test_oauth_metadata_of_an_issuer_with_a_path_is_at_the_rfc_8414_location(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["issuer"] = "http://127.0.0.1:{port}/tenant"
    server = await start_authserver(config)
    meta = await get_metadata(http, server, "/.well-known/oauth-authorization-server/tenant")
    assert meta["issuer"] == server.settings.issuer


# Where an MCP client looks for the metadata of an issuer with a path, in its order (MCP
# authorization, "Authorization Server Metadata Discovery"): RFC 8414 §3.1 path insertion,
# then OpenID Connect Discovery with the path inserted (RFC 8414 §5), then appended.
MCP_LOCATIONS = (
    "/.well-known/oauth-authorization-server/tenant",
    "/.well-known/openid-configuration/tenant",
    "/tenant/.well-known/openid-configuration",
    "/tenant/.well-known/oauth-authorization-server",
)


async def test_every_location_an_mcp_client_tries_serves_the_one_document(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["issuer"] = "http://127.0.0.1:{port}/tenant"
    server = await start_authserver(config)
    documents = [await get_metadata(http, server, path) for path in MCP_LOCATIONS]
    assert all(document == documents[0] for document in documents)
    # RFC 8414 §3.3: identical to the issuer the client built the well-known URL from.
    assert documents[0]["issuer"] == server.settings.issuer
    assert documents[0]["code_challenge_methods_supported"] == ["S256"]
    assert documents[0]["authorization_response_iss_parameter_supported"] is True


# ---------------------------------------------------------------------------- JWKS


async def test_jwks_holds_public_keys_only_each_with_kid_use_and_alg(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    jwks = await fetch_jwks(http, authserver)
    assert set(jwks) == {"keys"}
    algs = set()
    for key in jwks["keys"]:
        assert PRIVATE_MEMBERS.isdisjoint(key), key
        assert key["use"] == "sig"
        assert key["kid"]
        algs.add(key["alg"])
        jwt.PyJWK(key)  # a usable public key
    # Access tokens (ES256) and ID tokens (RS256) by default.
    assert {"ES256", "RS256"} <= algs
    assert len({k["kid"] for k in jwks["keys"]}) == len(jwks["keys"])


async def test_jwks_keys_carry_use_and_not_key_ops(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    """RFC 7517 §4.3: `use` and `key_ops` should not be used together; `use` is the one
    every verifier reads."""
    jwks = await fetch_jwks(http, authserver)
    assert jwks["keys"]
    for key in jwks["keys"]:
        assert key["use"] == "sig"
        assert "key_ops" not in key, key


async def test_jwks_is_cacheable_and_revalidates_with_304(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(authserver.endpoint("/jwks")) as response:
        etag = response.headers["ETag"]
        assert "max-age=" in response.headers["Cache-Control"]
    async with http.get(authserver.endpoint("/jwks"), headers={"If-None-Match": etag}) as response:
        assert response.status == 304
        assert await response.read() == b""


async def test_jwks_advertised_by_discovery_verifies_issued_access_tokens(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    meta = await get_metadata(http, authserver, WELL_KNOWN[0])
    assert meta["jwks_uri"] == authserver.endpoint("/jwks")
    status, body = await client_credentials(http, authserver)
    assert status == 200
    claims = await verify_jwt(
        http, authserver, body["access_token"], audience="orders-api", typ="at+jwt"
    )
    assert claims["sub"] == "machine"


@pytest.mark.parametrize("alg", ["RS256", "EdDSA"])
async def test_configured_access_token_algorithm_is_used_and_published(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, alg: str
) -> None:
    config = default_config()
    config["keys"] = {"access_token_alg": alg}
    server = await start_authserver(config)
    status, body = await client_credentials(http, server)
    assert status == 200
    assert jwt.get_unverified_header(body["access_token"])["alg"] == alg
    claims = await verify_jwt(http, server, body["access_token"], typ="at+jwt")
    assert claims["client_id"] == "machine"
    assert (await introspect(http, server, body["access_token"]))["active"] is True


async def test_keys_are_generated_on_first_start_in_files_only_the_owner_can_read(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(fresh_keys=True)
    directory = server.services.keyring.dir
    pems = sorted(directory.glob("*.pem"))
    jwks = await fetch_jwks(http, server)
    assert {p.stem for p in pems} == {k["kid"] for k in jwks["keys"]}
    for pem in pems:
        assert stat.S_IMODE(pem.stat().st_mode) == 0o600, pem
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0
    # The metadata file lists the keys but holds nothing secret.
    metadata = json.loads((directory / "keyring.json").read_text())
    assert {entry["kid"] for entry in metadata} == {k["kid"] for k in jwks["keys"]}
    assert "PRIVATE" not in (directory / "keyring.json").read_text()


async def test_keys_persist_across_a_restart_and_earlier_tokens_stay_valid(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(fresh_keys=True)
    before = await fetch_jwks(http, server)
    status, body = await client_credentials(http, server)
    assert status == 200
    await server.restart()
    after = await fetch_jwks(http, server)
    assert sorted(k["kid"] for k in after["keys"]) == sorted(k["kid"] for k in before["keys"])
    assert after == before
    await verify_jwt(http, server, body["access_token"], typ="at+jwt")
    assert (await introspect(http, server, body["access_token"]))["active"] is True


async def test_a_retired_key_stays_published_and_valid_until_its_tokens_expire(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver()
    status, body = await client_credentials(http, server)
    assert status == 200
    old_kid = jwt.get_unverified_header(body["access_token"])["kid"]
    await server.stop()

    # Retire the access-token key offline; the next start generates a successor.
    ring = KeyRing(str(server.services.keyring.dir))
    ring.reload()
    now = time.time()
    ring.retire(old_kid, now, last_token_expiry=now + 300)
    await server.restart()

    kids = {k["kid"] for k in (await fetch_jwks(http, server))["keys"]}
    assert old_kid in kids
    status, fresh = await client_credentials(http, server)
    assert status == 200
    new_kid = jwt.get_unverified_header(fresh["access_token"])["kid"]
    assert new_kid != old_kid and new_kid in kids
    await verify_jwt(http, server, body["access_token"], typ="at+jwt")
    assert (await introspect(http, server, body["access_token"]))["active"] is True

    # Once every token it signed has expired, the key can go.
    ring = KeyRing(str(server.services.keyring.dir))
    ring.reload()
    assert ring.purge(now + 299) == []
    assert ring.purge(now + 301) == [old_kid]
    assert old_kid not in {info.kid for info in ring.infos()}
    assert not (server.services.keyring.dir / f"{old_kid}.pem").exists()


async def test_a_client_may_register_for_another_id_token_algorithm_and_rs256_stays_truthful(
    start_authserver, http
):
    config = default_config()
    config["keys"] = {"id_token_alg": "ES256"}
    spa = next(c for c in config["clients"] if c["client_id"] == "spa")
    spa["id_token_signed_response_alg"] = "EdDSA"
    server = await start_authserver(config)
    meta = await get_metadata(http, server, "/.well-known/openid-configuration")
    # RS256 is listed (OpenID Connect Discovery requires it), so a key for it is published.
    assert meta["id_token_signing_alg_values_supported"] == ["ES256", "EdDSA", "RS256"]
    published = {k["alg"] for k in (await fetch_jwks(http, server))["keys"]}
    assert {"ES256", "EdDSA", "RS256"} <= published
    body = await tokens_for(http, server, client_id="spa")
    assert jwt.get_unverified_header(body["id_token"])["alg"] == "EdDSA"
    claims = await verify_jwt(http, server, body["id_token"], audience="spa")
    assert claims["sub"] == server.subject("alice")
