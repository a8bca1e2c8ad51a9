"""The pure DPoP checks (authserver/protocol/dpop.py): thumbprints, htu comparison, header
and claim checks, nonces. Each check of RFC 9449 §4.3 it owns has a case that fails it."""

from __future__ import annotations

from typing import Any

import pytest

from authserver.protocol import dpop
from authserver.protocol.dpop import NonceRequired, Nonces, ProofError

NOW = 1_700_000_000.0
URL = "https://auth.example.com/token"

# RFC 7638 §3.1: the example RSA key and its thumbprint.
RFC7638_KEY = {
    "kty": "RSA",
    "n": "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_B"
    "JECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2"
    "QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6"
    "WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw",
    "e": "AQAB",
    "alg": "RS256",
    "kid": "2011-04-29",
}


def test_the_thumbprint_is_rfc_7638s_example() -> None:
    assert dpop.thumbprint(RFC7638_KEY) == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"
    assert dpop.is_thumbprint("NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs")


@pytest.mark.parametrize(
    "jwk",
    [{"kty": "oct", "k": "c2VjcmV0"}, {"kty": "EC", "crv": "P-256", "x": "abc"}, {}],
    ids=["symmetric", "missing-member", "empty"],
)
def test_a_key_without_a_thumbprint_is_refused(jwk: dict[str, Any]) -> None:
    with pytest.raises(ProofError):
        dpop.thumbprint(jwk)


@pytest.mark.parametrize(
    "value", ["", "abc", "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9X=", "a" * 44]
)
def test_what_is_no_thumbprint_is_told(value: str) -> None:
    assert not dpop.is_thumbprint(value)


@pytest.mark.parametrize(
    "htu",
    [
        "https://auth.example.com/token",
        "https://auth.example.com/token?x=1#frag",  # §4.3 item 9: query and fragment ignored
        "HTTPS://Auth.Example.COM:443/token",  # RFC 3986 §6.2.2.1, §6.2.3
    ],
)
def test_htu_matches_the_endpoint_after_normalisation(htu: str) -> None:
    assert dpop.normalized_url(htu) == dpop.normalized_url(URL)


@pytest.mark.parametrize(
    "htu",
    [
        "https://auth.example.com/token/",
        "http://auth.example.com/token",
        "https://auth.example.com:8443/token",
        "https://other.example.com/token",
        "https://auth.example.com/userinfo",
        "https://user@auth.example.com/token",
        "/token",
        "not a url",
    ],
)
def test_htu_of_another_resource_does_not_match(htu: str) -> None:
    assert dpop.normalized_url(htu) != dpop.normalized_url(URL)


def header(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "typ": "dpop+jwt",
        "alg": "ES256",
        "jwk": {"kty": "EC", "crv": "P-256", "x": "x", "y": "y"},
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


# An RSA modulus of 1024 bits, and the RFC 7638 example's, of 2048.
SHORT_RSA_N = dpop.b64url((1 << 1023 | 1).to_bytes(128, "big"))


def test_a_good_header_gives_its_alg_and_key() -> None:
    alg, jwk = dpop.check_header(header())
    assert alg == "ES256" and jwk["kty"] == "EC"
    alg, jwk = dpop.check_header(
        header(alg="PS256", jwk={"kty": "RSA", "n": RFC7638_KEY["n"], "e": "AQAB"})
    )
    assert alg == "PS256"
    assert dpop.check_header(header(alg="EdDSA", jwk={"kty": "OKP", "crv": "Ed25519", "x": "x"}))


@pytest.mark.parametrize(
    "changes",
    [
        {"typ": "JWT"},
        {"typ": None},
        {"alg": "none"},
        {"alg": "HS256"},
        {"alg": None},
        {"jwk": None},
        {"jwk": "a string"},
        {"jwk": {"kty": "EC", "crv": "P-256", "x": "x", "y": "y", "d": "private"}},
        {"jwk": {"kty": "oct", "k": "c2VjcmV0"}},
        {"jwk": {"kty": "EC", "crv": "P-384", "x": "x", "y": "y"}},
        {"alg": "RS256"},
        {"alg": "RS256", "jwk": {"kty": "RSA", "n": SHORT_RSA_N, "e": "AQAB"}},
        {"alg": "EdDSA", "jwk": {"kty": "OKP", "crv": "X25519", "x": "x"}},
    ],
    ids=["typ-jwt", "no-typ", "alg-none", "alg-hs256", "no-alg", "no-jwk", "jwk-string",
         "private-jwk", "symmetric-jwk", "es256-with-p384", "rs256-with-ec", "rsa-1024",
         "eddsa-with-x25519"],
)  # fmt: skip
def test_a_header_failing_a_check_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ProofError):
        dpop.check_header(header(**changes))


