"""The lifetime and subject checks both verifiers share, on claims and a time given."""

from __future__ import annotations

import math

import pytest

from gateway.verifiers.base import InvalidToken
from gateway.verifiers.validity import check_validity

NOW = 1_700_000_000.0


def jwt_check(claims, leeway: float = 30):
    return check_validity(claims, NOW, leeway, exp_required=True, check_iat=True)


def introspection_check(claims, leeway: float = 30):
    return check_validity(claims, NOW, leeway, exp_required=False, check_iat=False)


def test_a_valid_token_gives_its_expiry():
    assert jwt_check({"sub": "alice", "exp": NOW + 60, "iat": NOW}) == NOW + 60
    assert introspection_check({"sub": "alice", "exp": int(NOW) + 60}) == NOW + 60


def test_an_answer_without_exp_never_expires_but_a_jwt_needs_one():
    assert introspection_check({"sub": "alice"}) == math.inf
    with pytest.raises(InvalidToken, match="the token has no expiry"):
        jwt_check({"sub": "alice"})


@pytest.mark.parametrize("exp", ["9999999999", True, None, [1]])
def test_an_expiry_that_is_not_a_number_is_refused(exp):
    with pytest.raises(InvalidToken, match="the token has no expiry"):
        jwt_check({"sub": "alice", "exp": exp})
    if exp is not None:
        with pytest.raises(InvalidToken, match="the token has no usable expiry"):
            introspection_check({"sub": "alice", "exp": exp})


def test_expiry_and_not_before_allow_the_leeway_and_no_more():
    assert jwt_check({"sub": "a", "exp": NOW - 29}, leeway=30) == NOW - 29
    with pytest.raises(InvalidToken, match="the token has expired"):
        jwt_check({"sub": "a", "exp": NOW - 30}, leeway=30)
    assert introspection_check({"sub": "a", "nbf": NOW + 30}, leeway=30) == math.inf
    with pytest.raises(InvalidToken, match="the token is not valid yet"):
        introspection_check({"sub": "a", "nbf": NOW + 31}, leeway=30)


def test_issued_at_in_the_future_is_checked_for_jwts_only():
    claims = {"sub": "a", "exp": NOW + 600, "iat": NOW + 300}
    with pytest.raises(InvalidToken, match="the token was issued in the future"):
        jwt_check(claims)
    assert introspection_check(claims) == NOW + 600


@pytest.mark.parametrize("sub", [None, "", 42, ["alice"]])
def test_a_subject_must_be_a_non_empty_string(sub):
    claims = {"exp": NOW + 60} | ({"sub": sub} if sub is not None else {})
    for check in (jwt_check, introspection_check):
        with pytest.raises(InvalidToken, match="the token has no subject"):
            check(claims)
