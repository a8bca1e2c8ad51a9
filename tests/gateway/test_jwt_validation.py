"""Bearer JWT validation through the running gateway, against a real issuer on 127.0.0.1.

Every refusal is checked in full: 401, the RFC 6750 challenge naming the rule broken, the
resource error body, and an upstream that received nothing. Tokens the issuer would never
sign (alg none, HMAC with the public key, mismatched keys) are built by hand.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st
from jwt.algorithms import get_default_algorithms

from gateway import adapter
from gateway.settings import IssuerSettings, JwksSettings
from gateway.verifiers import jwt as jwt_verifier
from gateway.verifiers.base import InvalidToken
from gateway.verifiers.cache import TokenCache, canonical_spelling, token_key
from gateway.verifiers.jwks import KeySet
from gateway.verifiers.jwt import JwtVerifier, TrustedIssuer, b64url_decode
from tests.support import (
    EchoUpstream,
    RunningGateway,
    TestIssuer,
    assert_invalid_token,
    b64url,
    call,
    compact,
    ecdsa_twin,
    gateway_yaml,
    header_values,
    issuer_entry,
    public_jwk,
    running_gateway,
)

ALGORITHM_REFUSED = "the token's signing algorithm is not accepted"
ISSUER_NOT_TRUSTED = "the token's issuer is not trusted"
UNKNOWN_KEY = "the token is signed with an unknown key"
KEY_DOES_NOT_FIT = "the token's key does not fit its algorithm"
NOT_AN_ACCESS_TOKEN = "the token is not an access token (typ must be at+jwt)"
ID_TOKEN = "ID tokens are not access tokens"
MALFORMED_SCOPE = "the token's scope is not a list of scope tokens"


@pytest.fixture
async def other_issuer() -> AsyncIterator[TestIssuer]:
    """A second, independent issuer with its own keys."""
    server = TestIssuer()
    for alg in ("ES256", "RS256"):
        server.add_key(alg)
    await server.start()
    yield server
    await server.stop()


async def assert_passes(
    client: aiohttp.ClientSession,
    gateway: RunningGateway,
    token: str,
    path: str = "/orders/1",
) -> dict[str, Any]:
    """The request reaches the upstream; what the upstream saw."""
    answer = await call(client, gateway.url + path, token)
    assert answer.status == 200, answer.body
    assert answer.headers["X-Upstream"] == "echo"
    seen: dict[str, Any] = answer.body
    return seen


async def assert_refused(
    client: aiohttp.ClientSession,
    gateway: RunningGateway,
    upstream: EchoUpstream,
    token: str,
    description: str,
    path: str = "/orders/1",
) -> None:
    before = len(upstream.requests)
    assert_invalid_token(await call(client, gateway.url + path, token), description)
    assert len(upstream.requests) == before, "the upstream received a refused request"


# ---------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("alg", ["RS256", "ES256", "EdDSA"])
async def test_valid_token_of_each_algorithm_is_forwarded_with_identity(
    gateway, issuer, upstream, client, alg
):
    seen = await assert_passes(client, gateway, issuer.token(alg, sub="alice"))
    assert header_values(seen, "X-Auth-Subject") == ["alice"]
    assert header_values(seen, "X-Auth-Client-Id") == ["webapp"]
    assert header_values(seen, "X-Auth-Issuer") == [issuer.url]
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("typ", ["at+jwt", "application/at+jwt", "AT+JWT", "Application/At+JWT"])
async def test_access_token_typ_is_accepted_in_both_spellings_and_any_case(
    gateway, issuer, client, typ
):
    await assert_passes(client, gateway, issuer.token("ES256", headers={"typ": typ}))


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ({"scp": ["orders:read", "orders:admin"]}, "orders:admin orders:read"),
        ({"scp": "orders:read  extra:one"}, "extra:one orders:read"),
        ({"scope": "orders:read extra:two"}, "extra:two orders:read"),
    ],
    ids=["scp-array", "scp-string", "scope-string"],
)
async def test_scopes_from_scp_or_scope_are_forwarded_space_separated(
    gateway, issuer, client, claims, expected
):
    drop = () if "scope" in claims else ("scope",)
    seen = await assert_passes(client, gateway, issuer.token("ES256", drop=drop, **claims))
    assert header_values(seen, "X-Auth-Scopes") == [expected]


@pytest.mark.parametrize(
    "claims",
    [
        {"scope": "orders:read x\u00a0orders:write"},
        {"scope": "orders:read x\u3000orders:write"},
        {"scope": "orders:read x\u001forders:write"},
        {"scope": "orders:read\torders:write"},
        {"scope": ["orders:read", "x orders:write"]},
        {"scp": ["orders:read", "x orders:write"], "drop": ("scope",)},
        {"scp": ["orders:read orders:write"], "drop": ("scope",)},
    ],
    ids=["nbsp", "ideographic-space", "unit-separator", "tab", "scope-array", "scp-array", "one"],
)
async def test_scope_smuggled_past_the_space_separator_is_refused(
    gateway, issuer, upstream, client, claims
):
    """RFC 6749 §3.3: scopes are separated by U+0020 alone and an array element is one scope.
    A token granted the one odd scope "x<NBSP>orders:write" must not pass a route that needs
    orders:write: it is refused as malformed."""
    claims = dict(claims)
    drop = claims.pop("drop", ())
    token = issuer.token("ES256", drop=drop, **claims)
    answer = await call(client, gateway.url + "/orders/1", token, method="PUT")
    assert_invalid_token(answer, MALFORMED_SCOPE)
    assert upstream.requests == []


async def test_scopes_separated_by_spaces_still_pass_a_route_needing_both(
    gateway, issuer, upstream, client
):
    token = issuer.token("ES256", scope="orders:read orders:write")
    answer = await call(client, gateway.url + "/orders/1", token, method="PUT")
    assert answer.status == 200, answer.body
    assert header_values(upstream.requests[-1], "X-Auth-Scopes") == ["orders:read orders:write"]


async def test_audience_array_naming_this_api_is_accepted(gateway, issuer, client):
    await assert_passes(client, gateway, issuer.token("RS256", aud=["other-api", "orders-api"]))


# ---------------------------------------------------------------------------- algorithms


@pytest.mark.parametrize("alg", ["none", "None", "NONE"])
async def test_unsigned_token_with_alg_none_is_refused(gateway, issuer, upstream, client, alg):
    header = {"alg": alg, "typ": "at+jwt", "kid": issuer.key("ES256").kid}
    unsigned = compact(header, issuer.claims())
    await assert_refused(client, gateway, upstream, unsigned, "the token is not a signed JWT")
    # The same with a signature part present gets as far as the algorithm check.
    with_junk_signature = unsigned + b64url(b"junk")
    await assert_refused(client, gateway, upstream, with_junk_signature, ALGORITHM_REFUSED)


async def test_hs256_token_keyed_with_the_issuers_public_key_is_refused(
    gateway, issuer, upstream, client
):
    """The key-confusion attack: the public key (known to all) used as an HMAC secret."""
    rsa_key = issuer.key("RS256")
    pem = rsa_key.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "typ": "at+jwt", "kid": rsa_key.kid}
    forged = compact(
        header, issuer.claims(), lambda data: hmac.new(pem, data, hashlib.sha256).digest()
    )
    await assert_refused(client, gateway, upstream, forged, ALGORITHM_REFUSED)


async def test_algorithm_accepted_for_one_issuer_is_refused_for_another(
    issuer, other_issuer, upstream, client
):
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        issuers=[
            issuer_entry(issuer.url),
            issuer_entry(other_issuer.url, algorithms=["ES256"]),
        ],
    )
    async with running_gateway(config) as gateway:
        await assert_passes(client, gateway, other_issuer.token("ES256"))
        await assert_passes(client, gateway, issuer.token("RS256"))
        # other_issuer publishes an RS256 key that fits the token, but RS256 is not its algorithm.
        await assert_refused(
            client, gateway, upstream, other_issuer.token("RS256"), ALGORITHM_REFUSED
        )


@pytest.mark.parametrize(
    ("header_alg", "signing_alg", "kid_of"),
    [("RS256", "RS256", "ES256"), ("ES256", "ES256", "RS256"), ("EdDSA", "EdDSA", "ES256")],
    ids=["rs256-header-ec-kid", "es256-header-rsa-kid", "eddsa-header-ec-kid"],
)
async def test_token_whose_kid_names_a_key_of_another_type_is_refused(
    gateway, issuer, upstream, client, header_alg, signing_alg, kid_of
):
    token = issuer.token(signing_alg, headers={"alg": header_alg, "kid": issuer.key(kid_of).kid})
    await assert_refused(client, gateway, upstream, token, KEY_DOES_NOT_FIT)
    assert issuer.jwks_fetches == 1, "a known kid must not trigger a key refetch"


async def test_es256_token_naming_a_p384_key_is_refused(issuer, upstream, client):
    """RFC 7518 §3.4 binds ES256 to P-256; a P-384 key would verify a SHA-256 ECDSA signature."""
    p384 = issuer.add_key(
        "ES384", private=ec.generate_private_key(ec.SECP384R1()), jwk_overrides={"alg": None}
    )
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        issuers=[issuer_entry(issuer.url, algorithms=["ES256", "ES384"])],
    )
    async with running_gateway(config) as gateway:
        # The key itself is usable with its own algorithm...
        await assert_passes(client, gateway, issuer.token("ES384", key=p384))
        # ...but not for a token claiming ES256, though the signature is mathematically valid.
        header = {"alg": "ES256", "typ": "at+jwt", "kid": p384.kid}
        token = issuer.sign_compact(header, issuer.claims(), key=p384, alg="ES256")
        await assert_refused(client, gateway, upstream, token, KEY_DOES_NOT_FIT)


async def test_token_with_crit_header_is_refused(gateway, issuer, upstream, client):
    key = issuer.key("ES256")
    header = {"alg": "ES256", "typ": "at+jwt", "kid": key.kid, "crit": ["exp"], "exp": 1}
    token = issuer.sign_compact(header, issuer.claims(), key=key)
    await assert_refused(
        client,
        gateway,
        upstream,
        token,
        "the token has critical header parameters that are not supported",
    )


@pytest.mark.parametrize("kid_source", ["attacker-kid", "issuer-kid", "no-kid"])
async def test_key_location_headers_are_ignored_and_never_fetched(
    gateway, issuer, upstream, client, kid_source
):
    """RFC 8725 §3.10: keys come from configuration only, never from `jku`, `x5u` or `jwk`."""
    attacker = TestIssuer()
    attacker_key = attacker.add_key("ES256")
    await attacker.start()
    try:
        header: dict[str, Any] = {
            "alg": "ES256",
            "typ": "at+jwt",
            "jku": f"{attacker.url}/jwks",
            "x5u": f"{attacker.url}/cert.pem",
            "jwk": public_jwk(attacker_key.private, attacker_key.kid, "ES256"),
        }
        if kid_source == "attacker-kid":
            header["kid"] = attacker_key.kid
            expected = UNKNOWN_KEY
        elif kid_source == "issuer-kid":
            header["kid"] = issuer.key("ES256").kid
            expected = "the token signature is invalid"
        else:
            # With no kid the issuer's single ES256 key is chosen, and it did not sign this.
            expected = "the token signature is invalid"
        token = attacker.sign_compact(header, issuer.claims(), key=attacker_key)
        await assert_refused(client, gateway, upstream, token, expected)
        assert attacker.requests == []
    finally:
        await attacker.stop()


# ---------------------------------------------------------------------------- time claims


async def test_token_expired_beyond_leeway_is_refused(gateway, issuer, upstream, client):
    now = int(time.time())
    token = issuer.token("ES256", iat=now - 600, exp=now - 31)  # default leeway: 30s
    await assert_refused(client, gateway, upstream, token, "the token has expired")


async def test_token_expired_within_leeway_is_accepted(gateway, issuer, client):
    now = int(time.time())
    await assert_passes(client, gateway, issuer.token("ES256", iat=now - 600, exp=now - 20))


async def test_token_not_valid_before_a_future_nbf_is_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", nbf=int(time.time()) + 120)
    await assert_refused(client, gateway, upstream, token, "the token is not valid yet")


async def test_nbf_within_leeway_is_accepted(gateway, issuer, client):
    await assert_passes(client, gateway, issuer.token("ES256", nbf=int(time.time()) + 10))


async def test_token_issued_in_the_future_is_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", iat=int(time.time()) + 120)
    await assert_refused(client, gateway, upstream, token, "the token was issued in the future")


async def test_token_without_exp_is_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", drop=("exp",))
    await assert_refused(client, gateway, upstream, token, "the token has no expiry")


# ---------------------------------------------------------------------------- other claims


async def test_token_without_sub_is_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", drop=("sub",))
    await assert_refused(client, gateway, upstream, token, "the token has no subject")


async def test_token_without_aud_is_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", drop=("aud",))
    await assert_refused(client, gateway, upstream, token, "the token has no audience")


async def test_token_for_another_audience_is_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", aud=["billing-api", "orders"])
    await assert_refused(
        client, gateway, upstream, token, "the token is not meant for this API (audience)"
    )


@pytest.mark.parametrize(
    "iss",
    ["https://evil.example", "{url}/", "{url}/tenant", "{upper}"],
    ids=["other-host", "trailing-slash", "longer-path", "other-case"],
)
async def test_token_whose_iss_is_not_exactly_a_trusted_issuer_is_refused(
    gateway, issuer, upstream, client, iss
):
    claimed = iss.format(url=issuer.url, upper=issuer.url.upper())
    token = issuer.token("ES256", iss=claimed)  # signed with the trusted issuer's own key
    await assert_refused(client, gateway, upstream, token, ISSUER_NOT_TRUSTED)


async def test_untrusted_issuer_is_refused_before_any_key_fetch(
    gateway, issuer, other_issuer, upstream, client
):
    seen_before = list(issuer.requests)
    token = other_issuer.token("ES256")  # iss is other_issuer.url, and its kid is unknown here
    await assert_refused(client, gateway, upstream, token, ISSUER_NOT_TRUSTED)
    assert other_issuer.requests == []
    assert issuer.requests == seen_before


# ---------------------------------------------------------------------------- typ


@pytest.mark.parametrize("typ", [None, "JWT", "jwt", "at+jwt+extra", "application/jwt"])
async def test_token_without_access_token_typ_is_refused(gateway, issuer, upstream, client, typ):
    token = issuer.token("ES256", headers={"typ": typ})
    await assert_refused(client, gateway, upstream, token, NOT_AN_ACCESS_TOKEN)


@pytest.mark.parametrize("typ", [None, "JWT"])
async def test_plain_jwt_is_accepted_when_typ_is_not_required(issuer, upstream, client, typ):
    config = gateway_yaml(
        issuer.url, upstream.url, issuers=[issuer_entry(issuer.url, require_typ="false")]
    )
    async with running_gateway(config) as gateway:
        await assert_passes(client, gateway, issuer.token("ES256", headers={"typ": typ}))


NO_CLIENT_NO_SCOPE = ("scope", "client_id")
AT_HASH = "77QmUPtjPfzWtF2AnpK9RQ"


@pytest.mark.parametrize(
    "claims",
    [
        {"nonce": "n-0S6_WzA2Mj"},
        {"aud": "webapp", "azp": "webapp", "drop": ("scope", "client_id")},
        {"aud": ["webapp"], "drop": ("scope",)},
        {"at_hash": AT_HASH, "auth_time": 1_700_000_000, "drop": NO_CLIENT_NO_SCOPE},
        {"at_hash": AT_HASH, "drop": NO_CLIENT_NO_SCOPE},
        {"at_hash": AT_HASH},
        {"c_hash": "LDktKdoQak3Pk0cnXxCltA"},
        {"auth_time": 1_700_000_000, "drop": NO_CLIENT_NO_SCOPE},
        {"acr": "urn:mace:incommon:iap:silver", "drop": NO_CLIENT_NO_SCOPE},
        {"amr": ["pwd", "otp"], "drop": NO_CLIENT_NO_SCOPE},
    ],
    ids=[
        "with-nonce",
        "aud-is-azp-without-scope",
        "aud-is-client-id-without-scope",
        "at-hash-and-auth-time-aud-is-the-api",
        "at-hash-aud-is-the-api",
        "at-hash-even-with-scope",
        "c-hash",
        "auth-time-without-scope-or-client",
        "acr-without-scope-or-client",
        "amr-without-scope-or-client",
    ],
)
async def test_id_token_is_refused_even_when_typ_is_not_required(issuer, upstream, client, claims):
    """OpenID Connect Core §2 / §3.1.3.6 / §3.3.2.11 claims mark an ID token (RFC 9068 §4,
    RFC 8725 §3.11): refused on a route with no scope rule and the API's own audience."""
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        issuers=[issuer_entry(issuer.url, audiences=["orders-api", "webapp"], require_typ="false")],
    )
    claims = dict(claims)
    drop = claims.pop("drop", ())
    token = issuer.token("RS256", headers={"typ": "JWT"}, drop=drop, **claims)
    async with running_gateway(config) as gateway:
        await assert_refused(client, gateway, upstream, token, ID_TOKEN, path="/anything")


