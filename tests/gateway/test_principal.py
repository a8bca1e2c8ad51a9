"""gateway.core.principal: scopes, audiences and client from the claim shapes issuers use."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.principal import (
    MalformedScope,
    Principal,
    audiences_of,
    from_claims,
    normalise_scopes,
)
from tests.hypothesis_profiles import examples


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ({"scope": "orders:read orders:write"}, {"orders:read", "orders:write"}),
        ({"scope": "  a   b  "}, {"a", "b"}),
        ({"scope": ""}, set()),
        ({"scp": "a b"}, {"a", "b"}),
        ({"scp": ["a", "b"]}, {"a", "b"}),
        ({"scp": ["a", 7, None, "", "b"]}, {"a", "b"}),
        ({"scope": ["a", "b"]}, {"a", "b"}),
        ({"scope": "from-scope", "scp": ["from-scp"]}, {"from-scope"}),
        ({"scope": 42, "scp": "fallback"}, {"fallback"}),
        ({"scp": {"a": True}}, set()),
        ({}, set()),
    ],
)
def test_scopes_are_normalised_from_scope_or_scp_string_or_array(
    claims: dict[str, Any], expected: set[str]
) -> None:
    assert normalise_scopes(claims) == frozenset(expected)


# RFC 6749 §3.3: scope-token = 1*( %x21 / %x23-5B / %x5D-7E ), separated by U+0020 only.
SCOPE_TOKEN = re.compile(r"[\x21\x23-\x5B\x5D-\x7E]+")


@pytest.mark.parametrize(
    "claims",
    [
        {"scope": "x\u00a0orders:write"},  # no-break space
        {"scope": "orders:read x\u3000orders:write"},  # ideographic space
        {"scope": "x\u001forders:write"},  # unit separator: str.split() splits on it
        {"scope": "orders:read\torders:write"},
        {"scope": "orders:read\norders:write"},
        {"scope": "orders:read\r\norders:write"},
        {"scope": "orders:read \u2028orders:write"},
        {"scope": "caf\u00e9"},
        {"scope": 'say"hello"'},
        {"scope": "back\\slash"},
        {"scope": "orders:read \x7f"},
        {"scp": ["x orders:write"]},
        {"scp": ["orders:read", "x orders:write"]},
        {"scope": ["orders:read orders:write"]},
        {"scp": ["orders:read", "x\u00a0orders:write"]},
        {"scp": [" orders:write"]},
        {"scope": "x\u00a0orders:write", "scp": ["orders:write"]},
    ],
)
def test_scopes_smuggled_past_the_space_separator_are_refused(claims: dict[str, Any]) -> None:
    """A scope claim whose tokens hold anything but RFC 6749 §3.3 scope-token characters is
    malformed: refused, never split some other way into scopes the issuer did not grant."""
    with pytest.raises(MalformedScope):
        normalise_scopes(claims)


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ({"scope": "orders:read orders:write"}, {"orders:read", "orders:write"}),
        ({"scope": "https://api.example.com/orders.read!#$%&'()*+,-./:;<=>?@[]^_`{|}~"}, None),
        ({"scp": ["orders:read", "orders:write"]}, {"orders:read", "orders:write"}),
        ({"scp": ["a:b", "c"]}, {"a:b", "c"}),
    ],
)
def test_every_scope_token_character_is_accepted(
    claims: dict[str, Any], expected: set[str] | None
) -> None:
    scopes = normalise_scopes(claims)
    if expected is None:
        expected = {claims["scope"]}
    assert scopes == frozenset(expected)


SCOPE_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2028\u3000\ufeff"),
        st.sampled_from('ab:"\\'),
        st.characters(),
    ),
    max_size=30,
)


@settings(max_examples=examples(400), deadline=None)
@given(text=SCOPE_TEXT)
def test_a_scope_string_is_split_on_u0020_only_or_refused(text: str) -> None:
    try:
        scopes = normalise_scopes({"scope": text})
    except MalformedScope:
        assert any(not SCOPE_TOKEN.fullmatch(t) for t in text.split(" ") if t)
        return
    assert scopes == frozenset(t for t in text.split(" ") if t)
    assert all(SCOPE_TOKEN.fullmatch(s) for s in scopes)


@settings(max_examples=examples(400), deadline=None)
@given(items=st.lists(SCOPE_TEXT, max_size=5), claim=st.sampled_from(["scope", "scp"]))
def test_each_array_element_is_one_scope_or_the_token_is_refused(
    items: list[str], claim: str
) -> None:
    try:
        scopes = normalise_scopes({claim: items})
    except MalformedScope:
        assert any(item and not SCOPE_TOKEN.fullmatch(item) for item in items)
        return
    assert scopes == frozenset(item for item in items if item)
    assert all(SCOPE_TOKEN.fullmatch(s) for s in scopes)


@settings(max_examples=examples(300), deadline=None)
@given(
    granted=SCOPE_TEXT,
    as_array=st.booleans(),
    required=st.sampled_from(["orders:write", "admin", "a"]),
)
def test_a_required_scope_is_held_only_when_granted_as_one_exact_token(
    granted: str, as_array: bool, required: str
) -> None:
    claims: dict[str, Any] = {"scp": [granted]} if as_array else {"scope": granted}
    exact = [granted] if as_array else granted.split(" ")
    try:
        scopes = normalise_scopes(claims)
    except MalformedScope:
        return
    assert (required in scopes) == (required in exact)


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ({"aud": "orders-api"}, ("orders-api",)),
        ({"aud": ["orders-api", "billing"]}, ("orders-api", "billing")),
        ({"aud": ["orders-api", 3, None]}, ("orders-api",)),
        ({"aud": []}, ()),
        ({"aud": 5}, ()),
        ({}, ()),
    ],
)
def test_audiences_come_from_an_aud_string_or_array(
    claims: dict[str, Any], expected: tuple[str, ...]
) -> None:
    assert audiences_of(claims) == expected


BASE = {"iss": "https://auth.example.com", "sub": "user-1", "exp": 1_700_000_000}


@pytest.mark.parametrize(
    ("extra", "client_id"),
    [
        ({"client_id": "webapp"}, "webapp"),
        ({"azp": "spa"}, "spa"),
        ({"client_id": "webapp", "azp": "spa"}, "webapp"),
        ({"client_id": None, "azp": "spa"}, "spa"),
        ({"client_id": 12, "azp": "spa"}, "spa"),
        ({"client_id": ""}, None),
        ({"azp": ["x"]}, None),
        ({}, None),
    ],
)
def test_client_id_prefers_client_id_and_falls_back_to_azp(
    extra: dict[str, Any], client_id: str | None
) -> None:
    assert from_claims({**BASE, **extra}).client_id == client_id


def test_principal_carries_issuer_subject_expiry_and_the_claims() -> None:
    claims = {**BASE, "aud": ["orders-api"], "scope": "a b", "email": "a@example.com"}
    assert from_claims(claims) == Principal(
        issuer="https://auth.example.com",
        subject="user-1",
        client_id=None,
        scopes=frozenset({"a", "b"}),
        audiences=("orders-api",),
        expires_at=1_700_000_000.0,
        claims=claims,
    )
    assert isinstance(from_claims(claims).expires_at, float)


def test_a_principal_cannot_be_changed_once_built_claims_included():
    """One principal serves every request with the same token (through the verified-token
    cache): nothing a request does may change what the next one sees."""
    claims = {"iss": "https://a.example", "sub": "alice", "exp": 2e9, "email": "a@example.com"}
    principal = from_claims(claims)
    with pytest.raises(AttributeError):
        principal.subject = "mallory"  # type: ignore[misc]
    with pytest.raises(TypeError):
        principal.claims["email"] = "m@example.com"  # type: ignore[index]
    claims["email"] = "m@example.com"  # the verifier's own dict, changed afterwards
    assert principal.claims["email"] == "a@example.com"
    assert not hasattr(principal, "memo")
    assert not hasattr(principal, "__dict__")


def reference_scopes(items: list[str]) -> frozenset[str] | None:
    """RFC 6749 §3.3 read one item at a time: the non-empty items, or None when one of them
    is not a scope token."""
    scopes = frozenset(item for item in items if item)
    if any(not re.fullmatch(r"[\x21\x23-\x5B\x5D-\x7E]+", scope) for scope in scopes):
        return None
    return scopes


# Scope-token characters, the space, the two visible ones left out, and other whitespace.
SCOPE_TEXT = st.text(st.sampled_from('ab:/-~! "\\\t\n\u00a0\u3000'), max_size=12)


@given(st.one_of(SCOPE_TEXT, st.lists(SCOPE_TEXT, max_size=5)))
def test_a_scope_claim_is_read_as_its_tokens_checked_one_at_a_time_would_be(
    value: str | list[str],
) -> None:
    expected = reference_scopes(value.split(" ") if isinstance(value, str) else value)
    if expected is None:
        with pytest.raises(MalformedScope):
            normalise_scopes({"scope": value})
    else:
        assert normalise_scopes({"scope": value}) == expected