def claims(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"jti": "j-1", "htm": "POST", "htu": URL, "iat": int(NOW)}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def check(body: dict[str, Any], **kw: Any) -> dpop.ProofClaims:
    args: dict[str, Any] = {"method": "POST", "url": URL, "now": NOW, "max_age": 60, "leeway": 5}
    args.update(kw)
    return dpop.check_claims(body, **args)


def test_good_claims_pass() -> None:
    assert check(claims(nonce="n")) == dpop.ProofClaims("j-1", NOW, "n")
    assert check(claims(iat=NOW - 65)).iat == NOW - 65  # max_age plus the leeway
    assert check(claims(iat=NOW + 5)).iat == NOW + 5


@pytest.mark.parametrize(
    "changes",
    [
        {"jti": None},
        {"jti": ""},
        {"jti": "x" * 257},
        {"htm": None},
        {"htm": "GET"},
        {"htm": "post"},
        {"htu": None},
        {"htu": "https://auth.example.com/other"},
        {"iat": None},
        {"iat": "1700000000"},
        {"iat": True},
        {"iat": NOW - 66},
        {"iat": NOW + 6},
    ],
    ids=["no-jti", "empty-jti", "long-jti", "no-htm", "htm-get", "htm-lower", "no-htu",
         "htu-other", "no-iat", "iat-string", "iat-bool", "iat-stale", "iat-future"],
)  # fmt: skip
def test_claims_failing_a_check_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ProofError):
        check(claims(**changes))


def test_ath_must_be_the_hash_of_the_presented_access_token() -> None:
    token = "eyJ.token.sig"
    good = claims(ath=dpop.access_token_hash(token))
    assert check(good, access_token=token)
    for bad in (claims(), claims(ath=dpop.access_token_hash("another")), claims(ath=1)):
        with pytest.raises(ProofError):
            check(bad, access_token=token)


def test_a_nonce_is_valid_in_its_window_and_the_next_then_expires() -> None:
    nonces = Nonces(b"s" * 32, lifetime=300)
    issued = nonces.current(NOW)
    nonces.check(issued, NOW)
    nonces.check(issued, NOW + 300)
    with pytest.raises(NonceRequired):
        nonces.check(issued, NOW + 600)
    with pytest.raises(NonceRequired):
        nonces.check(issued, NOW - 300)  # a window ahead of the clock is not one it gave


def test_nonces_are_shared_by_servers_with_one_secret_and_refused_by_others() -> None:
    issued = Nonces(b"s" * 32, 300).current(NOW)
    Nonces(b"s" * 32, 300).check(issued, NOW)
    with pytest.raises(NonceRequired):
        Nonces(b"t" * 32, 300).check(issued, NOW)


@pytest.mark.parametrize("nonce", [None, "", "not-base64!", "AAAA", "A" * 35])
def test_a_missing_or_forged_nonce_is_refused(nonce: str | None) -> None:
    with pytest.raises(NonceRequired):
        Nonces(b"s" * 32, 300).check(nonce, NOW)