@pytest.mark.parametrize(
    "claims",
    [
        {"auth_time": 1_700_000_000, "acr": "1", "amr": ["pwd"]},
        {"auth_time": 1_700_000_000, "drop": ("client_id",)},
        {"acr": "1", "drop": ("scope",)},
    ],
    ids=["all-with-scope-and-client", "auth-time-with-scope", "acr-with-client"],
)
async def test_access_token_with_authentication_claims_is_accepted_without_typ(
    issuer, upstream, client, claims
):
    """RFC 9068 §2.2.1 lets access tokens carry auth_time, acr and amr."""
    config = gateway_yaml(
        issuer.url, upstream.url, issuers=[issuer_entry(issuer.url, require_typ="false")]
    )
    claims = dict(claims)
    drop = claims.pop("drop", ())
    token = issuer.token("RS256", headers={"typ": "JWT"}, drop=drop, **claims)
    async with running_gateway(config) as gateway:
        await assert_passes(client, gateway, token, "/anything")


async def test_id_token_with_access_token_typ_is_still_refused(gateway, issuer, upstream, client):
    token = issuer.token("ES256", nonce="abc")
    await assert_refused(client, gateway, upstream, token, ID_TOKEN)


# ---------------------------------------------------------------------------- malformed


ES256_HEADER = b64url({"alg": "ES256"})
NOT_JSON = "the token header is not base64url-encoded JSON"
PAYLOAD_NOT_JSON = "the token payload is not base64url-encoded JSON"
PAYLOAD_NOT_OBJECT = "the token payload is not a JSON object"


