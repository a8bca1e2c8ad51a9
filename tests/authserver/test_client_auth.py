"""Client authentication at the token endpoint: client_secret_basic (form-url-encoded parts),
client_secret_post, private_key_jwt (RFC 7523) and none, one method at a time, each client
only with the method it registered."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from tests.authserver.conftest import (
    CLIENT_KEY,
    CLIENT_KID,
    JWT_BEARER,
    SECRET,
    RunningAuthServer,
    StartAuthServer,
    authorize_code,
    client_assertion,
    default_config,
    post_token,
)
from tests.support import ecdsa_twin

CC = {"grant_type": "client_credentials"}
BASIC_CHALLENGE = 'Basic realm="portcullis", charset="UTF-8"'

ODD_ID = "svc:a+b%2F/c&d"
ODD_SECRET = "p@ss:word +plus/slash%25percent&amp=0123456789"


def assert_invalid_client(
    status: int, body: dict[str, Any], response: aiohttp.ClientResponse, *, basic: bool
) -> None:
    assert (status, body["error"]) == (401, "invalid_client"), body
    assert set(body) == {"error", "error_description"}
    assert response.headers["Cache-Control"] == "no-store"
    if basic:
        assert response.headers["WWW-Authenticate"] == BASIC_CHALLENGE
    else:
        assert "WWW-Authenticate" not in response.headers
    assert "access_token" not in body


async def token_with_assertion(
    http: aiohttp.ClientSession, server: RunningAuthServer, assertion: str, **extra: str
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    return await post_token(
        http,
        server,
        {**CC, "client_assertion_type": JWT_BEARER, "client_assertion": assertion, **extra},
    )


# ---------------------------------------------------------------------------- secrets


async def test_basic_credentials_are_form_url_decoded_before_comparison(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["clients"].append(
        {
            "client_id": ODD_ID,
            "client_secret": ODD_SECRET,
            "grant_types": ["client_credentials"],
            "scope": "orders:read",
        }
    )
    server = await start_authserver(config)
    status, body, _ = await post_token(http, server, CC, auth=(ODD_ID, ODD_SECRET))
    assert status == 200, body
    assert (
        jwt.decode(body["access_token"], options={"verify_signature": False})["client_id"] == ODD_ID
    )
    # The same secret sent without the encoding the RFC asks for does not match.
    raw = "Basic " + base64.b64encode(f"{ODD_ID}:{ODD_SECRET}".encode()).decode()
    status, body, response = await post_token(http, server, CC, headers={"Authorization": raw})
    assert_invalid_client(status, body, response, basic=True)


async def test_basic_with_the_right_secret_is_accepted(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await post_token(http, authserver, CC, auth=("machine", SECRET))
    assert status == 200, body


async def test_basic_with_a_matching_client_id_in_the_form_is_accepted(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await post_token(
        http, authserver, {**CC, "client_id": "machine"}, auth=("machine", SECRET)
    )
    assert status == 200, body


async def test_basic_with_another_client_id_in_the_form_is_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(
        http, authserver, {**CC, "client_id": "machine-post"}, auth=("machine", SECRET)
    )
    assert_invalid_client(status, body, response, basic=True)


@pytest.mark.parametrize(
    ("client_id", "secret"),
    [
        ("machine", SECRET[:-1] + "X"),
        ("machine", ""),
        ("machine", SECRET + "0"),
        ("nobody", SECRET),
    ],
)
async def test_wrong_secret_or_unknown_client_over_basic_is_401_with_a_basic_challenge(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, client_id: str, secret: str
) -> None:
    status, body, response = await post_token(http, authserver, CC, auth=(client_id, secret))
    assert_invalid_client(status, body, response, basic=True)


@pytest.mark.parametrize(
    "value", ["Basic !!!not-base64!!!", "Basic " + base64.b64encode(b"no-colon").decode(), "Basic "]
)
async def test_malformed_basic_credentials_are_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, value: str
) -> None:
    status, body, response = await post_token(
        http, authserver, CC, headers={"Authorization": value}
    )
    assert_invalid_client(status, body, response, basic=True)


async def test_client_secret_post_is_accepted_for_a_post_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await post_token(
        http, authserver, {**CC, "client_id": "machine-post", "client_secret": SECRET}
    )
    assert status == 200, body


async def test_wrong_secret_in_the_form_is_401_without_a_basic_challenge(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(
        http, authserver, {**CC, "client_id": "machine-post", "client_secret": "wrong" * 8}
    )
    assert_invalid_client(status, body, response, basic=False)


async def test_a_client_must_use_the_secret_method_it_registered(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(
        http, authserver, {**CC, "client_id": "machine", "client_secret": SECRET}
    )
    assert_invalid_client(status, body, response, basic=False)
    status, body, response = await post_token(http, authserver, CC, auth=("machine-post", SECRET))
    assert_invalid_client(status, body, response, basic=True)


async def test_client_secret_without_client_id_is_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(http, authserver, {**CC, "client_secret": SECRET})
    assert_invalid_client(status, body, response, basic=False)


async def test_no_client_authentication_at_all_is_401_with_a_challenge(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(http, authserver, CC)
    assert_invalid_client(status, body, response, basic=True)


@pytest.mark.parametrize(
    ("form", "auth"),
    [
        ({"client_id": "machine", "client_secret": SECRET}, ("machine", SECRET)),
        ({"client_assertion_type": JWT_BEARER, "client_assertion": "a.b.c"}, ("machine", SECRET)),
        (
            {
                "client_id": "machine-post",
                "client_secret": SECRET,
                "client_assertion_type": JWT_BEARER,
                "client_assertion": "a.b.c",
            },
            None,
        ),
    ],
)
async def test_two_authentication_methods_in_one_request_are_invalid_request(
    authserver: RunningAuthServer,
    http: aiohttp.ClientSession,
    form: dict[str, str],
    auth: tuple[str, str] | None,
) -> None:
    status, body, response = await post_token(http, authserver, {**CC, **form}, auth=auth)
    assert (status, body["error"]) == (400, "invalid_request"), body
    assert response.headers["Cache-Control"] == "no-store"


# ---------------------------------------------------------------------------- none


async def test_public_client_identifies_with_client_id_alone(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, authserver)
    status, body, _ = await post_token(
        http,
        authserver,
        {
            "grant_type": "authorization_code",
            "code": result.code,
            "redirect_uri": result.redirect_uri,
            "code_verifier": result.verifier or "",
            "client_id": "spa",
        },
    )
    assert status == 200, body


async def test_confidential_client_cannot_fall_back_to_none(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(http, authserver, {**CC, "client_id": "machine"})
    assert_invalid_client(status, body, response, basic=False)
    result = await authorize_code(http, authserver, client_id="web", scope="openid")
    status, body, response = await post_token(
        http,
        authserver,
        {
            "grant_type": "authorization_code",
            "code": result.code,
            "redirect_uri": result.redirect_uri,
            "code_verifier": result.verifier or "",
            "client_id": "web",
        },
    )
    assert_invalid_client(status, body, response, basic=False)


async def test_public_client_presenting_a_secret_is_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(
        http,
        authserver,
        {
            "grant_type": "refresh_token",
            "refresh_token": "x",
            "client_id": "spa",
            "client_secret": SECRET,
        },
    )
    assert_invalid_client(status, body, response, basic=False)


# ---------------------------------------------------------------------------- private_key_jwt


@pytest.mark.parametrize("shape", ["string", "one_element_array"])
async def test_private_key_jwt_with_the_issuer_as_its_audience_is_accepted(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, shape: str
) -> None:
    issuer = authserver.settings.issuer
    aud: str | list[str] = issuer if shape == "string" else [issuer]
    status, body, _ = await token_with_assertion(http, authserver, client_assertion("", aud=aud))
    assert status == 200, body
    assert (
        jwt.decode(body["access_token"], options={"verify_signature": False})["sub"]
        == "machine-jwt"
    )


async def test_private_key_jwt_with_client_id_in_the_form_is_accepted(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await token_with_assertion(
        http, authserver, client_assertion(authserver.settings.issuer), client_id="machine-jwt"
    )
    assert status == 200, body


def audiences(server: RunningAuthServer, case: str) -> str | list[str]:
    """The `aud` of an assertion in the shapes of the audience injection attack on client
    assertions, and the token endpoint URL that compat lets through alone."""
    issuer, token_endpoint = server.settings.issuer, server.endpoint("/token")
    return {
        "foreign_and_issuer": ["https://other.example", issuer],
        "issuer_and_foreign": [issuer, "https://other.example"],
        "issuer_and_token_endpoint": [issuer, token_endpoint],
        "issuer_twice": [issuer, issuer],
        "empty_array": [],
        "introspection_endpoint": server.endpoint("/introspect"),
        "issuer_with_a_slash": issuer + "/",
        "token_endpoint": token_endpoint,
        "token_endpoint_in_an_array": [token_endpoint],
    }[case]


COMPAT_REFUSES = [
    "foreign_and_issuer",
    "issuer_and_foreign",
    "issuer_and_token_endpoint",
    "issuer_twice",
    "empty_array",
    "introspection_endpoint",
    "issuer_with_a_slash",
]


@pytest.mark.parametrize("case", [*COMPAT_REFUSES, "token_endpoint", "token_endpoint_in_an_array"])
async def test_private_key_jwt_with_an_audience_other_than_the_issuer_alone_is_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    # draft-ietf-oauth-rfc7523bis: the issuer identifier is the assertion's sole audience.
    # A list naming someone else beside this server is what an assertion obtained for
    # another server looks like; the token endpoint URL is what such a server can name
    # as its own endpoint.
    assertion = client_assertion("", aud=audiences(authserver, case))
    status, body, response = await token_with_assertion(http, authserver, assertion)
    assert_invalid_client(status, body, response, basic=False)


@pytest.mark.parametrize("case", ["token_endpoint", "token_endpoint_in_an_array"])
async def test_client_assertion_audience_compat_also_takes_the_token_endpoint_alone(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    config = default_config()
    config["client_assertion_audience"] = "compat"
    server = await start_authserver(config)
    assertion = client_assertion("", aud=audiences(server, case))
    status, body, _ = await token_with_assertion(http, server, assertion)
    assert status == 200, body
    status, body, _ = await token_with_assertion(
        http, server, client_assertion(server.settings.issuer)
    )
    assert status == 200, body


@pytest.mark.parametrize("case", COMPAT_REFUSES)
async def test_client_assertion_audience_compat_still_refuses_every_other_audience(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    config = default_config()
    config["client_assertion_audience"] = "compat"
    server = await start_authserver(config)
    assertion = client_assertion("", aud=audiences(server, case))
    status, body, response = await token_with_assertion(http, server, assertion)
    assert_invalid_client(status, body, response, basic=False)


def _other_ec_key() -> Any:
    return ec.generate_private_key(ec.SECP256R1())


@pytest.mark.parametrize(
    "case",
    [
        "wrong_audience",
        "other_endpoint_audience",
        "expired",
        "exp_too_far",
        "no_exp",
        "no_jti",
        "iss_not_client",
        "sub_not_client",
        "wrong_key_same_kid",
        "unknown_kid",
        "rsa_key_under_ec_kid",
        "eddsa_key_under_ec_kid",
        "hmac_with_public_key",
        "unsigned",
        "not_a_jwt",
        "client_id_mismatch",
    ],
)
async def test_private_key_jwt_with_a_bad_assertion_is_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    issuer = authserver.settings.issuer
    extra: dict[str, str] = {}
    if case == "wrong_audience":
        assertion = client_assertion("https://someone-else.example/token")
    elif case == "other_endpoint_audience":
        assertion = client_assertion(authserver.endpoint("/userinfo"))
    elif case == "expired":
        assertion = client_assertion(issuer, now=time.time() - 600)
    elif case == "exp_too_far":  # beyond the default client_assertion_max_lifetime (1h)
        assertion = client_assertion(issuer, lifetime=3600 + 120)
    elif case == "no_exp":
        assertion = client_assertion(issuer, exp=None)
    elif case == "no_jti":
        assertion = client_assertion(issuer, jti=None)
    elif case == "iss_not_client":
        assertion = client_assertion(issuer, iss="machine")
    elif case == "sub_not_client":
        assertion = client_assertion(issuer, sub="machine")
    elif case == "wrong_key_same_kid":
        assertion = client_assertion(issuer, key=_other_ec_key())
    elif case == "unknown_kid":
        assertion = client_assertion(issuer, kid="some-other-kid")
    elif case == "rsa_key_under_ec_kid":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        assertion = jwt.encode(_claims(issuer), key, algorithm="RS256", headers={"kid": CLIENT_KID})
    elif case == "eddsa_key_under_ec_kid":
        key = ed25519.Ed25519PrivateKey.generate()
        assertion = jwt.encode(_claims(issuer), key, algorithm="EdDSA", headers={"kid": CLIENT_KID})
    elif case == "hmac_with_public_key":
        public_pem = CLIENT_KEY.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assertion = _hs256(_claims(issuer), public_pem)
    elif case == "unsigned":
        assertion = _unsigned(_claims(issuer))
    elif case == "not_a_jwt":
        assertion = "not-a-jwt"
    else:  # client_id_mismatch
        assertion = client_assertion(issuer)
        extra["client_id"] = "machine"
    status, body, response = await token_with_assertion(http, authserver, assertion, **extra)
    assert_invalid_client(status, body, response, basic=False)


async def test_private_key_jwt_assertion_cannot_be_replayed(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    assertion = client_assertion(authserver.settings.issuer)
    status, body, _ = await token_with_assertion(http, authserver, assertion)
    assert status == 200, body
    status, body, response = await token_with_assertion(http, authserver, assertion)
    assert_invalid_client(status, body, response, basic=False)
    # A fresh jti from the same client works.
    status, body, _ = await token_with_assertion(
        http, authserver, client_assertion(authserver.settings.issuer)
    )
    assert status == 200, body


async def test_the_ecdsa_twin_of_a_used_assertion_is_refused_as_a_replay(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # (r, n - s) verifies as well as (r, s), and clients sign either spelling, so both are
    # taken; but the replay cache keeps the client and the jti, never the signature: an
    # assertion's twin is that assertion used again.
    assertion = client_assertion(authserver.settings.issuer)
    status, body, _ = await token_with_assertion(http, authserver, ecdsa_twin(assertion))
    assert status == 200, body
    caplog.set_level(logging.INFO)
    status, body, response = await token_with_assertion(http, authserver, assertion)
    assert_invalid_client(status, body, response, basic=False)
    refusals = [r for r in caplog.records if r.getMessage() == "client authentication failed"]
    assert [r.__dict__["reason"] for r in refusals] == ["replayed_jti"]


@pytest.mark.parametrize(("lifetime", "accepted"), [(600, True), (660 + 60, False)])
async def test_client_assertion_max_lifetime_bounds_how_far_ahead_exp_may_be(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, lifetime: int, accepted: bool
) -> None:
    config = default_config()
    config["client_assertion_max_lifetime"] = "10m"  # pyoidc's default assertion lifetime
    server = await start_authserver(config)
    assertion = client_assertion(server.settings.issuer, lifetime=lifetime)
    status, body, response = await token_with_assertion(http, server, assertion)
    if accepted:
        assert status == 200, body
    else:
        assert_invalid_client(status, body, response, basic=False)


async def test_an_assertion_accepted_in_the_leeway_after_its_exp_cannot_be_replayed(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    """The clock leeway lets an assertion through a few seconds after its `exp`: its `jti`
    must still be remembered then, or the same assertion works twice."""
    issuer = authserver.settings.issuer
    assertion = client_assertion(issuer, now=time.time() - 70, lifetime=60)  # exp 10 s ago
    status, body, _ = await token_with_assertion(http, authserver, assertion)
    assert status == 200, body
    status, body, response = await token_with_assertion(http, authserver, assertion)
    assert_invalid_client(status, body, response, basic=False)


async def test_wrong_assertion_type_is_invalid_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(
        http,
        authserver,
        {
            **CC,
            "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:saml2-bearer",
            "client_assertion": client_assertion(authserver.settings.issuer),
        },
    )
    assert_invalid_client(status, body, response, basic=False)


async def test_private_key_jwt_client_cannot_use_a_secret_or_none(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body, response = await post_token(http, authserver, {**CC, "client_id": "machine-jwt"})
    assert_invalid_client(status, body, response, basic=False)
    status, body, response = await post_token(http, authserver, CC, auth=("machine-jwt", SECRET))
    assert_invalid_client(status, body, response, basic=True)


async def test_a_secret_client_cannot_authenticate_with_an_assertion(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    assertion = client_assertion(authserver.settings.issuer, client_id="machine")
    status, body, response = await token_with_assertion(http, authserver, assertion)
    assert_invalid_client(status, body, response, basic=False)


async def test_a_jwk_that_names_another_algorithm_is_not_used(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    for client in config["clients"]:
        if client["client_id"] == "machine-jwt":
            client["jwks"]["keys"][0]["alg"] = "ES384"
    server = await start_authserver(config)
    status, body, response = await token_with_assertion(
        http, server, client_assertion(server.settings.issuer)
    )
    assert_invalid_client(status, body, response, basic=False)


# Every algorithm a client might try: all those of RFC 7518 for its key types, and HMAC.
TRIED_ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
    "HS256",
)


async def test_the_assertion_algorithms_discovery_advertises_are_exactly_those_accepted(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    keys: dict[str, Any] = {
        "rsa": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "p256": ec.generate_private_key(ec.SECP256R1()),
        "p384": ec.generate_private_key(ec.SECP384R1()),
        "p521": ec.generate_private_key(ec.SECP521R1()),
        "ed": ed25519.Ed25519PrivateKey.generate(),
    }
    # Public halves without `alg`: each key may sign with any algorithm of its type.
    jwks = [{**_public_jwk(key), "kid": kid, "use": "sig"} for kid, key in keys.items()]
    config = default_config()
    config["clients"].append(
        {
            "client_id": "multi-alg",
            "token_endpoint_auth_method": "private_key_jwt",
            "jwks": {"keys": jwks},
            "grant_types": ["client_credentials"],
            "scope": "orders:read",
        }
    )
    server = await start_authserver(config)
    async with http.get(server.endpoint("/.well-known/openid-configuration")) as response:
        meta = await response.json()
    advertised = meta["token_endpoint_auth_signing_alg_values_supported"]
    assert meta["revocation_endpoint_auth_signing_alg_values_supported"] == advertised
    assert meta["introspection_endpoint_auth_signing_alg_values_supported"] == advertised
    assert "none" not in advertised and "HS256" not in advertised

    kid_for = {"ES256": "p256", "ES384": "p384", "ES512": "p521", "EdDSA": "ed"}
    accepted = []
    for alg in TRIED_ALGORITHMS:
        kid = kid_for.get(alg, "rsa")
        claims = {**_claims(server.settings.issuer), "iss": "multi-alg", "sub": "multi-alg"}
        claims["jti"] = f"{alg}-{claims['jti']}"
        if alg == "HS256":
            assertion = _hs256(claims, b"a secret the server cannot know", kid)
        else:
            assertion = jwt.encode(claims, keys[kid], algorithm=alg, headers={"kid": kid})
        status, body, _ = await token_with_assertion(http, server, assertion)
        assert status in (200, 401), body
        if status == 200:
            accepted.append(alg)
    assert accepted == advertised


# ---------------------------------------------------------------------------- the log


WRONG_SECRET = "not-the-secret-but-long-enough-0123456789"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("unknown_client", "unknown_client"),
        ("wrong_secret_basic", "wrong_secret"),
        ("wrong_secret_post", "wrong_secret"),
        ("wrong_method", "wrong_method (registered private_key_jwt)"),
        ("expired", "assertion_expired"),
        ("lifetime_too_long", "assertion_lifetime_too_long"),
        ("replayed", "replayed_jti"),
        ("wrong_audience", "wrong_audience"),
        ("bad_signature", "bad_signature"),
    ],
)
async def test_every_invalid_client_is_logged_with_its_reason_and_never_the_credential(
    authserver: RunningAuthServer,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    case: str,
    reason: str,
) -> None:
    issuer = authserver.settings.issuer
    credential = WRONG_SECRET
    auth: tuple[str, str] | None = None
    form: dict[str, str] = dict(CC)
    if case == "unknown_client":
        auth = ("nobody", WRONG_SECRET)
    elif case == "wrong_secret_basic":
        auth = ("machine", WRONG_SECRET)
    elif case == "wrong_secret_post":
        form.update(client_id="machine-post", client_secret=WRONG_SECRET)
    elif case == "wrong_method":
        auth = ("machine-jwt", WRONG_SECRET)
    else:
        if case == "expired":
            credential = client_assertion(issuer, now=time.time() - 600)
        elif case == "lifetime_too_long":
            credential = client_assertion(issuer, lifetime=2 * 3600)
        elif case == "wrong_audience":
            credential = client_assertion("https://someone-else.example/token")
        elif case == "bad_signature":
            credential = client_assertion(issuer, key=_other_ec_key())
        else:  # replayed
            credential = client_assertion(issuer)
            status, body, _ = await token_with_assertion(http, authserver, credential)
            assert status == 200, body
        form.update(client_assertion_type=JWT_BEARER, client_assertion=credential)
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    status, body, response = await post_token(http, authserver, form, auth=auth)
    assert_invalid_client(status, body, response, basic=auth is not None)

    refusals = [r for r in caplog.records if r.getMessage() == "client authentication failed"]
    assert [r.__dict__["reason"] for r in refusals] == [reason]
    expected_id = auth[0] if auth else form.get("client_id", "machine-jwt")
    assert refusals[0].__dict__["client_id"] == expected_id
    # Neither the secret nor the assertion (nor its signature alone) is in any record.
    for record in caplog.records:
        text = record.getMessage() + " " + " ".join(map(str, record.__dict__.values()))
        assert credential not in text
        assert credential.rsplit(".", 1)[-1] not in text


# ---------------------------------------------------------------------------- helpers


def _claims(audience: str) -> dict[str, Any]:
    now = int(time.time())
    return {
        "iss": "machine-jwt",
        "sub": "machine-jwt",
        "aud": audience,
        "jti": f"j{now}{id(audience)}",
        "iat": now,
        "exp": now + 60,
    }


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(claims: dict[str, Any]) -> str:
    header = _b64(json.dumps({"alg": "none", "kid": CLIENT_KID}).encode())
    return f"{header}.{_b64(json.dumps(claims).encode())}."


def _hs256(claims: dict[str, Any], secret: bytes, kid: str = CLIENT_KID) -> str:
    header = {"alg": "HS256", "kid": kid}
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


def _public_jwk(private_key: Any) -> dict[str, Any]:
    public = private_key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        jwk: dict[str, Any] = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        jwk = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
    return jwk
