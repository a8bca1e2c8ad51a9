"""DPoP (RFC 9449) at the authorization server, over real sockets: bound tokens from every
grant, each §4.3 check refused at the token endpoint, refresh tokens and codes bound to a
key, server nonces, userinfo, introspection and discovery."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client.parser import text_string_to_metric_families

from authserver import settings as authserver_settings
from portcullis.yamlconf import ConfigError
from tests.authserver.conftest import (
    SECRET,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    authorize_code,
    basic_auth,
    default_config,
    introspect,
    post_token,
    query_of,
    render_config,
)
from tests.authserver.device_support import (
    DEVICE_GRANT,
    approve_on_pages,
    device_config,
    start_device,
)
from tests.authserver.dpop_support import DpopKey
from tests.dpop_proofs import HTU_SPELLINGS, htu_spelling
from tests.dpop_proofs import DpopKey as AnyKey
from tests.support import ecdsa_twin

NONCE_SECRET = "n0nce-secret-n0nce-secret-n0nce-secret"
SCOPE = "openid profile offline_access orders:read"


def dpop_config(**changes: Any) -> dict[str, Any]:
    config = default_config()
    config["clients"] += [
        {
            "client_id": "dpop-only",
            "client_secret": SECRET,
            "grant_types": ["client_credentials"],
            "scope": "orders:read",
            "dpop_bound_access_tokens": True,
        },
    ]
    config.update(changes)
    return config


@pytest.fixture
async def server(start_authserver: StartAuthServer) -> RunningAuthServer:
    return await start_authserver(dpop_config())


async def machine_token(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    proofs: list[str] | None,
    client_id: str = "machine",
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    """client_credentials with the given DPoP headers (None: none at all)."""
    headers: Any = [("Authorization", basic_auth(client_id, SECRET))]
    headers += [("DPoP", proof) for proof in proofs or []]
    response = await http.post(
        server.endpoint("/token"), data={"grant_type": "client_credentials"}, headers=headers
    )
    return response.status, await response.json(), response


def cnf_of(token: str) -> Any:
    return jwt.decode(token, options={"verify_signature": False}).get("cnf")


async def code_tokens(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    key: DpopKey | None,
    *,
    client_id: str = "spa",
    auth: tuple[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """The code flow, its code redeemed with a proof of `key` (None: no proof)."""
    result = await authorize_code(http, server, client_id=client_id, scope=SCOPE)
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": result.verifier or "",
    }
    if auth is None:
        data["client_id"] = client_id
    headers = {"DPoP": key.proof(server.endpoint("/token"))} if key else {}
    status, body, _ = await post_token(http, server, data, auth=auth, headers=headers)
    return status, body


async def refresh(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    refresh_token: str,
    key: DpopKey | None,
    *,
    client_id: str = "spa",
    auth: tuple[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    data = {"grant_type": "refresh_token", "refresh_token": refresh_token}
    if auth is None:
        data["client_id"] = client_id
    headers = {"DPoP": key.proof(server.endpoint("/token"))} if key else {}
    status, body, _ = await post_token(http, server, data, auth=auth, headers=headers)
    return status, body


# ---------------------------------------------------------------------------- token endpoint


async def test_a_valid_proof_gets_a_dpop_token_bound_to_the_proofs_key(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    status, body, _ = await machine_token(http, server, [key.proof(server.endpoint("/token"))])
    assert status == 200, body
    assert body["token_type"] == "DPoP"
    assert cnf_of(body["access_token"]) == {"jkt": key.jkt}


async def test_without_a_proof_the_token_is_a_bearer_token(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await machine_token(http, server, None)
    assert status == 200, body
    assert body["token_type"] == "Bearer"
    assert cnf_of(body["access_token"]) is None
    assert "DPoP-Nonce" not in response.headers  # nonces are off by default


@pytest.mark.parametrize("alg", ["ES256", "ES384", "ES512", "PS256", "RS256", "EdDSA"])
async def test_a_proof_of_each_allowed_algorithm_binds_the_token_to_its_key(
    server: RunningAuthServer, http: aiohttp.ClientSession, alg: str
) -> None:
    key = AnyKey(alg)  # thumbprints computed by the test's own code
    status, body, _ = await machine_token(
        http, server, [key.proof("POST", server.endpoint("/token"))]
    )
    assert status == 200, body
    assert cnf_of(body["access_token"]) == {"jkt": key.jkt}


async def test_a_proof_whose_key_is_not_of_its_alg_is_refused(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    es384 = AnyKey("ES384")
    proof = es384.proof(
        "POST", server.endpoint("/token"), header={"alg": "ES256"}, sign_alg="ES384"
    )
    status, body, _ = await machine_token(http, server, [proof])
    assert (status, body["error"]) == (400, "invalid_dpop_proof")


async def test_htu_with_a_query_and_fragment_still_matches(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    proof = key.proof(server.endpoint("/token") + "?a=b#c")
    status, body, _ = await machine_token(http, server, [proof])
    assert status == 200, body


@pytest.mark.parametrize("case", sorted(HTU_SPELLINGS))
async def test_htu_is_compared_after_normalisation_as_the_gateway_compares_it(
    server: RunningAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    # One table for both services (tests/dpop_proofs.py): dot segments removed and
    # percent-encoded unreserved characters decoded (RFC 3986 §6.2.2) before comparing; a
    # control character or a space makes no URI, never one that matches once stripped.
    htu, same = htu_spelling(case, server.endpoint("/token"))
    status, body, _ = await machine_token(http, server, [DpopKey().proof(htu)])
    if same:
        assert status == 200, body
        return
    assert (status, body["error"]) == (400, "invalid_dpop_proof")
    assert body["error_description"] == "the DPoP proof is for another URI"  # the gateway's


OTHER_KEY = ec.generate_private_key(ec.SECP256R1())


def _bad_proofs(key: DpopKey, url: str) -> dict[str, list[str]]:
    """One proof (or header list) failing each check of RFC 9449 §4.3."""
    private_jwk = {**key.jwk, "d": "AAAA"}
    hs_jwk = {"kty": "oct", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA"}
    return {
        "two-headers": [key.proof(url), key.proof(url)],
        "not-a-jwt": ["not.a.jwt"],
        "typ-jwt": [key.proof(url, header={"typ": "JWT"})],
        "alg-none": [jwt.encode({"jti": "x", "htm": "POST", "htu": url, "iat": 1}, None,
                                algorithm="none", headers={"typ": "dpop+jwt", "jwk": key.jwk})],
        "alg-hs256": [jwt.encode({"jti": "y", "htm": "POST", "htu": url}, "secret-" * 5,
                                 algorithm="HS256", headers={"typ": "dpop+jwt", "jwk": hs_jwk})],
        "private-key-in-jwk": [key.proof(url, header={"jwk": private_jwk})],
        "no-jwk": [key.proof(url, header={"jwk": None})],
        "signed-by-another-key": [key.proof(url, signer=OTHER_KEY)],
        "htm-get": [key.proof(url, htm="GET")],
        "htu-other-endpoint": [key.proof(url.replace("/token", "/userinfo"))],
        "htu-other-host": [key.proof(url.replace("127.0.0.1", "localhost"))],
        "iat-stale": [key.proof(url, iat=time.time() - 120)],
        "iat-future": [key.proof(url, iat=time.time() + 60)],
        "no-jti": [key.proof(url, jti=None)],
        "no-iat": [key.proof(url, omit=("iat",))],
    }  # fmt: skip


BAD = list(_bad_proofs(DpopKey(), "http://127.0.0.1:1/token"))


@pytest.mark.parametrize("case", BAD)
async def test_each_failed_proof_check_is_invalid_dpop_proof(
    server: RunningAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    proofs = _bad_proofs(DpopKey(), server.endpoint("/token"))[case]
    status, body, _ = await machine_token(http, server, proofs)
    assert status == 400, body
    assert body["error"] == "invalid_dpop_proof"


async def test_a_replayed_proof_is_refused(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    proof = DpopKey().proof(server.endpoint("/token"))
    status, _, _ = await machine_token(http, server, [proof])
    assert status == 200
    status, body, _ = await machine_token(http, server, [proof])
    assert (status, body["error"]) == (400, "invalid_dpop_proof")


@pytest.mark.parametrize("alg", ["ES256", "ES384", "ES512"])
async def test_the_ecdsa_twin_of_a_used_proof_is_refused_as_a_replay(
    server: RunningAuthServer, http: aiohttp.ClientSession, alg: str
) -> None:
    # (r, n - s) verifies as well as (r, s), and clients sign either spelling (WebCrypto: a
    # high S half the time), so both pass the checks; but the replay cache keeps the key's
    # thumbprint and the jti, never the signature: a proof's twin is that proof used again.
    key = AnyKey(alg)
    used = "the DPoP proof was already used"
    proof = key.proof("POST", server.endpoint("/token"))
    assert (await machine_token(http, server, [ecdsa_twin(proof)]))[0] == 200
    status, body, _ = await machine_token(http, server, [proof])
    assert (status, body["error"], body["error_description"]) == (400, "invalid_dpop_proof", used)
    other = key.proof("POST", server.endpoint("/token"))
    assert (await machine_token(http, server, [other]))[0] == 200
    status, body, _ = await machine_token(http, server, [ecdsa_twin(other)])
    assert (status, body["error"], body["error_description"]) == (400, "invalid_dpop_proof", used)


async def test_of_one_proof_sent_many_times_at_once_exactly_one_is_accepted(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    proof = DpopKey().proof(server.endpoint("/token"))
    answers = await asyncio.gather(*(machine_token(http, server, [proof]) for _ in range(10)))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200] + [400] * 9


async def test_a_proof_is_used_up_only_once_the_client_is_authenticated(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    proof = DpopKey().proof(server.endpoint("/token"))
    response = await http.post(
        server.endpoint("/token"),
        data={"grant_type": "client_credentials"},
        headers={"Authorization": basic_auth("machine", "wrong-" + SECRET), "DPoP": proof},
    )
    assert response.status == 401
    status, body, _ = await machine_token(http, server, [proof])
    assert status == 200, body
    status, body, _ = await machine_token(http, server, [proof])
    assert (status, body["error"]) == (400, "invalid_dpop_proof")


async def test_proofs_are_counted_by_endpoint_and_result(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    proof = key.proof(server.endpoint("/token"))
    assert (await machine_token(http, server, [proof]))[0] == 200
    assert (await machine_token(http, server, [proof]))[0] == 400  # replayed
    assert (await machine_token(http, server, [key.proof(server.endpoint("/x"))]))[0] == 400

    exposition = server.services.token.dpop.metrics.exposition().decode()
    counted = {
        (s.labels["endpoint"], s.labels["result"]): s.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "portcullis_authserver_dpop_proofs"
        for s in family.samples
    }
    assert counted == {
        ("token", "accepted"): 1,
        ("token", "replayed"): 1,
        ("token", "invalid"): 1,
    }


async def test_a_replay_is_caught_by_another_server_on_the_same_database(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    first = await start_authserver(dpop_config(storage=shared))
    second = await start_authserver(dpop_config(storage=shared, issuer=first.settings.issuer))
    proof = DpopKey().proof(first.endpoint("/token"))
    status, _, _ = await machine_token(http, first, [proof])
    assert status == 200
    response = await http.post(
        second.url + "/token",
        data={"grant_type": "client_credentials"},
        headers={"Authorization": basic_auth("machine", SECRET), "DPoP": proof},
    )
    assert response.status == 400
    assert (await response.json())["error"] == "invalid_dpop_proof"


async def test_a_client_registered_for_bound_tokens_must_send_a_proof(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await machine_token(http, server, None, client_id="dpop-only")
    assert (status, body["error"]) == (400, "invalid_dpop_proof")
    key = DpopKey()
    proof = key.proof(server.endpoint("/token"))
    status, body, _ = await machine_token(http, server, [proof], client_id="dpop-only")
    assert status == 200 and body["token_type"] == "DPoP", body


# ---------------------------------------------------------------------------- refresh binding


async def test_a_public_clients_refresh_token_is_bound_to_the_key(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    status, tokens = await code_tokens(http, server, key)
    assert status == 200, tokens
    assert tokens["token_type"] == "DPoP"
    assert cnf_of(tokens["access_token"]) == {"jkt": key.jkt}

    # Another key, or none: refused, and nothing changes for the key's holder.
    status, body = await refresh(http, server, tokens["refresh_token"], DpopKey())
    assert (status, body["error"]) == (400, "invalid_grant")
    status, body = await refresh(http, server, tokens["refresh_token"], None)
    assert (status, body["error"]) == (400, "invalid_dpop_proof")

    status, renewed = await refresh(http, server, tokens["refresh_token"], key)
    assert status == 200, renewed
    assert renewed["token_type"] == "DPoP"
    assert cnf_of(renewed["access_token"]) == {"jkt": key.jkt}
    # The successor keeps the binding.
    status, body = await refresh(http, server, renewed["refresh_token"], DpopKey())
    assert (status, body["error"]) == (400, "invalid_grant")
    status, body = await refresh(http, server, renewed["refresh_token"], key)
    assert status == 200, body


async def test_a_confidential_clients_refresh_token_is_not_bound_but_its_access_tokens_are(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    auth = ("web", SECRET)
    key = DpopKey()
    status, tokens = await code_tokens(http, server, key, client_id="web", auth=auth)
    assert status == 200 and tokens["token_type"] == "DPoP", tokens

    status, plain = await refresh(http, server, tokens["refresh_token"], None, auth=auth)
    assert status == 200, plain
    assert plain["token_type"] == "Bearer" and cnf_of(plain["access_token"]) is None

    other = DpopKey()
    status, rebound = await refresh(http, server, plain["refresh_token"], other, auth=auth)
    assert status == 200, rebound
    assert cnf_of(rebound["access_token"]) == {"jkt": other.jkt}


async def test_a_retry_within_the_grace_is_answered_only_with_the_same_key(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    auth = ("web", SECRET)
    key = DpopKey()
    status, tokens = await code_tokens(http, server, key, client_id="web", auth=auth)
    assert status == 200, tokens
    status, first = await refresh(http, server, tokens["refresh_token"], key, auth=auth)
    assert status == 200, first

    # The same refresh token again within refresh_grace: another key gets nothing...
    status, body = await refresh(http, server, tokens["refresh_token"], DpopKey(), auth=auth)
    assert (status, body["error"]) == (400, "invalid_grant")
    status, body = await refresh(http, server, tokens["refresh_token"], None, auth=auth)
    assert (status, body["error"]) == (400, "invalid_grant")
    # ... and the key the lost response was bound to gets it again.
    status, again = await refresh(http, server, tokens["refresh_token"], key, auth=auth)
    assert status == 200, again
    assert again["refresh_token"] == first["refresh_token"]
    assert cnf_of(again["access_token"]) == {"jkt": key.jkt}


async def test_an_unbound_public_refresh_token_stays_unbound(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, tokens = await code_tokens(http, server, None)
    assert status == 200 and tokens["token_type"] == "Bearer", tokens
    key = DpopKey()
    status, bound = await refresh(http, server, tokens["refresh_token"], key)
    assert status == 200 and cnf_of(bound["access_token"]) == {"jkt": key.jkt}, bound
    status, plain = await refresh(http, server, bound["refresh_token"], None)
    assert status == 200 and plain["token_type"] == "Bearer", plain


# ---------------------------------------------------------------------------- dpop_jkt


async def test_a_code_bound_with_dpop_jkt_is_redeemed_only_with_that_key(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    result = await authorize_code(http, server, scope=SCOPE, extra={"dpop_jkt": key.jkt})
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": result.verifier or "",
        "client_id": "spa",
    }
    url = server.endpoint("/token")
    status, body, _ = await post_token(http, server, data)
    assert (status, body["error"]) == (400, "invalid_dpop_proof")
    status, body, _ = await post_token(http, server, data, headers={"DPoP": DpopKey().proof(url)})
    assert (status, body["error"]) == (400, "invalid_grant")
    # Neither attempt used the code up.
    status, body, _ = await post_token(http, server, data, headers={"DPoP": key.proof(url)})
    assert status == 200, body
    assert cnf_of(body["access_token"]) == {"jkt": key.jkt}


async def test_a_malformed_dpop_jkt_is_an_invalid_request(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    response = await http.get(
        server.endpoint("/authorize"),
        params={
            "response_type": "code",
            "client_id": "spa",
            "redirect_uri": "http://127.0.0.1/cb",
            "scope": "openid",
            "code_challenge": "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM",
            "code_challenge_method": "S256",
            "dpop_jkt": "not-a-thumbprint",
        },
        allow_redirects=False,
    )
    assert response.status in (302, 303)
    assert query_of(response.headers["Location"])["error"] == "invalid_request"


# ---------------------------------------------------------------------------- device grant


async def test_the_device_grant_binds_its_tokens_to_the_proof(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(device_config())
    status, started, _ = await start_device(http, server)
    assert status == 200, started
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        await approve_on_pages(browser, server, started["verification_uri_complete"])
    key = DpopKey()
    data = {"grant_type": DEVICE_GRANT, "device_code": started["device_code"], "client_id": "tv"}
    headers = {"DPoP": key.proof(server.endpoint("/token"))}
    status, tokens, _ = await post_token(http, server, data, headers=headers)
    assert status == 200, tokens
    assert cnf_of(tokens["access_token"]) == {"jkt": key.jkt}
    status, body = await refresh(http, server, tokens["refresh_token"], DpopKey(), client_id="tv")
    assert (status, body["error"]) == (400, "invalid_grant")


# ---------------------------------------------------------------------------- nonces


async def test_with_nonces_required_a_proof_without_one_is_told_the_nonce_to_use(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, server: RunningAuthServer
) -> None:
    # `server` started first: the signing keys its start made exist before this clock does.
    clock = MovableClock()
    server = await start_authserver(
        dpop_config(dpop={"nonce": True, "nonce_key": NONCE_SECRET}), clock=clock
    )
    key = DpopKey()
    url = server.endpoint("/token")
    status, body, response = await machine_token(http, server, [key.proof(url, iat=clock.now)])
    assert (status, body["error"]) == (400, "use_dpop_nonce")
    nonce = response.headers["DPoP-Nonce"]

    proof = key.proof(url, nonce=nonce, iat=clock.now)
    status, body, response = await machine_token(http, server, [proof])
    assert status == 200, body
    assert body["token_type"] == "DPoP"
    assert response.headers["DPoP-Nonce"]

    wrong = key.proof(url, nonce=nonce[:-2] + "AA", iat=clock.now)
    status, body, _ = await machine_token(http, server, [wrong])
    assert (status, body["error"]) == (400, "use_dpop_nonce")

    clock.advance(5 * 60 + 1)  # past nonce_lifetime since it was made: expired
    late = key.proof(url, nonce=nonce, iat=clock.now)
    status, body, response = await machine_token(http, server, [late])
    assert (status, body["error"]) == (400, "use_dpop_nonce")
    assert response.headers["DPoP-Nonce"] != nonce


async def test_a_nonce_challenge_uses_up_neither_the_code_nor_the_proof_of_the_next_try(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(dpop_config(dpop={"nonce": True, "nonce_key": NONCE_SECRET}))
    key = DpopKey()
    result = await authorize_code(http, server, scope=SCOPE)
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": result.verifier or "",
        "client_id": "spa",
    }
    url = server.endpoint("/token")
    status, body, response = await post_token(http, server, data, headers={"DPoP": key.proof(url)})
    assert (status, body["error"]) == (400, "use_dpop_nonce")
    proof = key.proof(url, nonce=response.headers["DPoP-Nonce"])
    status, body, _ = await post_token(http, server, data, headers={"DPoP": proof})
    assert status == 200, body


async def test_nonces_of_one_replica_are_accepted_by_another_with_the_same_secret(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    dpop = {"nonce": True, "nonce_key": NONCE_SECRET}
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    first = await start_authserver(dpop_config(dpop=dpop, storage=shared))
    second = await start_authserver(
        dpop_config(dpop=dpop, storage=shared, issuer=first.settings.issuer)
    )
    _, _, response = await machine_token(http, first, [DpopKey().proof(first.endpoint("/token"))])
    nonce = response.headers["DPoP-Nonce"]
    proof = DpopKey().proof(first.endpoint("/token"), nonce=nonce)
    response = await http.post(
        second.url + "/token",
        data={"grant_type": "client_credentials"},
        headers={"Authorization": basic_auth("machine", SECRET), "DPoP": proof},
    )
    assert response.status == 200, await response.text()


def test_required_nonces_need_a_shared_secret(tmp_path: Any) -> None:
    text = render_config(dpop_config(dpop={"nonce": True}), tmp_path, 9999)
    with pytest.raises(ConfigError, match="nonce_key"):
        authserver_settings.load_text(text)
    short = dpop_config(dpop={"nonce": True, "nonce_key": "short"})
    with pytest.raises(ConfigError, match="32"):
        authserver_settings.load_text(render_config(short, tmp_path, 9999))
    # A nonce is handed out for a quarter of its lifetime, in whole seconds.
    brief = dpop_config(dpop={"nonce": True, "nonce_key": NONCE_SECRET, "nonce_lifetime": "3s"})
    with pytest.raises(ConfigError, match="nonce_lifetime"):
        authserver_settings.load_text(render_config(brief, tmp_path, 9999))


# ---------------------------------------------------------------------------- userinfo


async def userinfo(
    http: aiohttp.ClientSession, server: RunningAuthServer, headers: Any
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    response = await http.get(server.endpoint("/userinfo"), headers=headers)
    return response.status, await response.json(), response


@pytest.fixture
async def bound(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> tuple[DpopKey, dict[str, Any]]:
    key = DpopKey()
    status, tokens = await code_tokens(http, server, key)
    assert status == 200, tokens
    return key, tokens


async def test_userinfo_accepts_a_bound_token_with_a_proof_of_its_key(
    server: RunningAuthServer, http: aiohttp.ClientSession, bound: tuple[DpopKey, dict[str, Any]]
) -> None:
    key, tokens = bound
    token = tokens["access_token"]
    proof = key.proof(server.endpoint("/userinfo"), "GET", access_token=token)
    status, body, _ = await userinfo(
        http, server, {"Authorization": f"DPoP {token}", "DPoP": proof}
    )
    assert status == 200, body
    assert body["sub"] == server.subject("alice")


async def test_userinfo_with_nonces_required_challenges_for_one(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(dpop_config(dpop={"nonce": True, "nonce_key": NONCE_SECRET}))
    key = DpopKey()
    url = server.endpoint("/token")
    _, _, first = await machine_token(http, server, [key.proof(url)])
    result = await authorize_code(http, server, scope=SCOPE)
    data = {
        "grant_type": "authorization_code",
        "code": result.code,
        "redirect_uri": result.redirect_uri,
        "code_verifier": result.verifier or "",
        "client_id": "spa",
    }
    proof = key.proof(url, nonce=first.headers["DPoP-Nonce"])
    status, tokens, _ = await post_token(http, server, data, headers={"DPoP": proof})
    assert status == 200, tokens
    token = tokens["access_token"]

    info = server.endpoint("/userinfo")
    headers = {"Authorization": f"DPoP {token}", "DPoP": key.proof(info, "GET", access_token=token)}
    status, body, response = await userinfo(http, server, headers)
    assert (status, body["error"]) == (401, "use_dpop_nonce")
    assert 'error="use_dpop_nonce"' in response.headers["WWW-Authenticate"]
    nonce = response.headers["DPoP-Nonce"]
    headers["DPoP"] = key.proof(info, "GET", access_token=token, nonce=nonce)
    status, body, _ = await userinfo(http, server, headers)
    assert status == 200, body


async def test_userinfo_refuses_a_bound_token_sent_as_bearer(
    server: RunningAuthServer, http: aiohttp.ClientSession, bound: tuple[DpopKey, dict[str, Any]]
) -> None:
    key, tokens = bound
    token = tokens["access_token"]
    proof = key.proof(server.endpoint("/userinfo"), "GET", access_token=token)
    for headers in (
        {"Authorization": f"Bearer {token}"},
        {"Authorization": f"Bearer {token}", "DPoP": proof},
    ):
        status, body, response = await userinfo(http, server, headers)
        assert (status, body["error"]) == (401, "invalid_token")
        challenge = response.headers["WWW-Authenticate"]
        assert challenge.startswith("DPoP ") and 'error="invalid_token"' in challenge
        assert 'algs="ES256' in challenge


@pytest.mark.parametrize(
    "case", ["no-proof", "wrong-ath", "no-ath", "other-key", "token-endpoint-htu", "post-htm"]
)
async def test_userinfo_refuses_a_proof_that_does_not_fit_the_request(
    server: RunningAuthServer,
    http: aiohttp.ClientSession,
    bound: tuple[DpopKey, dict[str, Any]],
    case: str,
) -> None:
    key, tokens = bound
    token = tokens["access_token"]
    url = server.endpoint("/userinfo")
    proofs = {
        "no-proof": None,
        "wrong-ath": key.proof(url, "GET", access_token=token + "x"),
        "no-ath": key.proof(url, "GET"),
        "other-key": DpopKey().proof(url, "GET", access_token=token),
        "token-endpoint-htu": key.proof(server.endpoint("/token"), "GET", access_token=token),
        "post-htm": key.proof(url, "POST", access_token=token),
    }
    headers = {"Authorization": f"DPoP {token}"}
    if proofs[case] is not None:
        headers["DPoP"] = str(proofs[case])
    status, body, response = await userinfo(http, server, headers)
    assert (status, body["error"]) == (401, "invalid_dpop_proof")
    assert response.headers["WWW-Authenticate"].startswith("DPoP ")


async def test_userinfo_refuses_an_unbound_token_under_the_dpop_scheme(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, tokens = await code_tokens(http, server, None)
    assert status == 200, tokens
    key, token = DpopKey(), tokens["access_token"]
    proof = key.proof(server.endpoint("/userinfo"), "GET", access_token=token)
    status, body, _ = await userinfo(
        http, server, {"Authorization": f"DPoP {token}", "DPoP": proof}
    )
    assert (status, body["error"]) == (401, "invalid_token")
    # As a bearer token it still works.
    status, body, _ = await userinfo(http, server, {"Authorization": f"Bearer {token}"})
    assert status == 200, body


async def test_userinfo_without_a_token_offers_both_schemes(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    response = await http.get(server.endpoint("/userinfo"))
    assert response.status == 401
    challenges = response.headers.getall("WWW-Authenticate")
    assert any(c.startswith("Bearer ") for c in challenges)
    assert any(c.startswith("DPoP ") and "algs=" in c for c in challenges)


# ------------------------------------------------------------------ introspection, discovery


async def test_introspection_reports_the_binding(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    _, bound_body, _ = await machine_token(http, server, [key.proof(server.endpoint("/token"))])
    answer = await introspect(http, server, bound_body["access_token"])
    assert answer["active"] is True
    assert answer["token_type"] == "DPoP"
    assert answer["cnf"] == {"jkt": key.jkt}

    _, plain_body, _ = await machine_token(http, server, None)
    answer = await introspect(http, server, plain_body["access_token"])
    assert answer["token_type"] == "Bearer" and "cnf" not in answer


async def test_introspection_reports_the_key_a_refresh_token_is_bound_to(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    status, bound = await code_tokens(http, server, key)
    assert status == 200, bound
    answer = await introspect(http, server, bound["refresh_token"], token_type_hint="refresh_token")
    assert answer["active"] is True and answer["cnf"] == {"jkt": key.jkt}
    status, plain = await code_tokens(http, server, None)
    assert status == 200, plain
    answer = await introspect(http, server, plain["refresh_token"], token_type_hint="refresh_token")
    assert answer["active"] is True and "cnf" not in answer


async def test_discovery_lists_the_proof_algorithms(
    server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(server.endpoint("/.well-known/openid-configuration")) as response:
        document = await response.json()
    algs = document["dpop_signing_alg_values_supported"]
    assert "ES256" in algs and "EdDSA" in algs
    assert not {a for a in algs if a == "none" or a.startswith("HS")}
