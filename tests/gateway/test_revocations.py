"""The deny-set, the SSE parser and the SET checks of gateway/steps/revocations.py, without a
server (the stream end to end is in tests/e2e/test_revocation_events.py)."""

from __future__ import annotations

import logging
from datetime import timedelta
from itertools import pairwise
from types import MappingProxyType
from typing import Any

import aiohttp
import jwt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import adapter
from gateway.core.principal import Principal
from gateway.core.records import Issuer
from gateway.settings import IssuerSettings, JwksSettings
from gateway.steps.revocations import (
    CLIENT_TOKENS_REVOKED,
    MAX_EVENT_BYTES,
    REVOKED,
    STREAM_DOWN,
    SUBJECT_TOKENS_REVOKED,
    TOKENS_REVOKED,
    DenySet,
    RejectedEvent,
    SseEvent,
    SseParser,
    apply_event,
    verify_set,
)
from gateway.verifiers.jwks import KeySet
from tests.support import TestIssuer, ecdsa_twin, low_s_jws

ISSUER = "https://auth.example.com"
OTHER = "https://other.example.com"
NOW = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def principal(
    jti: Any = "t-1",
    issuer: str = ISSUER,
    sub: str = "alice",
    client_id: str | None = "webapp",
    iat: Any = NOW - 10,
) -> Principal:
    claims = {"iss": issuer, "sub": sub, "jti": jti, "iat": iat, "exp": NOW + 300}
    return Principal(
        issuer, sub, client_id, frozenset(), ("orders-api",), NOW + 300, MappingProxyType(claims)
    )


def issuer(leeway: int = 30, url: str = ISSUER) -> Issuer:
    settings = IssuerSettings(
        issuer=url, audiences=("orders-api",), leeway=timedelta(seconds=leeway)
    )
    return adapter.issuer(settings)


# ---------------------------------------------------------------------------- deny-set


def test_a_revoked_jti_is_refused_for_its_issuer_alone() -> None:
    deny = DenySet(Clock())
    deny.revoke_token(ISSUER, "t-1", NOW + 300)
    assert deny.check(principal("t-1")) == REVOKED
    assert deny.check(principal("t-2")) is None
    assert deny.check(principal("t-1", issuer=OTHER)) is None


@pytest.mark.parametrize("jti", [None, ["t-1"], {"a": 1}, 7])
def test_a_jti_that_is_not_a_string_is_looked_up_without_error(jti: Any) -> None:
    deny = DenySet(Clock())
    deny.revoke_token(ISSUER, "t-1", NOW + 300)
    assert deny.check(principal(jti)) is None


def test_a_subject_cut_off_refuses_tokens_issued_before_it_only() -> None:
    deny = DenySet(Clock())
    deny.cut_off_subject(ISSUER, "alice", NOW, NOW + 300)
    assert deny.check(principal(iat=NOW - 1)) == REVOKED
    assert deny.check(principal(iat=NOW)) is None
    assert deny.check(principal(sub="bob", iat=NOW - 1)) is None
    assert deny.check(principal(issuer=OTHER, iat=NOW - 1)) is None


@pytest.mark.parametrize("iat", [None, "yesterday", True])
def test_a_token_without_a_usable_iat_is_covered_by_a_cut_off(iat: Any) -> None:
    deny = DenySet(Clock())
    deny.cut_off_client(ISSUER, "webapp", NOW, NOW + 300)
    assert deny.check(principal(iat=iat)) == REVOKED
    assert deny.check(principal(iat=iat, client_id="other")) is None


def test_a_later_cut_off_of_the_same_subject_extends_the_earlier() -> None:
    deny = DenySet(Clock())
    deny.cut_off_subject(ISSUER, "alice", NOW, NOW + 300)
    deny.cut_off_subject(ISSUER, "alice", NOW + 50, NOW + 350)
    deny.cut_off_subject(ISSUER, "alice", NOW - 50, NOW + 10)  # older: changes nothing
    assert deny.check(principal(iat=NOW + 49)) == REVOKED
    assert deny.entries(ISSUER) == 1


def test_entries_leave_when_the_tokens_they_name_have_expired() -> None:
    clock = Clock()
    deny = DenySet(clock)
    deny.revoke_token(ISSUER, "t-1", NOW + 100)
    deny.revoke_token(ISSUER, "t-2", NOW + 200)
    deny.cut_off_subject(ISSUER, "alice", NOW, NOW + 150)
    clock.now = NOW + 160
    assert deny.prune() == 2
    assert deny.check(principal("t-1", iat=NOW - 1)) is None
    assert deny.check(principal("t-2")) == REVOKED
    assert len(deny) == 1


def test_a_full_set_drops_what_expires_first_and_counts_it() -> None:
    deny = DenySet(Clock())
    deny.limit(ISSUER, 2)
    deny.revoke_token(ISSUER, "late", NOW + 900)
    deny.revoke_token(ISSUER, "soon", NOW + 100)
    deny.revoke_token(ISSUER, "middle", NOW + 500)
    assert deny.entries(ISSUER) == 2
    assert deny.dropped == {ISSUER: 1}
    assert deny.check(principal("soon")) is None
    assert deny.check(principal("late")) == REVOKED
    assert deny.check(principal("middle")) == REVOKED