def _long_token() -> str:
    header = b64url({"alg": "ES256", "typ": "at+jwt"})
    return f"{header}.{b64url(b'{' + b'x' * 300_000)}.{b64url(b'sig')}"


@pytest.mark.parametrize(
    ("token", "description"),
    [
        ("not-a-jwt", "the token is not a signed JWT"),
        ("a.b", "the token is not a signed JWT"),
        ("a.b.c.d", "the token is not a signed JWT"),
        (f"{ES256_HEADER}..c2ln", "the token is not a signed JWT"),
        (f"eyJhb.{b64url({'sub': 'x'})}.c2ln", NOT_JSON),
        (f"{b64url(b'not json')}.e30.c2ln", NOT_JSON),
        (f"{b64url(bytes([0xFF, 0xFE]))}.e30.c2ln", NOT_JSON),
        (f"{b64url(b'[1, 2]')}.e30.c2ln", "the token header is not a JSON object"),
        (f"{ES256_HEADER}.{b64url(b'[1]')}.c2ln", PAYLOAD_NOT_OBJECT),
        (f"{ES256_HEADER}.{b64url(json.dumps('s'))}.c2ln", PAYLOAD_NOT_OBJECT),
        (f"{ES256_HEADER}.eyJhb.c2ln", PAYLOAD_NOT_JSON),
        (f"{ES256_HEADER}.{b64url(b'[' * 5000)}.c2ln", PAYLOAD_NOT_JSON),
        (f"{b64url({'alg': ['ES256']})}.e30.c2ln", ALGORITHM_REFUSED),
        (f"{b64url({'typ': 'at+jwt'})}.e30.c2ln", ALGORITHM_REFUSED),
        ("huge", PAYLOAD_NOT_JSON),
    ],
    ids=[
        "one-part",
        "two-parts",
        "four-parts",
        "empty-payload",
        "header-bad-base64",
        "header-not-json",
        "header-not-utf8",
        "header-json-array",
        "payload-json-array",
        "payload-json-string",
        "payload-bad-base64",
        "payload-nested-too-deep",
        "alg-not-a-string",
        "alg-missing",
        "huge-token",
    ],
)
async def test_garbage_token_is_refused_with_401_not_a_server_error(
    issuer, upstream, client, token, description
):
    if token == "huge":
        token = _long_token()
    config = gateway_yaml(issuer.url, upstream.url, extra="limits: {max_field_size: 1MiB}")
    async with running_gateway(config) as gateway:
        await assert_refused(client, gateway, upstream, token, description)


