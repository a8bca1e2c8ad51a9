"""A real OAuth client library against the server: Authlib's requests-based OAuth2Session runs
client_credentials, then the code flow with PKCE S256 (the test posts the login and consent
forms as a browser would), the exchange, ID token validation, refresh, userinfo and
revocation, all with Authlib's defaults and no special-casing.

requests is synchronous and the server runs in this test's event loop, so each client-side
scenario runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import secrets
import warnings
from typing import Any
from urllib.parse import urljoin

import pytest
import requests
from authlib.integrations.requests_client import OAuth2Session, OAuthError
from authlib.oauth2.rfc7523 import PrivateKeyJWT
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

with warnings.catch_warnings():
    # Authlib announces a move of its JOSE module to a separate package; it still works.
    warnings.simplefilter("ignore")
    from authlib.jose import JsonWebKey, jwt
    from authlib.oidc.core import CodeIDToken

from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    SECRET,
    RunningAuthServer,
    StartAuthServer,
    default_config,
    parse_form,
    query_of,
)


def metadata(issuer: str) -> dict[str, Any]:
    response = requests.get(issuer + "/.well-known/openid-configuration", timeout=10)
    response.raise_for_status()
    meta: dict[str, Any] = response.json()
    assert meta["issuer"] == issuer
    return meta


def browser_login(authorization_url: str, username: str, password: str) -> str:
    """What a user does in the browser: sign in, allow; returns the redirect to the client."""
    browser = requests.Session()
    response = browser.get(authorization_url, allow_redirects=False, timeout=10)
    for _ in range(3):
        if response.status_code in (302, 303):
            return str(response.headers["Location"])
        assert response.status_code == 200, response.text[:300]
        action, fields = parse_form(response.text)
        if action.endswith("/login"):
            fields.update(username=username, password=password)
        else:
            fields["decision"] = "approve"
        response = browser.post(
            urljoin(authorization_url, action), data=fields, allow_redirects=False, timeout=10
        )
    raise AssertionError("no redirect back to the client")


def client_credentials_scenario(issuer: str) -> None:
    meta = metadata(issuer)
    session = OAuth2Session(client_id="machine", client_secret=SECRET, scope="orders:read")
    token = session.fetch_token(meta["token_endpoint"], grant_type="client_credentials")
    assert token["token_type"] == "Bearer"
    assert token["scope"] == "orders:read"
    assert "refresh_token" not in token and "id_token" not in token
    keys = JsonWebKey.import_key_set(requests.get(meta["jwks_uri"], timeout=10).json())
    claims = jwt.decode(token["access_token"], keys)
    claims.validate()
    assert claims["sub"] == claims["client_id"] == "machine"
    assert claims["iss"] == issuer

    # The same with client_secret_post, and a wrong secret surfaces as Authlib's OAuthError.
    post = OAuth2Session(
        client_id="machine-post",
        client_secret=SECRET,
        token_endpoint_auth_method="client_secret_post",
    )
    assert "access_token" in post.fetch_token(
        meta["token_endpoint"], grant_type="client_credentials"
    )
    wrong = OAuth2Session(client_id="machine", client_secret="not-the-secret-0123456789abcdef")
    with pytest.raises(OAuthError) as info:
        wrong.fetch_token(meta["token_endpoint"], grant_type="client_credentials")
    assert info.value.error == "invalid_client"


def code_flow_scenario(issuer: str, subject: str) -> None:
    meta = metadata(issuer)
    session = OAuth2Session(
        client_id="spa",
        scope="openid profile email offline_access orders:read",
        redirect_uri=REDIRECT,
        token_endpoint_auth_method="none",
        revocation_endpoint_auth_method="none",
        code_challenge_method="S256",
    )
    verifier = secrets.token_urlsafe(48)
    nonce = secrets.token_urlsafe(16)
    url, _ = session.create_authorization_url(
        meta["authorization_endpoint"], code_verifier=verifier, nonce=nonce
    )
    callback = browser_login(url, "alice", PASSWORD)
    assert callback.startswith(REDIRECT + "?")
    assert query_of(callback)["iss"] == issuer  # RFC 9207

    token = session.fetch_token(
        meta["token_endpoint"], authorization_response=callback, code_verifier=verifier
    )
    assert {"access_token", "refresh_token", "id_token", "expires_in", "scope"} <= set(token)

    keys = JsonWebKey.import_key_set(requests.get(meta["jwks_uri"], timeout=10).json())
    id_token = jwt.decode(
        token["id_token"],
        keys,
        claims_cls=CodeIDToken,
        claims_options={"iss": {"values": [issuer]}},
        claims_params={"nonce": nonce, "client_id": "spa", "access_token": token["access_token"]},
    )
    id_token.validate()  # iss, aud, exp, iat, nonce, at_hash
    assert id_token["sub"] == subject
    assert id_token["email"] == "alice@example.com"

    info = session.get(meta["userinfo_endpoint"], timeout=10)
    assert info.status_code == 200
    assert info.json()["sub"] == subject
    assert info.json()["name"] == "Alice Liddell"

    first_refresh = token["refresh_token"]
    refreshed = session.refresh_token(meta["token_endpoint"])
    assert refreshed["refresh_token"] != first_refresh
    assert session.get(meta["userinfo_endpoint"], timeout=10).status_code == 200

    revoked = session.revoke_token(
        meta["revocation_endpoint"],
        token=refreshed["refresh_token"],
        token_type_hint="refresh_token",
    )
    assert revoked.status_code == 200
    with pytest.raises(OAuthError) as error:
        session.refresh_token(meta["token_endpoint"], refresh_token=refreshed["refresh_token"])
    assert error.value.error == "invalid_grant"
    # The revoked family's access token no longer opens userinfo.
    after = session.get(meta["userinfo_endpoint"], timeout=10)
    assert after.status_code == 401
    assert 'error="invalid_token"' in after.headers["WWW-Authenticate"]


def confidential_code_flow_scenario(issuer: str) -> None:
    meta = metadata(issuer)
    session = OAuth2Session(
        client_id="web",
        client_secret=SECRET,
        scope="openid email offline_access",
        redirect_uri=REDIRECT,
        code_challenge_method="S256",
    )
    verifier = secrets.token_urlsafe(48)
    url, _ = session.create_authorization_url(
        meta["authorization_endpoint"], code_verifier=verifier
    )
    callback = browser_login(url, "alice", PASSWORD)
    token = session.fetch_token(
        meta["token_endpoint"], authorization_response=callback, code_verifier=verifier
    )
    assert "refresh_token" in token
    refreshed = session.refresh_token(meta["token_endpoint"])
    assert "access_token" in refreshed
    response = session.revoke_token(meta["revocation_endpoint"], token=refreshed["access_token"])
    assert response.status_code == 200
    # Replaying the code through the library is refused.
    with pytest.raises(OAuthError) as error:
        session.fetch_token(
            meta["token_endpoint"], authorization_response=callback, code_verifier=verifier
        )
    assert error.value.error == "invalid_grant"


async def test_authlib_client_credentials(authserver: RunningAuthServer) -> None:
    await asyncio.to_thread(client_credentials_scenario, authserver.settings.issuer)


async def test_authlib_public_client_code_flow_refresh_userinfo_and_revocation(
    authserver: RunningAuthServer,
) -> None:
    subject = authserver.subject("alice")
    await asyncio.to_thread(code_flow_scenario, authserver.settings.issuer, subject)


async def test_authlib_confidential_client_code_flow(authserver: RunningAuthServer) -> None:
    await asyncio.to_thread(confidential_code_flow_scenario, authserver.settings.issuer)


# An RSA key pair for a private_key_jwt client: Authlib signs assertions with RS256 by default.
JWT_CLIENT_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def private_key_jwt_session(audience: str | None) -> OAuth2Session:
    """Authlib's PrivateKeyJWT, RS256 and an assertion that expires in an hour. Its `aud` is
    the URL it is constructed with (the token endpoint in Authlib's documentation), else
    that of the request (the token endpoint, for a token request)."""
    pem = JWT_CLIENT_KEY.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return OAuth2Session(
        client_id="machine-rsa",
        client_secret=pem.decode(),
        token_endpoint_auth_method=PrivateKeyJWT(audience),
        scope="orders:read",
    )


def private_key_jwt_scenario(issuer: str, audience: str) -> None:
    """`audience`: "issuer" (PrivateKeyJWT(issuer)), "token_endpoint" (Authlib as its
    documentation shows it) or "default" (PrivateKeyJWT() with no URL)."""
    meta = metadata(issuer)
    given = {"issuer": issuer, "token_endpoint": meta["token_endpoint"], "default": None}
    session = private_key_jwt_session(given[audience])
    token = session.fetch_token(meta["token_endpoint"], grant_type="client_credentials")
    assert token["token_type"] == "Bearer"
    # Each request carries a new assertion (a new jti): a second one works too.
    again = session.fetch_token(meta["token_endpoint"], grant_type="client_credentials")
    assert again["access_token"] != token["access_token"]


def private_key_jwt_refused(issuer: str, audience: str) -> None:
    meta = metadata(issuer)
    given = {"token_endpoint": meta["token_endpoint"], "default": None}
    session = private_key_jwt_session(given[audience])
    with pytest.raises(OAuthError) as refused:
        session.fetch_token(meta["token_endpoint"], grant_type="client_credentials")
    assert refused.value.error == "invalid_client"


def rsa_client_config(audience_policy: str | None = None) -> dict[str, Any]:
    jwk = RSAAlgorithm.to_jwk(JWT_CLIENT_KEY.public_key(), as_dict=True)
    config = default_config()
    config["clients"].append(
        {
            "client_id": "machine-rsa",
            "token_endpoint_auth_method": "private_key_jwt",
            "jwks": {"keys": [jwk]},
            "grant_types": ["client_credentials"],
            "scope": "orders:read",
        }
    )
    if audience_policy is not None:
        config["client_assertion_audience"] = audience_policy
    return config


async def test_authlib_private_key_jwt_with_the_issuer_as_audience_and_its_default_lifetime(
    start_authserver: StartAuthServer,
) -> None:
    # client_assertion_audience: strict (the default) takes the issuer alone
    # (draft-ietf-oauth-rfc7523bis); Authlib sends it when constructed with it.
    server = await start_authserver(rsa_client_config())
    await asyncio.to_thread(private_key_jwt_scenario, server.settings.issuer, "issuer")
    for audience in ("token_endpoint", "default"):
        await asyncio.to_thread(private_key_jwt_refused, server.settings.issuer, audience)


@pytest.mark.parametrize("audience", ["token_endpoint", "default"])
async def test_authlib_private_key_jwt_as_it_comes_with_client_assertion_audience_compat(
    start_authserver: StartAuthServer, audience: str
) -> None:
    server = await start_authserver(rsa_client_config("compat"))
    await asyncio.to_thread(private_key_jwt_scenario, server.settings.issuer, audience)