def test_an_issuer_whose_stream_is_down_past_its_lag_is_refused_whatever_the_token() -> None:
    deny = DenySet(Clock())
    deny.failing = frozenset({ISSUER})
    assert deny.check(principal()) == STREAM_DOWN
    assert deny.check(principal(issuer=OTHER)) is None


# ---------------------------------------------------------------------------- events


def set_claims(uri: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {"iss": ISSUER, "iat": int(NOW), "jti": "1", "events": {uri: payload}}


def test_a_tokens_event_revokes_each_jti_until_its_exp_plus_leeway() -> None:
    clock = Clock()
    deny = DenySet(clock)
    named = apply_event(
        set_claims(
            TOKENS_REVOKED, {"tokens": [{"jti": "a", "exp": NOW + 60}, {"jti": "b", "exp": NOW}]}
        ),
        issuer(leeway=30),
        deny,
    )
    assert named == 2
    clock.now = NOW + 80
    deny.prune()
    assert deny.check(principal("a")) == REVOKED  # exp + 30 s of leeway not reached
    assert deny.check(principal("b")) is None


def test_cut_off_events_name_the_subject_of_this_issuer_or_an_opaque_client() -> None:
    deny = DenySet(Clock())
    subject = {"format": "iss_sub", "iss": ISSUER, "sub": "alice"}
    apply_event(
        set_claims(
            SUBJECT_TOKENS_REVOKED, {"subject": subject, "issued_before": NOW, "exp": NOW + 300}
        ),
        issuer(),
        deny,
    )
    client = {"format": "opaque", "id": "machine"}
    apply_event(
        set_claims(
            CLIENT_TOKENS_REVOKED, {"subject": client, "issued_before": NOW, "exp": NOW + 300}
        ),
        issuer(),
        deny,
    )
    assert deny.check(principal(sub="alice", client_id="x")) == REVOKED
    assert deny.check(principal(sub="bob", client_id="machine")) == REVOKED
    assert deny.check(principal(sub="bob", client_id="x")) is None


@pytest.mark.parametrize(
    "uri, payload",
    [
        (TOKENS_REVOKED, {"tokens": "t-1"}),
        (TOKENS_REVOKED, {"tokens": [{"jti": 5, "exp": NOW}]}),
        (TOKENS_REVOKED, {"tokens": [{"jti": "t", "exp": "soon"}]}),
        (TOKENS_REVOKED, {"tokens": ["t-1"]}),
        (
            SUBJECT_TOKENS_REVOKED,
            {
                "subject": {"format": "iss_sub", "iss": OTHER, "sub": "alice"},
                "issued_before": NOW,
                "exp": NOW,
            },
        ),
        (
            SUBJECT_TOKENS_REVOKED,
            {
                "subject": {"format": "email", "email": "a@example.com"},
                "issued_before": NOW,
                "exp": NOW,
            },
        ),
        (CLIENT_TOKENS_REVOKED, {"subject": {"format": "opaque", "id": "c"}, "exp": NOW}),
    ],
    ids=[
        "tokens-not-list",
        "jti-number",
        "exp-text",
        "token-not-object",
        "other-issuer",
        "email",
        "no-time",
    ],
)
def test_malformed_events_are_rejected_and_change_nothing(
    uri: str, payload: dict[str, Any]
) -> None:
    deny = DenySet(Clock())
    with pytest.raises(RejectedEvent):
        apply_event(set_claims(uri, payload), issuer(), deny)
    assert len(deny) == 0


def test_an_unknown_event_type_is_ignored() -> None:
    deny = DenySet(Clock())
    claims = set_claims("https://schemas.openid.net/secevent/caep/event-type/session-revoked", {})
    assert apply_event(claims, issuer(), deny) == 0
    assert len(deny) == 0


# ---------------------------------------------------------------------------- SSE


def test_the_parser_reads_events_comments_and_every_line_ending_across_chunks() -> None:
    parser = SseParser()
    stream = (
        b": up to date\r\nid: 7\revent: revocation\ndata: a.b\r\ndata: c\n\n: hb\n\nid: 8\ndata:x\n"
    )
    items: list[SseEvent | None] = []
    for i in range(len(stream)):  # one byte at a time
        items.extend(parser.feed(stream[i : i + 1]))
    assert items[0] is None
    event = items[1]
    assert isinstance(event, SseEvent)
    assert (event.id, event.event, event.data) == ("7", "revocation", ["a.b", "c"])
    assert items[2] is None
    assert len(items) == 3  # the last event is not complete yet
    (last,) = list(parser.feed(b"\n"))
    assert isinstance(last, SseEvent) and last.data == ["x"] and last.id == "8"


def test_an_endless_line_is_refused_rather_than_buffered() -> None:
    parser = SseParser()
    with pytest.raises(ValueError):
        for _ in range(5):
            list(parser.feed(b"x" * (1024 * 1024)))


def test_an_endless_event_of_empty_data_lines_is_refused_rather_than_buffered() -> None:
    # Each `data` line with no value adds a line to the event: counted by its length on the
    # wire, not by its value's, else a stream of them grows the event without end.
    parser = SseParser()
    chunk = b"data\n" * 800
    with pytest.raises(ValueError):
        for _ in range(MAX_EVENT_BYTES // len(chunk) + 2):
            list(parser.feed(chunk))


def _items(parser: SseParser, chunks: list[bytes]) -> list[Any]:
    items: list[Any] = []
    for chunk in chunks:
        for item in parser.feed(chunk):
            items.append(None if item is None else (item.id, item.event, item.data))
    return items


_SSE_PIECES = st.sampled_from(
    [
        b"\n",
        b"\r",
        b"\r\n",
        b":c",
        b"data",
        b"data:",
        b": x",
        b"id: 4",
        b"event: e",
        b"\xc3\xa9",
        b"\xc3",
    ]
)


@given(
    stream=st.lists(_SSE_PIECES, max_size=60).map(b"".join),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=20),
)
def test_the_parser_reads_a_stream_the_same_however_it_is_cut_into_chunks(
    stream: bytes, cuts: list[int]
) -> None:
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    chunks = [stream[a:b] for a, b in pairwise(bounds)]
    whole = _items(SseParser(), [stream])
    assert _items(SseParser(), chunks) == whole
    assert _items(SseParser(), [stream[i : i + 1] for i in range(len(stream))]) == whole


def test_a_large_chunk_of_short_lines_is_read_in_one_pass() -> None:
    # 4 MB of heartbeat comments in one read: each line is taken from one split of the chunk,
    # not by copying what remains of the chunk after each line (which would take minutes).
    chunk = b":\n" * (2 * 1024 * 1024)
    parser = SseParser()
    assert sum(1 for item in parser.feed(chunk) if item is None) == 2 * 1024 * 1024
    (event,) = parser.feed(b"data: x\n\n")
    assert isinstance(event, SseEvent) and event.data == ["x"]


# ---------------------------------------------------------------------------- SET signature


def issuer_at(url: str) -> Issuer:
    return issuer(url=url)  # in the tests below, `issuer` is the fixture


def signed_set(issuer: TestIssuer, claims: dict[str, Any]) -> str:
    """`claims` as a SET of `issuer`, signed as the authorization server signs: low S."""
    key = issuer.key("ES256")
    token = jwt.encode(claims, key.private, "ES256", {"typ": "secevent+jwt", "kid": key.kid})
    return low_s_jws(token)


@pytest.mark.parametrize(
    ("jti", "accepted"),
    [
        ("1", True),
        ("9000000000000000000", True),
        ("\u00b2", False),
        ("\u0661", False),
        ("1\u00b2", False),
        ("", False),
    ],
)
async def test_a_set_id_must_be_ascii_digits(
    issuer: TestIssuer, client: aiohttp.ClientSession, jti: str, accepted: bool
) -> None:
    # str.isdigit() also takes superscripts and other scripts' digits, which int() refuses:
    # applied, such an event would leave a Last-Event-ID the stream could not resume from.
    claims = set_claims(TOKENS_REVOKED, {"tokens": [{"jti": "a", "exp": NOW + 60}]})
    claims.update(iss=issuer.url, jti=jti)
    token = signed_set(issuer, claims)
    target = issuer_at(issuer.url)
    keys = KeySet(target, JwksSettings(), client)
    if accepted:
        assert (await verify_set(token, target, keys))["jti"] == jti
    else:
        with pytest.raises(RejectedEvent, match="event id"):
            await verify_set(token, target, keys)


async def test_the_other_spelling_of_a_sets_signature_is_refused(
    issuer: TestIssuer, client: aiohttp.ClientSession
) -> None:
    # (r, n - s) verifies as well as (r, s); the authorization server signs the low-S
    # spelling alone, so the other is refused as a bad signature (portcullis/jose.py).
    claims = set_claims(TOKENS_REVOKED, {"tokens": [{"jti": "a", "exp": NOW + 60}]})
    claims["iss"] = issuer.url
    token = signed_set(issuer, claims)
    target = issuer_at(issuer.url)
    keys = KeySet(target, JwksSettings(), client)
    assert (await verify_set(token, target, keys))["jti"] == "1"
    with pytest.raises(RejectedEvent, match="signature invalid"):
        await verify_set(ecdsa_twin(token), target, keys)


async def test_the_two_key_sets_of_an_issuer_with_revocation_events_say_which_they_are(
    issuer: TestIssuer, client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """An issuer whose revocation events are followed has a key set for its tokens and one
    for its events: their log lines tell them apart instead of saying the same twice."""
    target = issuer_at(issuer.url)
    caplog.set_level(logging.INFO, logger="portcullis.gateway.jwks")
    for keys in (
        KeySet(target, JwksSettings(), client),
        KeySet(target, JwksSettings(), client, purpose="revocation events"),
    ):
        assert await keys.refresh()
    loaded = [r for r in caplog.records if r.getMessage() == "jwks loaded"]
    assert [getattr(r, "for") for r in loaded] == ["access tokens", "revocation events"]