def _signed_variant(issuer: TestIssuer, header: dict[str, Any], claims: dict[str, Any]) -> str:
    key = issuer.key("ES256")
    full_header = {"alg": "ES256", "typ": "at+jwt", "kid": key.kid, **header}
    return issuer.sign_compact(full_header, issuer.claims(**claims), key=key)


@pytest.mark.parametrize(
    ("header", "claims", "description"),
    [
        ({}, {"iss": ["{url}"]}, ISSUER_NOT_TRUSTED),
        ({}, {"iss": {"url": "{url}"}}, ISSUER_NOT_TRUSTED),
        ({}, {"iss": None}, ISSUER_NOT_TRUSTED),
        ({}, {"iss": 7}, ISSUER_NOT_TRUSTED),
        ({}, {"exp": "9999999999"}, "the token has no expiry"),
        ({}, {"exp": True}, "the token has no expiry"),
        ({}, {"exp": None}, "the token has no expiry"),
        ({}, {"nbf": "0"}, "the token is not valid yet"),
        ({}, {"iat": "0"}, "the token was issued in the future"),
        ({}, {"sub": 123}, "the token has no subject"),
        ({}, {"sub": ""}, "the token has no subject"),
        ({}, {"aud": []}, "the token has no audience"),
        ({}, {"aud": 5}, "the token has no audience"),
        ({}, {"aud": [5, None]}, "the token is not meant for this API (audience)"),
        ({"kid": 5}, {}, "the token's kid is not a string"),
        ({"kid": ["x"]}, {}, "the token's kid is not a string"),
        ({"typ": 5}, {}, NOT_AN_ACCESS_TOKEN),
        ({"typ": ["at+jwt"]}, {}, NOT_AN_ACCESS_TOKEN),
        (
            {"crit": "not-a-list"},
            {},
            "the token has critical header parameters that are not supported",
        ),
    ],
)
async def test_validly_signed_token_with_malformed_members_is_refused(
    gateway, issuer, upstream, client, header, claims, description
):
    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return value.format(url=issuer.url)
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    token = _signed_variant(issuer, header, fill(claims))
    await assert_refused(client, gateway, upstream, token, description)


