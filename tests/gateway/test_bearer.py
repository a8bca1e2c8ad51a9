"""gateway.core.bearer: the token comes from one Authorization header, Bearer scheme only."""

from __future__ import annotations

import pytest

from gateway.core.bearer import MalformedAuthorization, extract, looks_like_jwt

JWT = "eyJhbGciOiJFUzI1NiIsInR5cCI6ImF0K2p3dCJ9.eyJzdWIiOiJ1c2VyLTEyMyJ9.c2lnbmF0dXJl"


def test_no_authorization_header_gives_no_token() -> None:
    assert extract([]) is None
    assert extract(()) is None


def test_bearer_token_is_returned_unchanged() -> None:
    assert extract([f"Bearer {JWT}"]) == JWT
    assert extract(["Bearer opaque-token_1.2~3+4/5=="]) == "opaque-token_1.2~3+4/5=="


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_scheme_name_is_case_insensitive(scheme: str) -> None:
    assert extract([f"{scheme} abc"]) == "abc"


@pytest.mark.parametrize("value", ["Bearer   abc", "  Bearer abc  ", "Bearer abc   "])
def test_extra_spaces_around_the_token_are_tolerated(value: str) -> None:
    assert extract([value]) == "abc"


@pytest.mark.parametrize(
    "value",
    ["Basic dXNlcjpwYXNz", "Digest username=x", "DPoP abc", "Bearerabc", "Token abc", ""],
)
def test_other_schemes_are_not_bearer_tokens(value: str) -> None:
    assert extract([value]) is None


def test_several_authorization_headers_are_malformed() -> None:
    with pytest.raises(MalformedAuthorization, match="more than one Authorization header"):
        extract(["Bearer abc", "Bearer def"])
    with pytest.raises(MalformedAuthorization, match="more than one Authorization header"):
        extract(["Basic dXNlcjpwYXNz", "Bearer abc"])


@pytest.mark.parametrize(
    "value",
    [
        "Bearer",
        "Bearer ",
        "Bearer a b",
        "Bearer abc,def",
        "Bearer ab=c",
        "Bearer =abc",
        "Bearer tök",
        'Bearer "abc"',
        "Bearer abc\tdef",
    ],
)
def test_bearer_credential_that_is_not_a_b64token_is_malformed(value: str) -> None:
    with pytest.raises(MalformedAuthorization, match="not a valid b64token"):
        extract([value])


def test_looks_like_jwt_tells_compact_jws_from_opaque_tokens() -> None:
    assert looks_like_jwt(JWT)
    assert not looks_like_jwt("2YotnFZFEjr1zCsicMWpAA")
    assert not looks_like_jwt("abc.def.ghi")  # three parts, but the header is not JSON
    assert not looks_like_jwt("eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0")  # two parts
    assert not looks_like_jwt(JWT + ".extra")  # five-part JWE shape is not a JWS
