"""gateway.principal: scopes, audiences and client from the claim shapes issuers use."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.principal import Principal, audiences_of, from_claims, normalise_scopes


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