async def test_tampered_payload_fails_the_signature_check(gateway, issuer, upstream, client):
    header, _, signature = issuer.token("ES256").split(".")
    tampered = f"{header}.{b64url(issuer.claims(scope='orders:admin'))}.{signature}"
    await assert_refused(client, gateway, upstream, tampered, "the token signature is invalid")


# ---------------------------------------------------------------------------- base64url

B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
NOT_CANONICAL = {
    0: "the token header is not base64url-encoded JSON",
    1: "the token payload is not base64url-encoded JSON",
    2: "the token signature is not base64url",
}


def same_bytes_other_text(segment: str) -> list[str]:
    """Every other spelling of `segment` that a lax decoder reads as the same bytes: the
    final character's unused low bits set (RFC 4648 §3.5 requires them to be zero)."""
    unused = {2: 4, 3: 2}[len(segment) % 4]
    last = B64URL.index(segment[-1])
    assert last % (1 << unused) == 0, "the issuer's own encoding is canonical"
    return [segment[:-1] + B64URL[last + bits] for bits in range(1, 1 << unused)]


def signed_with_parts(issuer: TestIssuer, header_b64: str, payload_b64: str) -> str:
    """A token whose header and payload are exactly these texts, signed by the issuer."""
    key = issuer.key("ES256")
    signing_input = f"{header_b64}.{payload_b64}".encode()
    signature = get_default_algorithms()["ES256"].sign(signing_input, key.private)
    return f"{header_b64}.{payload_b64}.{b64url(signature)}"


