"""gateway.core.policy: issuer, audience and scope decisions for a verified principal on a route."""

from __future__ import annotations

from collections.abc import Iterable

from gateway import settings
from gateway.core import policy, rules
from gateway.core.policy import Allow, Deny
from gateway.core.principal import Principal

AUTH = "https://auth.example.com"
PARTNER = "https://partner.example.com"

CONFIG = f"""
upstream: {{url: "http://127.0.0.1:8081"}}
issuers:
  - {{issuer: "{AUTH}", audiences: [orders-api, orders-admin]}}
  - {{issuer: "{PARTNER}", audiences: [partner-api]}}
routes:
  - {{name: partner-only, path: /partner/**, issuers: ["{PARTNER}"]}}
  - {{name: billing, path: /billing/**, audience: billing-api}}
  - name: read
    path: "/orders/**"
    methods: [GET]
    scopes: {{any: ["orders:read", "orders:admin"]}}
  - name: write
    path: "/orders/{{id}}"
    methods: [PUT]
    scopes: {{all: ["orders:write", "orders:read"]}}
  - {{name: rest, path: "/**"}}
"""

LOADED = settings.load_text(CONFIG, "policy.yaml", {})
RULES = {rule.name: rule for rule in rules.compile_rules(LOADED.routes, LOADED.issuers).rules}


def principal(
    issuer: str = AUTH, audiences: Iterable[str] = ("orders-api",), scopes: Iterable[str] = ()
) -> Principal:
    return Principal(
        issuer=issuer,
        subject="user-1",
        client_id="webapp",
        scopes=frozenset(scopes),
        audiences=tuple(audiences),
        expires_at=2_000_000_000.0,
        claims={},
    )


def decide(route: str, who: Principal) -> Allow | Deny:
    return policy.decide(RULES[route], who)


ISSUER_REFUSED = Deny(401, "invalid_token", "tokens from this issuer are not accepted here")
AUDIENCE_REFUSED = Deny(401, "invalid_token", "the token is not meant for this API (audience)")


def test_token_with_a_configured_audience_and_no_scope_rule_is_allowed() -> None:
    assert decide("rest", principal()) == Allow()
    assert decide("rest", principal(audiences=["other", "orders-admin"])) == Allow()
    assert decide("rest", principal(PARTNER, ["partner-api"])) == Allow()


def test_issuer_not_accepted_on_a_route_is_invalid_token() -> None:
    assert decide("partner-only", principal(AUTH)) == ISSUER_REFUSED
    assert decide("partner-only", principal(PARTNER, ["partner-api"])) == Allow()


def test_issuer_unknown_to_the_gateway_is_invalid_token() -> None:
    assert decide("rest", principal("https://evil.example.com")) == ISSUER_REFUSED


def test_audience_not_meant_for_this_api_is_invalid_token() -> None:
    assert decide("rest", principal(audiences=["billing-api"])) == AUDIENCE_REFUSED
    assert decide("rest", principal(audiences=[])) == AUDIENCE_REFUSED
    # Each issuer's own audiences: the partner's audience is not good with the main issuer.
    assert decide("rest", principal(AUTH, ["partner-api"])) == AUDIENCE_REFUSED


def test_route_audience_replaces_the_issuer_audiences() -> None:
    assert decide("billing", principal(audiences=["orders-api"])) == AUDIENCE_REFUSED
    assert decide("billing", principal(audiences=["billing-api"])) == Allow()
    assert decide("billing", principal(PARTNER, ["billing-api"])) == Allow()


def test_any_scope_rule_is_met_by_one_of_the_scopes() -> None:
    assert decide("read", principal(scopes=["orders:read"])) == Allow()
    assert decide("read", principal(scopes=["orders:admin", "x"])) == Allow()


def test_any_scope_rule_without_a_listed_scope_is_insufficient_scope_naming_them_all() -> None:
    assert decide("read", principal(scopes=["orders:write", "profile"])) == Deny(
        403,
        "insufficient_scope",
        "the token needs one of: orders:admin orders:read",
        "orders:admin orders:read",
    )


def test_all_scope_rule_needs_every_scope() -> None:
    assert decide("write", principal(scopes=["orders:read", "orders:write", "x"])) == Allow()
    expected = Deny(
        403,
        "insufficient_scope",
        "the token needs all of: orders:read orders:write",
        "orders:read orders:write",
    )
    assert decide("write", principal(scopes=["orders:read"])) == expected
    assert decide("write", principal(scopes=[])) == expected


def test_audience_is_checked_before_scopes() -> None:
    assert decide("write", principal(audiences=["nope"], scopes=[])) == AUDIENCE_REFUSED
