"""The pure protocol rules: PKCE, scope strings, the lifecycle tables, released claims and
at_hash. Plain values in, plain values out; no server."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from authserver.protocol import claims, lifecycle, pkce, scopes
from authserver.protocol.errors import ErrorCode, OAuthError
from authserver.protocol.lifecycle import Code, Device, Effect, IllegalTransition, Refresh

UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
verifiers = st.text(alphabet=UNRESERVED, min_size=43, max_size=128)

# RFC 7636 Appendix B.
RFC_VERIFIER = "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"
RFC_CHALLENGE = "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"


def error_of(call: Callable[..., object], *args: object) -> OAuthError:
    with pytest.raises(OAuthError) as info:
        call(*args)
    return info.value


# ---------------------------------------------------------------------------- PKCE


def test_s256_matches_the_rfc_7636_appendix_b_example() -> None:
    assert pkce.s256(RFC_VERIFIER) == RFC_CHALLENGE


def test_verifier_matching_its_challenge_is_accepted() -> None:
    pkce.check_verifier(RFC_VERIFIER, RFC_CHALLENGE)


@given(verifiers, verifiers)
def test_only_the_verifier_that_hashes_to_the_challenge_is_accepted(good: str, other: str) -> None:
    challenge = pkce.s256(good)
    pkce.check_verifier(good, challenge)
    if other != good:
        assert error_of(pkce.check_verifier, other, challenge).code is ErrorCode.INVALID_GRANT


def test_missing_verifier_for_a_challenged_code_is_invalid_grant() -> None:
    assert error_of(pkce.check_verifier, None, RFC_CHALLENGE).code is ErrorCode.INVALID_GRANT


def test_verifier_for_a_code_without_challenge_is_refused_as_a_downgrade() -> None:
    error = error_of(pkce.check_verifier, RFC_VERIFIER, None)
    assert error.code is ErrorCode.INVALID_GRANT
    assert "without code_challenge" in error.description


def test_no_verifier_and_no_challenge_is_accepted() -> None:
    pkce.check_verifier(None, None)


@pytest.mark.parametrize(
    "verifier",
    ["a" * 42, "a" * 129, "a" * 42 + "+", "a" * 42 + "/", "a" * 42 + "=", "a" * 42 + " "],
)
def test_verifier_outside_the_rfc_syntax_is_refused_even_if_it_hashes_right(verifier: str) -> None:
    challenge = (
        base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    )
    assert error_of(pkce.check_verifier, verifier, challenge).code is ErrorCode.INVALID_GRANT


def test_challenge_with_s256_method_is_accepted() -> None:
    pkce.check_challenge(RFC_CHALLENGE, "S256")


@pytest.mark.parametrize(
    ("challenge", "method"),
    [
        (None, "S256"),  # no PKCE at all
        (RFC_CHALLENGE, None),  # the RFC default would be plain
        (RFC_CHALLENGE, "plain"),
        (RFC_CHALLENGE, "s256"),  # methods are case-sensitive
        ("short", "S256"),
        (RFC_CHALLENGE + "!", "S256"),
        ("a" * 129, "S256"),
    ],
)
def test_challenge_that_is_missing_plain_or_malformed_is_invalid_request(
    challenge: str | None, method: str | None
) -> None:
    assert error_of(pkce.check_challenge, challenge, method).code is ErrorCode.INVALID_REQUEST


# ---------------------------------------------------------------------------- scopes


def test_scope_parsing_drops_duplicates_and_extra_spaces_keeping_order() -> None:
    assert scopes.parse("openid  email openid orders:read ") == ("openid", "email", "orders:read")


@pytest.mark.parametrize("value", [None, "", " "])
def test_absent_or_blank_scope_parses_to_nothing(value: str | None) -> None:
    assert scopes.parse(value) == ()


@pytest.mark.parametrize("value", ['a"b', "a\\b", "caf\u00e9", "a\tb"])
def test_scope_with_a_forbidden_character_is_invalid_scope(value: str) -> None:
    assert error_of(scopes.parse, value).code is ErrorCode.INVALID_SCOPE


def test_render_joins_with_single_spaces() -> None:
    assert scopes.render(("a", "b:c")) == "a b:c"


def test_requested_subset_of_allowed_scopes_passes() -> None:
    scopes.require_allowed(("a",), ("a", "b"))


def test_scope_outside_the_allowed_set_is_invalid_scope_and_not_quoted_back() -> None:
    error = error_of(scopes.require_allowed, ("a", "xyzzy"), ("a", "b"))
    assert error.code is ErrorCode.INVALID_SCOPE
    assert "xyzzy" not in error.description


def test_narrowing_keeps_the_requested_subset() -> None:
    assert scopes.narrow(("b",), ("a", "b")) == ("b",)


def test_widening_is_invalid_scope() -> None:
    assert error_of(scopes.narrow, ("a", "c"), ("a", "b")).code is ErrorCode.INVALID_SCOPE


@given(st.lists(st.sampled_from(["openid", "email", "x:y", "offline_access"]), max_size=8))
def test_parse_of_render_is_the_identity_on_distinct_scopes(items: list[str]) -> None:
    distinct = tuple(dict.fromkeys(items))
    assert scopes.parse(scopes.render(distinct)) == distinct


# ---------------------------------------------------------------------------- lifecycles


def test_an_issued_code_is_consumed_once_and_issues_tokens() -> None:
    t = lifecycle.step(lifecycle.CODE, Code.ISSUED, "redeem")
    assert (t.next_state, t.effect, t.error) == (Code.CONSUMED, Effect.ISSUE_TOKENS, None)


def test_a_consumed_code_redeemed_again_revokes_what_it_issued() -> None:
    t = lifecycle.step(lifecycle.CODE, Code.CONSUMED, "redeem")
    assert (t.next_state, t.effect, t.error) == (
        Code.CONSUMED,
        Effect.REVOKE_ISSUED,
        "invalid_grant",
    )


@pytest.mark.parametrize(
    ("state", "event", "next_state", "effect", "error"),
    [
        (Refresh.ACTIVE, "use", Refresh.ROTATED, Effect.ISSUE_TOKENS, None),
        (Refresh.ROTATED, "use_within_grace", Refresh.ROTATED, Effect.REPEAT_SUCCESSOR, None),
        (Refresh.ROTATED, "use", Refresh.REVOKED, Effect.REVOKE_FAMILY, "invalid_grant"),
        (Refresh.REVOKED, "use", Refresh.REVOKED, Effect.REJECT, "invalid_grant"),
        (Refresh.REVOKED, "use_within_grace", Refresh.REVOKED, Effect.REJECT, "invalid_grant"),
        (Refresh.ACTIVE, "revoke", Refresh.REVOKED, Effect.REVOKE_FAMILY, None),
        (Refresh.ROTATED, "revoke", Refresh.REVOKED, Effect.REVOKE_FAMILY, None),
        (Refresh.REVOKED, "revoke", Refresh.REVOKED, Effect.NONE, None),
    ],
)
def test_refresh_lifecycle_rows(
    state: Refresh, event: str, next_state: Refresh, effect: Effect, error: str | None
) -> None:
    t = lifecycle.step(lifecycle.REFRESH, state, event)
    assert (t.next_state, t.effect, t.error) == (next_state, effect, error)


def test_a_revoked_refresh_token_never_becomes_usable_again() -> None:
    for (state, _event), t in lifecycle.REFRESH.items():
        if state is Refresh.REVOKED:
            assert t.next_state is Refresh.REVOKED
            assert t.effect in (Effect.REJECT, Effect.NONE)


@pytest.mark.parametrize(
    ("state", "event", "next_state", "effect", "error"),
    [
        (Device.PENDING, "poll", Device.PENDING, Effect.REJECT, "authorization_pending"),
        (Device.PENDING, "approve", Device.APPROVED, Effect.NONE, None),
        (Device.PENDING, "deny", Device.DENIED, Effect.NONE, None),
        (Device.APPROVED, "poll", Device.REDEEMED, Effect.ISSUE_TOKENS, None),
        (Device.DENIED, "poll", Device.DENIED, Effect.REJECT, "access_denied"),
        (Device.PENDING, "poll_too_fast", Device.PENDING, Effect.RAISE_INTERVAL, "slow_down"),
        # A second redemption revokes what the first issued, as a replayed code does.
        (Device.REDEEMED, "poll", Device.REDEEMED, Effect.REVOKE_ISSUED, "invalid_grant"),
    ],
)
def test_device_lifecycle_rows(
    state: Device, event: str, next_state: Device, effect: Effect, error: str | None
) -> None:
    t = lifecycle.step(lifecycle.DEVICE, state, event)
    assert (t.next_state, t.effect, t.error) == (next_state, effect, error)


def test_only_an_approved_device_code_issues_tokens() -> None:
    issuing = [key for key, t in lifecycle.DEVICE.items() if t.effect is Effect.ISSUE_TOKENS]
    assert issuing == [(Device.APPROVED, "poll")]


@pytest.mark.parametrize(
    ("table", "state", "event"),
    [
        (lifecycle.CODE, Code.ISSUED, "revoke"),
        (lifecycle.REFRESH, Refresh.ACTIVE, "use_within_grace"),
        (lifecycle.DEVICE, Device.REDEEMED, "approve"),
    ],
)
def test_a_pair_missing_from_a_table_is_an_illegal_transition(
    table: dict[tuple[str, str], lifecycle.Transition], state: str, event: str
) -> None:
    with pytest.raises(IllegalTransition):
        lifecycle.step(table, state, event)


def test_a_decision_moves_from_the_state_it_was_made_in() -> None:
    decision = lifecycle.decide(lifecycle.CODE, Code.ISSUED, "redeem")
    assert decision.move == lifecycle.Move(Code.ISSUED, Code.CONSUMED)
    assert (decision.effect, decision.error) == (Effect.ISSUE_TOKENS, None)


def _refresh_event(state: Refresh, now: float, **given: Any) -> str:
    facts: dict[str, Any] = {
        "expires_at": 1000.0,
        "family_expires_at": 5000.0,
        "rotated_at": 100.0 if state is not Refresh.ACTIVE else None,
        "successor_state": Refresh.ACTIVE if state is not Refresh.ACTIVE else None,
        "grace": 5.0,
    }
    facts.update(given)
    return lifecycle.refresh_use_event(state, now=now, **facts)


@pytest.mark.parametrize(
    ("state", "now", "given", "event"),
    [
        (Refresh.ACTIVE, 999.999, {}, "use"),
        (Refresh.ACTIVE, 1000.0, {}, "use_expired"),  # idle expiry: from expires_at on
        (Refresh.ACTIVE, 10.0, {"family_expires_at": 10.0}, "use_expired"),
        (Refresh.ROTATED, 104.999, {}, "use_within_grace"),
        (Refresh.ROTATED, 105.0, {}, "use"),  # the window ends grace seconds after rotation
        (Refresh.ROTATED, 100.0, {"grace": 0.0}, "use"),
        # Without a grace, even a use timed before the rotation it lost to is a replay.
        (Refresh.ROTATED, 99.0, {"grace": 0.0}, "use"),
        (Refresh.ROTATED, 101.0, {"successor_state": Refresh.ROTATED}, "use"),
        (Refresh.ROTATED, 101.0, {"successor_state": Refresh.REVOKED}, "use"),
        (Refresh.ROTATED, 101.0, {"successor_state": None}, "use_within_grace"),
        # A rotated token past its own idle expiry is still reuse; past the family's end, not.
        (Refresh.ROTATED, 2000.0, {}, "use"),
        (Refresh.ROTATED, 6000.0, {}, "use_expired"),
        (Refresh.REVOKED, 101.0, {}, "use"),
    ],
)
def test_the_event_a_presented_refresh_token_is(
    state: Refresh, now: float, given: dict[str, Any], event: str
) -> None:
    assert _refresh_event(state, now, **given) == event
    lifecycle.step(lifecycle.REFRESH, state, event)  # every event has its row


def test_an_expired_refresh_token_is_refused_and_changes_nothing() -> None:
    for state in Refresh:
        t = lifecycle.step(lifecycle.REFRESH, state, "use_expired")
        assert (t.next_state, t.effect, t.error) == (state, Effect.REJECT, "invalid_grant")


def test_a_successors_idle_expiry_slides_but_never_past_the_familys_end() -> None:
    assert lifecycle.refresh_idle_expiry(100.0, 50.0, 1000.0) == 150.0
    assert lifecycle.refresh_idle_expiry(980.0, 50.0, 1000.0) == 1000.0


@pytest.mark.parametrize(
    ("last_poll", "now", "too_fast"),
    [(None, 0.0, False), (10.0, 14.89, True), (10.0, 14.9, False), (10.0, 30.0, False)],
)
def test_a_poll_is_too_fast_when_it_comes_sooner_than_the_interval_less_the_tolerance(
    last_poll: float | None, now: float, too_fast: bool
) -> None:
    assert lifecycle.poll_too_fast(last_poll, 5.0, now) is too_fast


def test_slow_down_adds_five_seconds_to_the_interval() -> None:
    assert lifecycle.slowed_down(5.0) == 10.0


def test_every_refused_transition_names_a_known_oauth_error() -> None:
    known = {code.value for code in ErrorCode}
    for table in (lifecycle.CODE, lifecycle.REFRESH, lifecycle.DEVICE):
        for t in table.values():
            assert t.error is None or t.error in known


# ---------------------------------------------------------------------------- claims


USER = {
    "name": "Alice Liddell",
    "given_name": "Alice",
    "email": "alice@example.com",
    "email_verified": True,
    "phone_number": "+44 20 7946 0000",
    "address": {"locality": "Oxford"},
    "locale": None,
}


def test_no_scope_beyond_openid_releases_no_claims() -> None:
    assert claims.released(USER, ["openid"]) == {}


def test_email_scope_releases_only_email_claims() -> None:
    assert claims.released(USER, ["openid", "email"]) == {
        "email": "alice@example.com",
        "email_verified": True,
    }


def test_profile_scope_releases_name_claims_and_skips_absent_or_null_ones() -> None:
    assert claims.released(USER, ["profile"]) == {"name": "Alice Liddell", "given_name": "Alice"}


def test_address_and_phone_scopes_release_their_claims() -> None:
    assert claims.released(USER, ["address", "phone"]) == {
        "address": {"locality": "Oxford"},
        "phone_number": "+44 20 7946 0000",
    }


def test_supported_claims_cover_the_id_token_and_every_scope_claim() -> None:
    supported = set(claims.supported_claims())
    assert {"sub", "iss", "aud", "exp", "iat", "auth_time", "nonce", "at_hash"} <= supported
    for names in claims.SCOPE_CLAIMS.values():
        assert set(names) <= supported


def _left_half_b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data[: len(data) // 2]).rstrip(b"=").decode()


def test_at_hash_matches_the_oidc_core_example() -> None:
    # The worked example of OpenID Connect Core 1.0 (RS256).
    token = "jHkWEdUXMU1BwAsC4vtUsZwnNvTIxEl0z9K3vx5KF0Y"
    assert claims.at_hash(token, "RS256") == "77QmUPtjPfzWtF2AnpK9RQ"


@pytest.mark.parametrize(
    ("alg", "hash_fn"),
    [("ES256", hashlib.sha256), ("RS256", hashlib.sha256), ("EdDSA", hashlib.sha512)],
)
def test_at_hash_uses_the_hash_of_the_signing_algorithm(
    alg: str, hash_fn: Callable[[bytes], Any]
) -> None:
    token = "an-access-token"
    expected = _left_half_b64(hash_fn(token.encode()).digest())
    assert claims.at_hash(token, alg) == expected


# ---------------------------------------------------------------------------- errors


@given(st.text())
def test_an_error_description_holds_only_the_characters_rfc_6749_allows(text: str) -> None:
    error = OAuthError(ErrorCode.INVALID_REQUEST, text)
    assert re.fullmatch(r"[\x20\x21\x23-\x5B\x5D-\x7E]*", error.description)
    assert "<" not in error.description and ">" not in error.description
    assert error.body()["error_description"] == error.description
    assert len(error.description) == len(text)


def test_an_error_description_keeps_plain_characters_and_replaces_the_rest() -> None:
    description = OAuthError(ErrorCode.INVALID_REQUEST, 'a "b" <c> \\ d\u00e9\n').description
    assert description == "a ?b? ?c? ? d??"