def unaligned(data: dict[str, Any]) -> str:
    """base64url of a JSON object padded (with an extra member) to a length that leaves
    unused bits in its last character."""
    for n in range(4):
        text = b64url({**data, "pad": "x" * n})
        if len(text) % 4:
            return text
    raise AssertionError("unreachable")


async def test_signature_with_nonzero_unused_bits_is_refused_on_cold_and_warm_paths(
    gateway, issuer, upstream, client
):
    """The same signature bytes spelt otherwise would be a new token to the verified-token
    cache: each spelling must be refused, before and after the real token is cached."""
    token = issuer.token("ES256")
    head, payload, signature = token.split(".")
    variants = [f"{head}.{payload}.{s}" for s in same_bytes_other_text(signature)]
    assert len(variants) == 15
    await assert_refused(client, gateway, upstream, variants[0], NOT_CANONICAL[2])
    await assert_passes(client, gateway, token)
    for variant in variants:
        await assert_refused(client, gateway, upstream, variant, NOT_CANONICAL[2])
    await assert_passes(client, gateway, token)
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("part", [0, 1], ids=["header", "payload"])
async def test_header_or_payload_with_nonzero_unused_bits_is_refused_even_when_signed(
    gateway, issuer, upstream, client, part
):
    header = {"alg": "ES256", "typ": "at+jwt", "kid": issuer.key("ES256").kid}
    parts = [unaligned(header), unaligned(issuer.claims())]
    await assert_passes(client, gateway, signed_with_parts(issuer, *parts))
    for other in same_bytes_other_text(parts[part]):
        lax = list(parts)
        lax[part] = other
        token = signed_with_parts(issuer, *lax)
        await assert_refused(client, gateway, upstream, token, NOT_CANONICAL[part])


@pytest.mark.parametrize(
    "spelling",
    ["padded-signature", "standard-alphabet-signature", "padded-payload", "padded-header"],
)
async def test_padding_and_characters_outside_base64url_are_refused(
    gateway, issuer, upstream, client, spelling
):
    """RFC 7515 §2: base64url without padding, in its own alphabet only."""
    token = issuer.token("ES256")
    head, payload, signature = token.split(".")
    if spelling == "padded-signature":
        variant = f"{token}=="
    elif spelling == "standard-alphabet-signature":
        while "-" not in signature and "_" not in signature:
            token = issuer.token("ES256")
            head, payload, signature = token.split(".")
        standard = signature.replace("-", "+").replace("_", "/")
        variant = f"{head}.{payload}.{standard}"
    elif spelling == "padded-payload":
        payload = unaligned(issuer.claims())
        variant = signed_with_parts(issuer, head, payload + "=" * (-len(payload) % 4))
    else:
        head = unaligned({"alg": "ES256", "typ": "at+jwt", "kid": issuer.key("ES256").kid})
        variant = signed_with_parts(issuer, head + "=" * (-len(head) % 4), payload)
    answer = await call(client, gateway.url + "/orders/1", variant)
    # A padded header or payload is not even a bearer b64token (RFC 6750 §2.1): 400.
    assert answer.status in (400, 401), answer.body
    if answer.status == 401:
        assert_invalid_token(answer, "the token is not a signed JWT")
    assert upstream.requests == []


@given(data=st.binary(max_size=80))
def test_base64url_decoding_accepts_exactly_one_spelling_of_any_bytes(data):
    text = b64url(data)
    assert b64url_decode(text) == data
    for index in range(len(text)):
        for char in B64URL + "=+/.":
            other = text[:index] + char + text[index + 1 :]
            if other == text:
                continue
            try:
                decoded = b64url_decode(other)
            except binascii.Error:
                continue
            assert decoded != data, other


# ---------------------------------------------------------------------------- ECDSA twins

