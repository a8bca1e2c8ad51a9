"""The SETs the revocation events are sent as, and the cut-off entry point's times
(authserver/events.py); the stream itself is tested end to end in
tests/e2e/test_revocation_events.py."""

from __future__ import annotations

from datetime import timedelta

from authserver.events import (
    CLIENT_TOKENS_REVOKED,
    SUBJECT_TOKENS_REVOKED,
    TOKENS_REVOKED,
    Revocations,
    set_claims,
)
from authserver.store.base import EventKind, RevocationEvent, RevokedToken
from authserver.store.sqlite import SQLiteStore

ISSUER = "https://auth.example.com"
T0 = 1_700_000_000.0


def test_a_tokens_event_names_each_jti_with_its_exp_and_no_top_level_sub_or_exp() -> None:
    event = RevocationEvent(
        7,
        EventKind.TOKENS,
        "refresh_reuse",
        T0,
        T0 + 300.5,
        (RevokedToken("a", T0 + 100), RevokedToken("b", T0 + 300.5)),
    )
    claims = set_claims(event, ISSUER, T0 + 1)
    assert claims == {
        "iss": ISSUER,
        "iat": int(T0 + 1),
        "jti": "7",
        "toe": int(T0),
        "events": {
            TOKENS_REVOKED: {
                "tokens": [{"jti": "a", "exp": int(T0 + 100)}, {"jti": "b", "exp": int(T0 + 301)}],
                "reason": "refresh_reuse",
            }
        },
    }


def test_cut_off_events_name_an_iss_sub_subject_or_an_opaque_client() -> None:
    subject = RevocationEvent(
        8, EventKind.SUBJECT, "user_disabled", T0, T0 + 301, key="alice", issued_before=T0 + 1
    )
    payload = set_claims(subject, ISSUER, T0)["events"][SUBJECT_TOKENS_REVOKED]
    assert payload["subject"] == {"format": "iss_sub", "iss": ISSUER, "sub": "alice"}
    assert (payload["issued_before"], payload["exp"]) == (int(T0 + 1), int(T0 + 301))
    client = RevocationEvent(
        9, EventKind.CLIENT, "client_deleted", T0, T0 + 301, key="web", issued_before=T0 + 1
    )
    payload = set_claims(client, ISSUER, T0)["events"][CLIENT_TOKENS_REVOKED]
    assert payload["subject"] == {"format": "opaque", "id": "web"}


async def test_a_cut_off_covers_its_whole_second_and_lasts_an_access_token_lifetime(
    tmp_path,
) -> None:
    store = SQLiteStore(tmp_path / "a.db")
    await store.open()
    try:
        revocations = Revocations(store, lambda: T0 + 0.25, timedelta(minutes=5))
        event_id = await revocations.cut_off_subject("alice")
        await revocations.cut_off_client("web", "client_secret_rotated")
        subject, client = await store.revocation_events(0, T0, 10)
    finally:
        await store.close()
    assert subject.event_id == event_id
    # iat is in whole seconds: a token of T0's second, issued before or after, is covered.
    assert subject == RevocationEvent(
        event_id,
        EventKind.SUBJECT,
        "user_disabled",
        T0 + 0.25,
        T0 + 1 + 300,
        key="alice",
        issued_before=T0 + 1,
    )
    assert (client.kind, client.key, client.reason) == (
        EventKind.CLIENT,
        "web",
        "client_secret_rotated",
    )
