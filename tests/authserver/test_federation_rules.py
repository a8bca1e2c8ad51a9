"""authserver/protocol/federation.py: what the provider's answers must say and what a first
sign-in may do, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from authserver.protocol.federation import (
    ClaimNames,
    Expected,
    FederationRefused,
    check_id_token_claims,
    check_response_issuer,
    email_to_link,
    endpoint_allowed,
    id_token_algorithms,
    missing_claims,
    offered_username,
    profile_of,
    provider_methods,
    refreshed_claims,
    signed_in_at,
    with_userinfo,
)

NAMES = ClaimNames("preferred_username", "email", "name")
NOW = 1_700_000_000.0
EXPECTED = Expected("https://corp.example", "portcullis", "n-1", NOW)


def claims(**changes: Any) -> dict[str, Any]:
    base = {
        "iss": "https://corp.example",
        "sub": "emp-1",
        "aud": "portcullis",
        "exp": NOW + 300,
        "iat": NOW,
        "nonce": "n-1",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def reason(value: dict[str, Any]) -> str:
    with pytest.raises(FederationRefused) as refused:
        check_id_token_claims(value, EXPECTED)
    return refused.value.reason


def test_a_sound_id_token_gives_its_subject() -> None:
    assert check_id_token_claims(claims(), EXPECTED) == "emp-1"
    several = claims(aud=["portcullis", "api"], azp="portcullis")
    assert check_id_token_claims(several, EXPECTED) == "emp-1"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"iss": "https://corp.example/"}, "wrong_issuer"),
        ({"aud": "another"}, "wrong_audience"),
        ({"aud": ["another", "portcullis"]}, "wrong_audience"),  # several, no azp
        ({"azp": "another"}, "wrong_audience"),
        ({"aud": 7}, "wrong_audience"),
        ({"exp": NOW - 61}, "expired"),
        ({"exp": None}, "expired"),
        ({"exp": True}, "expired"),
        ({"iat": NOW + 120}, "stale"),
        ({"iat": NOW - 3600}, "stale"),
        ({"nonce": "n-2"}, "wrong_nonce"),
        ({"nonce": None}, "wrong_nonce"),
        ({"sub": ""}, "no_subject"),
        ({"sub": "x" * 256}, "no_subject"),
    ],
)
def test_an_id_token_not_for_this_sign_in_is_refused(
    changes: dict[str, Any], expected: str
) -> None:
    assert reason(claims(**changes)) == expected


def test_the_response_issuer_is_checked_when_sent_or_promised() -> None:
    check_response_issuer(None, "https://corp.example", advertised=False)
    check_response_issuer("https://corp.example", "https://corp.example", advertised=True)
    for given, advertised in [(None, True), ("https://other.example", False)]:
        with pytest.raises(FederationRefused):
            check_response_issuer(given, "https://corp.example", advertised)


def test_only_public_key_algorithms_are_taken_from_the_discovery_document() -> None:
    assert id_token_algorithms(["RS256", "HS256", "none", "ES256"]) == {"RS256", "ES256"}
    assert id_token_algorithms(None) == {"RS256"}
    assert id_token_algorithms(["HS256"]) == frozenset()


@pytest.mark.parametrize(
    ("verified", "email", "linked"),
    [
        (True, "a@example.com", True),
        (True, "a@EXAMPLE.com", True),
        (False, "a@example.com", False),
        ("true", "a@example.com", False),  # a string is not the boolean true
        (None, "a@example.com", False),
        (True, "a@sub.example.com", False),  # a subdomain is another domain
        (True, "a@example.com.evil.test", False),
        (True, "not-an-email", False),
    ],
)
def test_only_a_verified_email_of_a_trusted_domain_links(
    verified: object, email: str, linked: bool
) -> None:
    given = {"email": email, "email_verified": verified}
    assert (email_to_link(given, NAMES, {"example.com"}) == email) is linked
    assert email_to_link(given, NAMES, set()) is None  # no rule: never


def test_a_created_user_gets_a_safe_username_and_the_providers_word_on_the_email() -> None:
    username, local = profile_of(
        {"preferred_username": "Carol D/../x", "email": "c@x.example", "name": "Carol"},
        NAMES,
        "emp-1",
    )
    assert username == "Carol-D-..-x"
    assert local == {"email": "c@x.example", "email_verified": False, "name": "Carol"}
    assert profile_of({}, NAMES, "emp 9")[0] == "emp-9"


def test_a_linked_users_claims_follow_the_provider_an_address_only_once_verified() -> None:
    local = {"email": "d@x.example", "email_verified": True, "name": "Dana", "locale": "fr"}
    # A new name; an address of the provider's, not verified there: the local one stays.
    given = {"name": "Dana Q", "email": "m@evil.example", "email_verified": False}
    assert refreshed_claims(local, given, NAMES) == {**local, "name": "Dana Q"}
    # A verified new address replaces it; the claims the provider does not map are kept.
    given = {"email": "dq@x.example", "email_verified": True}
    assert refreshed_claims(local, given, NAMES) == {**local, "email": "dq@x.example"}
    # The same address: its verification is the provider's word, either way.
    given = {"email": "D@x.example", "email_verified": "true"}
    assert refreshed_claims(local, given, NAMES) == {**local, "email_verified": False}
    unverified = {**local, "email_verified": False}
    given = {"email": "D@x.example", "email_verified": True}
    assert refreshed_claims(unverified, given, NAMES) == {**local, "email": "D@x.example"}
    # Claims the provider no longer gives, or gives empty, remove nothing.
    assert refreshed_claims(local, {"name": "", "email": None}, NAMES) == local
    # An address from another claim is never verified: it replaces nothing.
    upn = ClaimNames("preferred_username", "upn", "name")
    assert refreshed_claims(local, {"upn": "ceo@x.example", "email_verified": True}, upn) == local
    assert offered_username({"preferred_username": "D Q"}, NAMES) == "D-Q"
    assert offered_username({"preferred_username": "//"}, NAMES) is None
    assert offered_username({}, NAMES) is None


def test_userinfo_completes_the_id_token_only_about_the_same_subject() -> None:
    token = {"sub": "emp-1", "name": "From the token"}
    assert missing_claims(token, NAMES)
    merged = with_userinfo(
        token, {"sub": "emp-1", "name": "Other", "email": "e@x.example"}, "emp-1"
    )
    assert merged == {"sub": "emp-1", "name": "From the token", "email": "e@x.example"}
    for answer in ({"sub": "emp-2", "email": "e@x.example"}, ["emp-1"], None):
        with pytest.raises(FederationRefused):
            with_userinfo(token, answer, "emp-1")
    assert not missing_claims({"preferred_username": "a", "email": "b", "name": "c"}, NAMES)


def test_an_https_providers_endpoints_must_be_https() -> None:
    https, http = "https://corp.example", "http://127.0.0.1:4000"
    assert endpoint_allowed(https, "https://corp.example/token")
    assert not endpoint_allowed(https, "http://corp.example/token")
    assert endpoint_allowed(http, "http://127.0.0.1:4000/token")
    for wrong in ("https://", "ftp://corp.example/x", "https://corp.example/#x", None, 3):
        assert not endpoint_allowed(https, wrong)


def test_the_methods_a_provider_names_are_passed_on_registered_and_once() -> None:
    assert provider_methods(["pwd", "otp", "mfa"]) == ("pwd", "otp", "mfa")
    assert provider_methods(["hwk", "made-up", "hwk", 3, None]) == ("hwk",)
    # A provider that says nothing, or not a list, gives this server's tokens no methods.
    for given in (None, "pwd", {"pwd": True}, [], [1, 2]):
        assert provider_methods(given) == ()
    assert (
        len(
            provider_methods(
                sorted(
                    {
                        "face",
                        "fpt",
                        "geo",
                        "hwk",
                        "iris",
                        "kba",
                        "mca",
                        "mfa",
                        "otp",
                        "pin",
                        "pop",
                        "pwd",
                    }
                )
            )
        )
        == 8
    )


def test_when_the_user_signed_in_at_the_provider() -> None:
    now, started = 10_000.0, 9_990.0
    at = {"auth_time": 9_995}
    plain = {"login_forced": False, "max_age": None, "started_at": started}
    assert signed_in_at({}, now, **plain) == now  # not asked, not said: now
    assert signed_in_at(at, now, **plain) == 9_995
    assert signed_in_at(at, now, started_at=started, login_forced=True, max_age=10) == 9_995
    for claims, forced, max_age in (
        ({}, True, None),  # asked, not said
        ({}, False, 0),
        ({"auth_time": True}, True, None),  # not a number
        ({"auth_time": 9_000}, True, None),  # before this sign-in began
        ({"auth_time": 9_000}, False, 600),  # older than max_age
        ({"auth_time": now + 3600}, False, None),  # in the future
    ):
        with pytest.raises(FederationRefused):
            signed_in_at(claims, now, started_at=started, login_forced=forced, max_age=max_age)