ECDSA_CURVES = {"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(), "ES512": ec.SECP521R1()}


@pytest.mark.parametrize("alg", sorted(ECDSA_CURVES))
async def test_an_ecdsa_tokens_twin_passes_as_the_same_entry_of_the_cache(
    issuer, upstream, client, alg
):
    """(r, n - s) verifies as well as (r, s), and issuers sign either spelling (Java's and
    WebCrypto's ECDSA: a high S half the time), so both pass; but they are one token, one
    entry of the verified-token cache, keyed by the low-S spelling."""
    key = issuer.add_key(alg, private=ec.generate_private_key(ECDSA_CURVES[alg]))
    entry = issuer_entry(issuer.url, algorithms=tuple(sorted(ECDSA_CURVES)))
    config = gateway_yaml(issuer.url, upstream.url, issuers=[entry])
    async with running_gateway(config) as gateway:
        cache = gateway.gateway.token_cache
        token = issuer.token(alg, key=key, sub="twin-user")  # low S, as the test issuer signs
        twin = ecdsa_twin(token)
        assert twin != token
        seen = await assert_passes(client, gateway, twin)  # the high-S spelling first
        assert header_values(seen, "X-Auth-Subject") == ["twin-user"]
        assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)
        await assert_passes(client, gateway, token)
        await assert_passes(client, gateway, twin)
        assert (cache.hits, cache.misses, len(cache)) == (2, 1, 1)
        assert cache.keys() == (hashlib.sha256(token.encode()).digest(),)
        # Spelt otherwise in base64url, the twin is no name of the cached token (ES384's and
        # ES512's signatures fill their last character: they have no unused bits to set).
        head, payload, signature = twin.split(".")
        for other in same_bytes_other_text(signature) if len(signature) % 4 else ():
            await assert_refused(
                client, gateway, upstream, f"{head}.{payload}.{other}", NOT_CANONICAL[2]
            )
        assert len(cache) == 1


def test_only_a_high_s_ecdsa_signature_spelt_canonically_is_keyed_by_its_twin(issuer):
    token = issuer.token("ES256")
    twin = ecdsa_twin(token)
    assert token_key(twin) == token_key(token) == hashlib.sha256(token.encode()).digest()
    assert canonical_spelling(token) == token
    head, payload, signature = twin.split(".")
    for other in same_bytes_other_text(signature):
        assert canonical_spelling(f"{head}.{payload}.{other}") == f"{head}.{payload}.{other}"
    # Another algorithm's signature of the same length is its own key (Ed25519: 64 bytes).
    for _ in range(8):
        eddsa = issuer.token("EdDSA")
        assert len(eddsa.split(".")[2]) == len(signature)
        assert canonical_spelling(eddsa) == eddsa
    # So is an ES256-sized signature under a header naming another algorithm.
    renamed = b64url({"alg": "ES384", "typ": "at+jwt"})
    assert (
        canonical_spelling(f"{renamed}.{payload}.{signature}") == f"{renamed}.{payload}.{signature}"
    )
    for garbage in ("", ".", "..", "a.b", f"x.{signature}", f"%.{payload}.{signature}"):
        assert canonical_spelling(garbage) == garbage


# ---------------------------------------------------------------------------- kid


async def test_token_without_kid_is_accepted_when_one_key_fits(gateway, issuer, client):
    # The issuer has one key each of ES256, RS256 and EdDSA: the algorithm picks one.
    for alg in ("ES256", "RS256", "EdDSA"):
        await assert_passes(client, gateway, issuer.token(alg, headers={"kid": None}))


async def test_token_without_kid_is_refused_when_several_keys_fit(issuer, upstream, client):
    issuer.add_key("ES256")
    async with running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway:
        token = issuer.token("ES256", headers={"kid": None})
        await assert_refused(
            client,
            gateway,
            upstream,
            token,
            "the token has no kid and more than one key could have signed it",
        )
        # Naming the key settles it.
        await assert_passes(client, gateway, issuer.token("ES256"))


async def test_token_signed_by_an_unpublished_key_is_refused(gateway, issuer, upstream, client):
    secret = issuer.add_key("ES256", published=False)
    await assert_refused(client, gateway, upstream, issuer.token("ES256", key=secret), UNKNOWN_KEY)


# ---------------------------------------------------------------------------- issuers and routes


async def test_tokens_from_every_trusted_issuer_are_accepted(
    issuer, other_issuer, upstream, client
):
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        issuers=[issuer_entry(issuer.url), issuer_entry(other_issuer.url)],
    )
    async with running_gateway(config) as gateway:
        for source in (issuer, other_issuer, issuer):
            seen = await assert_passes(client, gateway, source.token("ES256"))
            assert header_values(seen, "X-Auth-Issuer") == [source.url]
        # A key of one issuer does not vouch for a token claiming the other.
        forged = other_issuer.token("ES256", iss=issuer.url)
        await assert_refused(client, gateway, upstream, forged, UNKNOWN_KEY)


async def test_route_restricted_to_one_issuer_refuses_tokens_of_another(
    issuer, other_issuer, upstream, client
):
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        extra_routes=f'  - {{name: first-only, path: "/first/**", issuers: ["{issuer.url}"]}}',
        issuers=[issuer_entry(issuer.url), issuer_entry(other_issuer.url)],
    )
    async with running_gateway(config) as gateway:
        await assert_passes(client, gateway, issuer.token("ES256"), "/first/x")
        await assert_passes(client, gateway, other_issuer.token("ES256"), "/orders/x")
        await assert_refused(
            client,
            gateway,
            upstream,
            other_issuer.token("ES256"),
            "tokens from this issuer are not accepted here",
            "/first/x",
        )


async def test_route_audience_overrides_the_issuers_audiences(issuer, upstream, client):
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        extra_routes='  - {name: billing, path: "/billing/**", audience: billing-api}',
    )
    wrong_audience = "the token is not meant for this API (audience)"
    async with running_gateway(config) as gateway:
        billing = issuer.token("ES256", aud="billing-api")
        orders = issuer.token("ES256", aud="orders-api")
        await assert_passes(client, gateway, billing, "/billing/1")
        await assert_passes(client, gateway, orders, "/orders/1")
        await assert_refused(client, gateway, upstream, orders, wrong_audience, "/billing/1")
        await assert_refused(client, gateway, upstream, billing, wrong_audience, "/orders/1")


async def test_distinct_tokens_each_get_their_own_verdict(gateway, issuer, upstream, client):
    """A refusal is about one token: a good token right after a bad one still passes."""
    bad = issuer.token("ES256", aud="nobody", jti=uuid.uuid4().hex)
    good = issuer.token("ES256")
    await assert_refused(
        client, gateway, upstream, bad, "the token is not meant for this API (audience)"
    )
    await assert_passes(client, gateway, good)


async def es256_verifier(issuer, client, cache: TokenCache) -> JwtVerifier:
    """A verifier of `issuer`'s ES256 tokens alone, its key set loaded."""
    keys = KeySet(
        adapter.issuer(IssuerSettings(issuer=issuer.url, audiences=("orders-api",))),
        JwksSettings(),
        client,
    )
    assert await keys.refresh()
    trusted = TrustedIssuer(True, keys, frozenset({"ES256"}), 30.0)
    return JwtVerifier({issuer.url: trusted}, cache)


@pytest.mark.parametrize("suffix", ["\n", "\r\n", " ", "\t", "=", "\n.x"])
async def test_a_token_with_anything_after_its_signature_is_refused(issuer, client, suffix):
    # The shape check covers the whole token, so the decoders that then trust its alphabet
    # never see a character outside it (a lenient base64 decoder would skip a newline).
    verifier = await es256_verifier(issuer, client, TokenCache(100))
    token = issuer.token("ES256")
    assert (await verifier.verify(token)).subject == "user-123"
    with pytest.raises(InvalidToken, match="not a signed JWT"):
        await verifier.verify(token + suffix)


async def test_a_remembered_token_header_gets_every_check_again(gateway, issuer, upstream, client):
    """Token headers are kept parsed once seen; the rules on them still run for every token:
    a refused header is refused the same way each time, and a good header's next token
    still needs its own signature and claims to pass."""
    key = issuer.key("ES256")
    crit = {"alg": "ES256", "typ": "at+jwt", "kid": key.kid, "crit": ["exp"], "exp": 1}
    crit_token = issuer.sign_compact(crit, issuer.claims(), key=key)
    kid_token = _signed_variant(issuer, {"kid": 5}, {})
    for _ in range(2):
        await assert_refused(
            client,
            gateway,
            upstream,
            crit_token,
            "the token has critical header parameters that are not supported",
        )
        await assert_refused(
            client, gateway, upstream, kid_token, "the token's kid is not a string"
        )

    good = issuer.token("ES256")
    await assert_passes(client, gateway, good)
    expired = issuer.token("ES256", lifetime=-3600, iat=int(time.time()) - 7200)
    head, _, signature = issuer.token("ES256", sub="other").rpartition(".")
    forged = f"{head}.{signature[:5]}{'A' if signature[5] != 'A' else 'B'}{signature[6:]}"
    assert good.split(".")[0] == expired.split(".")[0] == forged.split(".")[0]
    await assert_refused(client, gateway, upstream, expired, "the token has expired")
    await assert_refused(client, gateway, upstream, forged, "the token signature is invalid")


async def test_remembered_token_headers_are_bounded(issuer, client, monkeypatch):
    """Headers made up by the thousand cannot grow the memory of parsed headers: full, it
    starts again, and every token still gets its verdict."""
    monkeypatch.setattr(jwt_verifier, "_HEADERS_REMEMBERED", 2)
    verifier = await es256_verifier(issuer, client, TokenCache(0))
    for n in range(5):
        token = issuer.token("ES256", headers={"x-n": n}, sub=f"user-{n}")
        assert (await verifier.verify(token)).subject == f"user-{n}"
        assert len(verifier._headers) <= 2
        with pytest.raises(InvalidToken, match=r"^the token's kid is not a string$"):
            await verifier.verify(_signed_variant(issuer, {"kid": n}, {}))
    # A long header is verified like any other, and not kept.
    verifier._headers.clear()
    token = issuer.token("ES256", headers={"x-long": "x" * 2000})
    assert (await verifier.verify(token)).subject == "user-123"
    assert verifier._headers == {}
