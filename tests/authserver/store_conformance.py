"""The Store conformance suite: one set of tests that every storage backend passes.

A backend's test module subclasses `StoreConformance` and provides the `make_store`
fixture: a callable that returns a new, unopened store on one database, empty when the
test starts. Every call returns another store on that same database, which is how the
suite plays a restart (close, then open again) and a second process (two stores at once).

Every test passes `now` explicitly, so nothing sleeps. Where the protocol leaves a backend
a choice, the suite holds it to bounds: refresh tokens idle-expired a minute ago are still
kept (reuse detection), those idle-expired 30 days ago are gone.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

from authserver.protocol.lifecycle import Device, Refresh
from authserver.protocol.throttle import Backoff, Cap, Refuse
from authserver.store.base import (
    AlreadyExists,
    CodeRecord,
    DeviceRecord,
    RefreshOutcome,
    RefreshRecord,
    RefreshUse,
    SessionRecord,
    Store,
)

StoreFactory = Callable[[], Store]

T0 = 1_700_000_000.0
MINUTE = 60.0
HOUR = 3600.0
DAY = 86400.0
RACERS = 20


def digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def a_code(label: str = "code", **changes: Any) -> CodeRecord:
    record = CodeRecord(
        code_hash=digest(label),
        client_id="webapp",
        subject="alice",
        redirect_uri="https://app.example.com/callback",
        scope="openid orders:read",
        audience="orders-api",
        nonce="n-0S6_WzA2Mj",
        code_challenge="E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM",
        auth_time=T0 - 30,
        expires_at=T0 + MINUTE,
        created_at=T0,
    )
    return replace(record, **changes)


def a_refresh(label: str = "rt-0", family: str = "fam-1", **changes: Any) -> RefreshRecord:
    record = RefreshRecord(
        token_hash=digest(label),
        family_id=family,
        client_id="webapp",
        subject="alice",
        scope="openid offline_access orders:read",
        audience="orders-api",
        auth_time=T0 - 30,
        created_at=T0,
        expires_at=T0 + 14 * DAY,
        family_expires_at=T0 + 90 * DAY,
        state=Refresh.ACTIVE.value,
    )
    return replace(record, **changes)


def a_successor(label: str, now: float, **changes: Any) -> RefreshRecord:
    """What a grant builds before calling use_refresh: a fresh token, its idle expiry slid."""
    return a_refresh(label, **{"created_at": now, "expires_at": now + 14 * DAY, **changes})


def sealed(label: str) -> bytes:
    return b"sealed-response-for-" + label.encode()


def a_session(label: str = "sid", **changes: Any) -> SessionRecord:
    record = SessionRecord(
        session_hash=digest(label),
        subject="alice",
        auth_time=T0,
        expires_at=T0 + 8 * HOUR,
        csrf_secret=digest("csrf-" + label),
    )
    return replace(record, **changes)


def a_device(label: str = "dc", user_code: str = "WDJBMJHT", **changes: Any) -> DeviceRecord:
    record = DeviceRecord(
        device_code_hash=digest(label),
        user_code=user_code,
        client_id="tv-app",
        scope="openid orders:read",
        audience="orders-api",
        state=Device.PENDING.value,
        subject=None,
        interval=5.0,
        last_poll=None,
        expires_at=T0 + 10 * MINUTE,
        created_at=T0,
    )
    return replace(record, **changes)


async def rotate(store: Store, old: str, new: str, now: float, grace: float = 0.0) -> RefreshUse:
    return await store.use_refresh(digest(old), now, grace, a_successor(new, now), sealed(new))


class StoreConformance:
    """Subclass in a backend's test module and provide the `make_store` fixture."""

    @pytest.fixture
    def make_store(self) -> StoreFactory:
        raise NotImplementedError("a backend's test class provides make_store")

    @pytest.fixture
    async def store(self, make_store: StoreFactory) -> AsyncIterator[Store]:
        store = make_store()
        await store.open()
        yield store
        await store.close()

    @pytest.fixture
    async def other(self, store: Store, make_store: StoreFactory) -> AsyncIterator[Store]:
        """A second store on the same database, as another process would open it."""
        other = make_store()
        await other.open()
        yield other
        await other.close()

    # -- readiness ------------------------------------------------------------------------

    async def test_ping_answers_while_open_and_raises_once_closed(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        await store.open()
        await store.ping()
        await store.close()
        with pytest.raises(Exception):  # noqa: B017 - each backend has its own error
            await store.ping()

    # -- authorization codes ------------------------------------------------------------

    @pytest.mark.parametrize(
        "code",
        [a_code(), a_code(nonce=None, code_challenge=None)],
        ids=["with-nonce-and-challenge", "without-nonce-or-challenge"],
    )
    async def test_code_is_consumed_once_then_replay_returns_the_record_and_false(
        self, store: Store, code: CodeRecord
    ) -> None:
        await store.save_code(code)
        assert await store.consume_code(code.code_hash, T0 + 1) == (code, True)
        assert await store.consume_code(code.code_hash, T0 + 2) == (code, False)
        assert await store.consume_code(code.code_hash, T0 + 3) == (code, False)

    async def test_unknown_code_consumes_to_none_and_false(self, store: Store) -> None:
        await store.save_code(a_code("known"))
        assert await store.consume_code(digest("unknown"), T0) == (None, False)
        assert await store.get_code(digest("unknown")) is None

    async def test_get_code_reads_the_code_as_issued_and_consumes_nothing(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        assert await store.get_code(code.code_hash) == code
        assert await store.get_code(code.code_hash) == code
        assert await store.consume_code(code.code_hash, T0 + 1) == (code, True)
        assert await store.get_code(code.code_hash) == code

    async def test_consume_code_leaves_expiry_to_the_caller(self, store: Store) -> None:
        code = a_code()
        await store.save_code(code)
        assert await store.consume_code(code.code_hash, code.expires_at + HOUR) == (code, True)

    async def test_saving_a_stored_code_again_raises_and_keeps_it_consumed(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        await store.consume_code(code.code_hash, T0 + 1)
        with pytest.raises(AlreadyExists):
            await store.save_code(replace(code, subject="mallory"))
        assert await store.consume_code(code.code_hash, T0 + 2) == (code, False)

    async def test_concurrent_redemptions_of_one_code_see_exactly_one_success(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        results = await asyncio.gather(
            *(store.consume_code(code.code_hash, T0 + 1) for _ in range(RACERS))
        )
        assert [first for _, first in results].count(True) == 1
        assert all(record == code for record, _ in results)

    async def test_two_stores_on_one_database_redeem_a_code_exactly_once(
        self, store: Store, other: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        results = await asyncio.gather(
            *((store, other)[i % 2].consume_code(code.code_hash, T0 + 1) for i in range(RACERS))
        )
        assert [first for _, first in results].count(True) == 1

    # -- refresh tokens ---------------------------------------------------------------

    async def test_saved_refresh_token_reads_back_as_saved(self, store: Store) -> None:
        token = a_refresh()
        await store.save_refresh(token)
        assert await store.get_refresh(token.token_hash) == token
        assert await store.get_refresh(digest("other")) is None
        assert not await store.family_revoked(token.family_id)

    async def test_saving_a_stored_refresh_token_or_family_again_raises(self, store: Store) -> None:
        token = a_refresh("rt-0", family="fam-1")
        await store.save_refresh(token)
        with pytest.raises(AlreadyExists):
            await store.save_refresh(replace(token, family_id="fam-2"))
        with pytest.raises(AlreadyExists):
            await store.save_refresh(a_refresh("rt-other", family="fam-1"))
        assert await store.get_refresh(digest("rt-other")) is None
        assert await store.get_refresh(token.token_hash) == token

    async def test_active_token_rotates_and_its_successor_joins_the_family(
        self, store: Store
    ) -> None:
        token = a_refresh("rt-0")
        await store.save_refresh(token)
        now = T0 + HOUR
        successor = a_successor("rt-1", now, scope="orders:read", auth_time=T0 - 5)

        use = await store.use_refresh(token.token_hash, now, 0.0, successor, sealed("rt-1"))

        assert use.outcome is RefreshOutcome.ROTATED
        assert use.record == replace(
            token, state=Refresh.ROTATED.value, rotated_at=now, successor_sealed=sealed("rt-1")
        )
        assert await store.get_refresh(token.token_hash) == use.record
        assert await store.get_refresh(successor.token_hash) == successor

    async def test_the_store_decides_the_successors_family_identity_and_state(
        self, store: Store
    ) -> None:
        token = a_refresh("rt-0", family="fam-1")
        await store.save_refresh(token)
        now = T0 + HOUR
        careless = a_successor(
            "rt-1",
            now - 50,
            family_id="fam-elsewhere",
            client_id="other-client",
            subject="mallory",
            family_expires_at=now + 999 * DAY,
            state=Refresh.REVOKED.value,
            rotated_at=now,
            successor_sealed=b"junk",
        )
        use = await store.use_refresh(token.token_hash, now, 0.0, careless, sealed("rt-1"))
        assert use.outcome is RefreshOutcome.ROTATED
        assert await store.get_refresh(careless.token_hash) == replace(
            careless,
            family_id="fam-1",
            client_id=token.client_id,
            subject=token.subject,
            family_expires_at=token.family_expires_at,
            created_at=now,
            state=Refresh.ACTIVE.value,
            rotated_at=None,
            successor_sealed=None,
        )

    async def test_rotation_chain_of_five_then_reuse_of_the_second_revokes_every_token(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        for n in range(5):
            use = await rotate(store, f"rt-{n}", f"rt-{n + 1}", T0 + (n + 1) * HOUR)
            assert use.outcome is RefreshOutcome.ROTATED
        await store.record_access_token("at-last", "fam-1", "webapp", T0 + 6 * HOUR)
        newest = await store.get_refresh(digest("rt-5"))
        assert newest is not None and newest.state == Refresh.ACTIVE

        reuse = await rotate(store, "rt-1", "rt-evil", T0 + 6 * HOUR, grace=10.0)

        assert reuse.outcome is RefreshOutcome.REUSED
        assert reuse.record is not None and reuse.record.token_hash == digest("rt-1")
        assert reuse.record.state == Refresh.REVOKED
        for n in range(6):
            record = await store.get_refresh(digest(f"rt-{n}"))
            assert record is not None and record.state == Refresh.REVOKED, n
        assert await store.get_refresh(digest("rt-evil")) is None
        assert await store.family_revoked("fam-1")
        assert not await store.access_token_active("at-last")
        # The newest token, the legitimate client's, is refused from now on.
        latest = await rotate(store, "rt-5", "rt-6", T0 + 7 * HOUR)
        assert latest.outcome is RefreshOutcome.REUSED
        assert await store.get_refresh(digest("rt-6")) is None

    async def test_rotated_token_within_grace_repeats_its_successor_and_changes_nothing(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        first = await rotate(store, "rt-0", "rt-1", T0 + HOUR, grace=5.0)
        assert first.outcome is RefreshOutcome.ROTATED

        for attempt in range(3):
            retry = await rotate(store, "rt-0", f"rt-retry-{attempt}", T0 + HOUR + 4, grace=5.0)
            assert retry.outcome is RefreshOutcome.GRACE
            assert retry.record == first.record
            assert retry.record is not None and retry.record.successor_sealed == sealed("rt-1")
            assert await store.get_refresh(digest(f"rt-retry-{attempt}")) is None

        successor = await store.get_refresh(digest("rt-1"))
        assert successor is not None and successor.state == Refresh.ACTIVE
        assert not await store.family_revoked("fam-1")
        assert (await rotate(store, "rt-1", "rt-2", T0 + 2 * HOUR)).outcome is (
            RefreshOutcome.ROTATED
        )

    @pytest.mark.parametrize(
        ("after_rotation", "outcome"),
        [
            (0.0, RefreshOutcome.GRACE),
            (1.999, RefreshOutcome.GRACE),
            (2.0, RefreshOutcome.REUSED),
            (HOUR, RefreshOutcome.REUSED),
        ],
    )
    async def test_grace_window_ends_exactly_grace_seconds_after_rotation(
        self, store: Store, after_rotation: float, outcome: RefreshOutcome
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        rotated_at = T0 + HOUR
        await rotate(store, "rt-0", "rt-1", rotated_at, grace=2.0)
        use = await rotate(store, "rt-0", "rt-x", rotated_at + after_rotation, grace=2.0)
        assert use.outcome is outcome
        assert await store.family_revoked("fam-1") is (outcome is RefreshOutcome.REUSED)

    async def test_zero_grace_makes_any_repeat_a_reuse(self, store: Store) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        await rotate(store, "rt-0", "rt-1", T0 + HOUR, grace=0.0)
        use = await rotate(store, "rt-0", "rt-x", T0 + HOUR, grace=0.0)
        assert use.outcome is RefreshOutcome.REUSED

    async def test_tokens_of_a_revoked_family_are_reused_even_within_grace(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        await rotate(store, "rt-0", "rt-1", T0 + HOUR, grace=5.0)
        await store.revoke_grant("fam-1", T0 + HOUR + 1)

        within_grace = await rotate(store, "rt-0", "rt-a", T0 + HOUR + 2, grace=5.0)
        successor = await rotate(store, "rt-1", "rt-b", T0 + HOUR + 3, grace=5.0)

        assert within_grace.outcome is RefreshOutcome.REUSED
        assert successor.outcome is RefreshOutcome.REUSED
        assert successor.record is not None and successor.record.state == Refresh.REVOKED
        assert await store.get_refresh(digest("rt-a")) is None
        assert await store.get_refresh(digest("rt-b")) is None

    @pytest.mark.parametrize("late", [0.0, DAY])
    async def test_idle_expired_token_is_expired_and_left_unchanged(
        self, store: Store, late: float
    ) -> None:
        token = a_refresh("rt-0", expires_at=T0 + DAY)
        await store.save_refresh(token)
        use = await rotate(store, "rt-0", "rt-1", token.expires_at + late)
        assert use == RefreshUse(RefreshOutcome.EXPIRED, token)
        assert await store.get_refresh(token.token_hash) == token
        assert await store.get_refresh(digest("rt-1")) is None
        assert not await store.family_revoked("fam-1")

    async def test_token_just_before_its_idle_expiry_still_rotates(self, store: Store) -> None:
        token = a_refresh("rt-0", expires_at=T0 + DAY)
        await store.save_refresh(token)
        use = await rotate(store, "rt-0", "rt-1", token.expires_at - 0.001)
        assert use.outcome is RefreshOutcome.ROTATED

    async def test_family_past_its_absolute_lifetime_is_expired_however_fresh_the_token(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0", family_expires_at=T0 + 10 * DAY))
        # Sliding idle expiry carries the successor past the family's absolute end.
        assert (await rotate(store, "rt-0", "rt-1", T0 + 9 * DAY)).outcome is (
            RefreshOutcome.ROTATED
        )
        successor = await store.get_refresh(digest("rt-1"))
        assert successor is not None and successor.expires_at > T0 + 10 * DAY

        use = await rotate(store, "rt-1", "rt-2", T0 + 10 * DAY)
        assert use == RefreshUse(RefreshOutcome.EXPIRED, successor)
        # A rotated token past the family's end is expired too: nothing left to protect.
        old = await rotate(store, "rt-0", "rt-3", T0 + 11 * DAY)
        assert old.outcome is RefreshOutcome.EXPIRED
        assert not await store.family_revoked("fam-1")
        assert await store.get_refresh(digest("rt-2")) is None

    async def test_unknown_refresh_token_is_unknown(self, store: Store) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        use = await rotate(store, "rt-never-issued", "rt-1", T0 + HOUR)
        assert use == RefreshUse(RefreshOutcome.UNKNOWN, None)
        assert await store.get_refresh(digest("rt-1")) is None

    async def test_successor_hash_already_stored_raises_and_rolls_the_rotation_back(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0", family="fam-1"))
        await store.save_refresh(a_refresh("rt-taken", family="fam-2"))
        with pytest.raises(AlreadyExists):
            await rotate(store, "rt-0", "rt-taken", T0 + HOUR)
        assert await store.get_refresh(digest("rt-0")) == a_refresh("rt-0", family="fam-1")
        assert (await rotate(store, "rt-0", "rt-1", T0 + HOUR)).outcome is (RefreshOutcome.ROTATED)

    async def test_concurrent_refreshes_rotate_once_and_the_rest_revoke_the_family(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        uses = await asyncio.gather(
            *(rotate(store, "rt-0", f"rt-racer-{i}", T0 + HOUR) for i in range(RACERS))
        )
        outcomes = [use.outcome for use in uses]
        assert outcomes.count(RefreshOutcome.ROTATED) == 1
        assert outcomes.count(RefreshOutcome.REUSED) == RACERS - 1
        stored = [await store.get_refresh(digest(f"rt-racer-{i}")) for i in range(RACERS)]
        winners = [record for record in stored if record is not None]
        assert len(winners) == 1 and winners[0].state == Refresh.REVOKED
        assert await store.family_revoked("fam-1")

    async def test_concurrent_refreshes_within_grace_rotate_once_and_repeat_the_winner(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        uses = await asyncio.gather(
            *(rotate(store, "rt-0", f"rt-racer-{i}", T0 + HOUR, grace=5.0) for i in range(RACERS))
        )
        (winner,) = [i for i, use in enumerate(uses) if use.outcome is RefreshOutcome.ROTATED]
        assert all(
            use.outcome is RefreshOutcome.GRACE
            and use.record is not None
            and use.record.successor_sealed == sealed(f"rt-racer-{winner}")
            for i, use in enumerate(uses)
            if i != winner
        )
        stored = [await store.get_refresh(digest(f"rt-racer-{i}")) for i in range(RACERS)]
        assert [i for i, record in enumerate(stored) if record is not None] == [winner]
        assert not await store.family_revoked("fam-1")

    async def test_two_stores_on_one_database_rotate_a_token_exactly_once(
        self, store: Store, other: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0"))
        uses = await asyncio.gather(
            *(
                rotate((store, other)[i % 2], "rt-0", f"rt-racer-{i}", T0 + HOUR, grace=5.0)
                for i in range(RACERS)
            )
        )
        outcomes = [use.outcome for use in uses]
        assert outcomes.count(RefreshOutcome.ROTATED) == 1
        assert outcomes.count(RefreshOutcome.GRACE) == RACERS - 1

    async def test_grant_revoked_before_its_family_exists_makes_the_family_start_revoked(
        self, store: Store
    ) -> None:
        await store.revoke_grant("fam-1", T0 - 1)
        await store.save_refresh(a_refresh("rt-0", family="fam-1"))
        record = await store.get_refresh(digest("rt-0"))
        assert record is not None and record.state == Refresh.REVOKED
        assert await store.family_revoked("fam-1")
        assert (await rotate(store, "rt-0", "rt-1", T0 + 1)).outcome is RefreshOutcome.REUSED

    async def test_unknown_family_is_not_revoked(self, store: Store) -> None:
        assert not await store.family_revoked("no-such-family")

    # -- grants and access tokens -------------------------------------------------------

    async def test_access_token_never_recorded_is_active(self, store: Store) -> None:
        assert await store.access_token_active("client-credentials-jti")

    async def test_revoking_a_code_grant_makes_its_access_tokens_inactive(
        self, store: Store
    ) -> None:
        await store.record_access_token("at-1", "grant-from-code", "webapp", T0 + 300)
        await store.record_access_token("at-2", "grant-from-code", "webapp", T0 + 300)
        await store.record_access_token("at-other", "another-grant", "webapp", T0 + 300)
        await store.record_access_token("at-no-grant", None, "webapp", T0 + 300)
        assert await store.access_token_active("at-1")

        await store.revoke_grant("grant-from-code", T0 + 10)

        assert not await store.access_token_active("at-1")
        assert not await store.access_token_active("at-2")
        assert await store.access_token_active("at-other")
        assert await store.access_token_active("at-no-grant")

    async def test_revoking_a_family_grant_revokes_its_refresh_and_access_tokens(
        self, store: Store
    ) -> None:
        await store.save_refresh(a_refresh("rt-0", family="fam-1"))
        await rotate(store, "rt-0", "rt-1", T0 + HOUR)
        await store.save_refresh(a_refresh("rt-other", family="fam-2"))
        await store.record_access_token("at-1", "fam-1", "webapp", T0 + HOUR + 300)
        await store.record_access_token("at-2", "fam-2", "webapp", T0 + HOUR + 300)

        await store.revoke_grant("fam-1", T0 + 2 * HOUR)
        await store.revoke_grant("fam-1", T0 + 3 * HOUR)  # again: no change, no error

        for label in ("rt-0", "rt-1"):
            record = await store.get_refresh(digest(label))
            assert record is not None and record.state == Refresh.REVOKED
        assert await store.family_revoked("fam-1")
        assert not await store.access_token_active("at-1")
        assert (await rotate(store, "rt-1", "rt-2", T0 + 4 * HOUR)).outcome is (
            RefreshOutcome.REUSED
        )
        assert not await store.family_revoked("fam-2")
        assert await store.access_token_active("at-2")
        other = await store.get_refresh(digest("rt-other"))
        assert other is not None and other.state == Refresh.ACTIVE

    async def test_access_token_recorded_after_its_grant_was_revoked_is_inactive(
        self, store: Store
    ) -> None:
        await store.revoke_grant("grant-from-code", T0)
        await store.record_access_token("at-late", "grant-from-code", "webapp", T0 + 300)
        assert not await store.access_token_active("at-late")

    async def test_revoked_access_token_is_inactive_whether_or_not_it_was_recorded(
        self, store: Store
    ) -> None:
        await store.record_access_token("at-recorded", "grant-1", "webapp", T0 + 300)
        await store.record_access_token("at-sibling", "grant-1", "webapp", T0 + 300)

        await store.revoke_access_token("at-recorded", T0 + 300)
        await store.revoke_access_token("at-unrecorded", T0 + 300)
        await store.revoke_access_token("at-unrecorded", T0 + 300)  # again: no error

        assert not await store.access_token_active("at-recorded")
        assert not await store.access_token_active("at-unrecorded")
        assert await store.access_token_active("at-sibling")
        assert not await store.family_revoked("grant-1")

    async def test_recording_a_revoked_access_token_keeps_it_revoked(self, store: Store) -> None:
        await store.revoke_access_token("at-1", T0 + 300)
        await store.record_access_token("at-1", "grant-1", "webapp", T0 + 300)
        assert not await store.access_token_active("at-1")

    # -- consent ------------------------------------------------------------------------

    async def test_without_consent_no_scope_is_granted(self, store: Store) -> None:
        assert await store.granted_scopes("alice", "webapp") == frozenset()

    async def test_consent_accumulates_the_union_of_scopes_per_subject_and_client(
        self, store: Store
    ) -> None:
        await store.grant_scopes("alice", "webapp", frozenset({"openid", "orders:read"}))
        await store.grant_scopes("alice", "webapp", frozenset({"orders:read", "profile"}))
        await store.grant_scopes("alice", "webapp", frozenset())
        await store.grant_scopes("alice", "other-app", frozenset({"email"}))
        await store.grant_scopes("bob", "webapp", frozenset({"orders:write"}))

        assert await store.granted_scopes("alice", "webapp") == {"openid", "orders:read", "profile"}
        assert await store.granted_scopes("alice", "other-app") == {"email"}
        assert await store.granted_scopes("bob", "webapp") == {"orders:write"}
        assert await store.granted_scopes("bob", "other-app") == frozenset()

    async def test_concurrent_consents_lose_no_scope(self, store: Store, other: Store) -> None:
        await asyncio.gather(
            *(
                (store, other)[i % 2].grant_scopes("alice", "webapp", frozenset({f"scope-{i}"}))
                for i in range(RACERS)
            )
        )
        assert await store.granted_scopes("alice", "webapp") == {
            f"scope-{i}" for i in range(RACERS)
        }

    # -- login sessions -----------------------------------------------------------------

    async def test_session_is_found_until_it_expires(self, store: Store) -> None:
        session = a_session()
        await store.save_session(session)
        assert await store.get_session(session.session_hash, T0) == session
        assert await store.get_session(session.session_hash, session.expires_at - 0.001) == session
        assert await store.get_session(session.session_hash, session.expires_at) is None
        assert await store.get_session(digest("unknown"), T0) is None

    async def test_deleted_session_is_gone_and_others_stay(self, store: Store) -> None:
        await store.save_session(a_session("sid-1"))
        await store.save_session(a_session("sid-2", subject="bob"))
        await store.delete_session(digest("sid-1"))
        await store.delete_session(digest("sid-1"))  # again: no error
        assert await store.get_session(digest("sid-1"), T0) is None
        assert await store.get_session(digest("sid-2"), T0) == a_session("sid-2", subject="bob")

    async def test_saving_a_stored_session_again_raises(self, store: Store) -> None:
        await store.save_session(a_session())
        with pytest.raises(AlreadyExists):
            await store.save_session(a_session(subject="mallory"))
        assert await store.get_session(digest("sid"), T0) == a_session()

    # -- throttles on guessing ----------------------------------------------------------

    async def test_a_cap_admits_its_limit_then_refuses_for_the_window(self, store: Store) -> None:
        cap = Cap("login:ip:192.0.2.1", limit=3, window=MINUTE)
        assert [await store.reserve_attempt([cap], T0 + i) for i in range(3)] == [None] * 3
        assert await store.reserve_attempt([cap], T0 + 3) == Refuse(cap.key, MINUTE)
        assert await store.reserve_attempt([cap], T0 + 3) == Refuse(cap.key, MINUTE)
        other = Cap("login:ip:192.0.2.2", limit=3, window=MINUTE)
        assert await store.reserve_attempt([other], T0 + 3) is None

    async def test_a_cap_admits_again_once_a_window_passed_without_an_attempt(
        self, store: Store
    ) -> None:
        cap = Cap("device:ip:192.0.2.1", limit=2, window=MINUTE)
        await store.reserve_attempt([cap], T0)
        await store.reserve_attempt([cap], T0 + 30)
        # A refused attempt is not charged, so it does not keep the run going.
        assert await store.reserve_attempt([cap], T0 + 89) is not None
        assert await store.reserve_attempt([cap], T0 + 90) is None
        assert await store.reserve_attempt([cap], T0 + 91) is None
        assert await store.reserve_attempt([cap], T0 + 92) is not None

    async def test_an_attempt_is_charged_to_every_key_or_to_none(self, store: Store) -> None:
        address = Cap("device:ip:192.0.2.1", limit=3, window=MINUTE)
        first = Cap("device:session:a", limit=5, window=MINUTE)
        second = Cap("device:session:b", limit=2, window=MINUTE)
        for i in range(3):
            assert await store.reserve_attempt([first, address], T0 + i) is None
        assert await store.reserve_attempt([second, address], T0 + 3) == Refuse(address.key, MINUTE)
        # The refused attempt charged nothing to the second session: both of its attempts
        # are still there, from another address.
        elsewhere = Cap("device:ip:192.0.2.2", limit=10, window=MINUTE)
        assert await store.reserve_attempt([second, elsewhere], T0 + 4) is None
        assert await store.reserve_attempt([second, elsewhere], T0 + 5) is None
        assert await store.reserve_attempt([second, elsewhere], T0 + 6) == Refuse(
            second.key, MINUTE
        )

    async def test_the_refusal_asking_the_longest_wait_is_returned(self, store: Store) -> None:
        cap = Cap("login:ip:192.0.2.1", limit=1, window=HOUR)
        backoff = Backoff("login:user:alice", free=1, first_delay=1.0, max_delay=8.0, idle=HOUR)
        assert await store.reserve_attempt([backoff, cap], T0) is None
        assert await store.reserve_attempt([backoff, cap], T0) == Refuse(cap.key, HOUR)
        assert await store.reserve_attempt([backoff], T0 + 0.25) == Refuse(backoff.key, 0.75)

    async def test_a_backoff_admits_its_free_attempts_then_doubles_the_delay_up_to_its_cap(
        self, store: Store
    ) -> None:
        backoff = Backoff("login:user:alice", free=2, first_delay=1.0, max_delay=4.0, idle=HOUR)
        assert await store.reserve_attempt([backoff], T0) is None
        assert await store.reserve_attempt([backoff], T0) is None
        assert await store.reserve_attempt([backoff], T0) == Refuse(backoff.key, 1.0)
        # Waits of 1, 2, 4, then 4 again: the delay stops growing at max_delay.
        for at in (T0 + 1, T0 + 3, T0 + 7, T0 + 11):
            assert await store.reserve_attempt([backoff], at - 0.5) == Refuse(backoff.key, 0.5)
            assert await store.reserve_attempt([backoff], at) is None
        # After `idle` without an attempt, the run starts over with its free attempts.
        later = T0 + 11 + HOUR
        assert await store.reserve_attempt([backoff], later) is None
        assert await store.reserve_attempt([backoff], later) is None
        assert await store.reserve_attempt([backoff], later) is not None

    async def test_a_released_attempt_is_given_back_to_its_own_run_only(self, store: Store) -> None:
        cap = Cap("login:ip:192.0.2.1", limit=2, window=MINUTE)
        await store.reserve_attempt([cap], T0)
        await store.reserve_attempt([cap], T0 + 1)
        await store.release_attempt([cap.key, "login:ip:never-seen"], T0 + 1)
        assert await store.reserve_attempt([cap], T0 + 2) is None
        assert await store.reserve_attempt([cap], T0 + 3) is not None
        # A new run: an attempt of the old one, released now, gives nothing back to it.
        run = T0 + 3 + MINUTE
        await store.reserve_attempt([cap], run)
        await store.reserve_attempt([cap], run + 1)
        await store.release_attempt([cap.key], T0 + 2)
        assert await store.reserve_attempt([cap], run + 2) is not None

    async def test_a_cleared_counter_starts_again_from_zero(self, store: Store) -> None:
        alice = Cap("login:user-at-ip:192.0.2.1 alice", limit=1, window=MINUTE)
        bob = Cap("login:user-at-ip:192.0.2.1 bob", limit=1, window=MINUTE)
        await store.reserve_attempt([alice], T0)
        await store.reserve_attempt([bob], T0)
        await store.clear_failures(alice.key)
        await store.clear_failures("login:nobody")
        assert await store.reserve_attempt([alice], T0 + 1) is None
        assert await store.reserve_attempt([bob], T0 + 1) is not None

    async def test_concurrent_reservations_admit_exactly_the_limit(self, store: Store) -> None:
        cap = Cap("device:ip:192.0.2.1", limit=7, window=MINUTE)
        results = await asyncio.gather(
            *(store.reserve_attempt([cap], T0) for _ in range(3 * RACERS))
        )
        assert results.count(None) == 7
        assert all(result == Refuse(cap.key, MINUTE) for result in results if result)

    async def test_two_stores_on_one_database_admit_exactly_the_limit_of_a_shared_key(
        self, store: Store, other: Store
    ) -> None:
        # Every caller its own session, all of them one address: the address decides.
        address = Cap("device:ip:192.0.2.1", limit=7, window=MINUTE)
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].reserve_attempt(
                    [Cap(f"device:session:{i}", limit=5, window=MINUTE), address], T0
                )
                for i in range(3 * RACERS)
            )
        )
        assert results.count(None) == 7
        assert await other.reserve_attempt([address], T0 + 1) is not None

    async def test_two_stores_on_one_database_admit_exactly_the_free_attempts_of_a_backoff(
        self, store: Store, other: Store
    ) -> None:
        backoff = Backoff("login:user:alice", free=5, first_delay=1.0, max_delay=60.0, idle=HOUR)
        results = await asyncio.gather(
            *((store, other)[i % 2].reserve_attempt([backoff], T0) for i in range(3 * RACERS))
        )
        assert results.count(None) == 5

    # -- client assertion replay cache --------------------------------------------------

    async def test_assertion_jti_is_accepted_once_per_client(self, store: Store) -> None:
        assert await store.use_jti("client-a", "jti-1", T0 + 300, T0)
        assert not await store.use_jti("client-a", "jti-1", T0 + 300, T0 + 1)
        assert not await store.use_jti("client-a", "jti-1", T0 + 300, T0 + 299)
        assert await store.use_jti("client-b", "jti-1", T0 + 300, T0 + 2)
        assert await store.use_jti("client-a", "jti-2", T0 + 300, T0 + 3)

    async def test_assertion_jti_is_forgotten_once_it_expired(self, store: Store) -> None:
        assert await store.use_jti("client-a", "jti-1", T0 + 300, T0)
        assert await store.use_jti("client-a", "jti-1", T0 + 900, T0 + 300)
        assert not await store.use_jti("client-a", "jti-1", T0 + 900, T0 + 301)

    async def test_concurrent_uses_of_one_jti_accept_exactly_one(
        self, store: Store, other: Store
    ) -> None:
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].use_jti("client-a", "jti-1", T0 + 300, T0)
                for i in range(RACERS)
            )
        )
        assert results.count(True) == 1

    # -- device authorization -----------------------------------------------------------

    async def test_device_code_is_found_by_user_code_until_it_expires(self, store: Store) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.device_by_user_code("WDJBMJHT", T0) == device
        assert await store.device_by_user_code("WDJBMJHT", device.expires_at) is None
        assert await store.device_by_user_code("XXXXXXXX", T0) is None

    async def test_saving_a_taken_device_code_or_live_user_code_raises(self, store: Store) -> None:
        await store.save_device(a_device("dc-1", "WDJBMJHT"))
        with pytest.raises(AlreadyExists):
            await store.save_device(a_device("dc-2", "WDJBMJHT"))
        with pytest.raises(AlreadyExists):
            await store.save_device(a_device("dc-1", "BCDFGHJK"))
        assert await store.device_by_user_code("BCDFGHJK", T0) is None
        assert await store.poll_device(digest("dc-2"), "tv-app", T0) is None

    async def test_user_code_of_an_expired_device_code_can_be_given_out_again(
        self, store: Store
    ) -> None:
        old = a_device("dc-old", "WDJBMJHT")
        await store.save_device(old)
        new = a_device(
            "dc-new", "WDJBMJHT", created_at=old.expires_at, expires_at=old.expires_at + 600
        )
        await store.save_device(new)
        assert await store.device_by_user_code("WDJBMJHT", new.created_at) == new
        assert await store.poll_device(digest("dc-old"), "tv-app", new.created_at) is None

    async def test_device_code_is_approved_once_and_then_redeemed_by_one_poll(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)

        assert await store.decide_device("WDJBMJHT", "alice", True, T0 + 10)
        assert not await store.decide_device("WDJBMJHT", "mallory", True, T0 + 11)
        assert not await store.decide_device("WDJBMJHT", "mallory", False, T0 + 12)
        approved = replace(device, state=Device.APPROVED.value, subject="alice")
        assert await store.device_by_user_code("WDJBMJHT", T0 + 13) == approved

        assert await store.poll_device(device.device_code_hash, "tv-app", T0 + 20) == approved
        again = await store.poll_device(device.device_code_hash, "tv-app", T0 + 30)
        assert again == replace(approved, state=Device.REDEEMED.value, last_poll=T0 + 20)
        third = await store.poll_device(device.device_code_hash, "tv-app", T0 + 40)
        assert third is not None and third.state == Device.REDEEMED and third.last_poll == T0 + 30

    async def test_deciding_a_device_code_records_when_the_decider_signed_in(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.decide_device("WDJBMJHT", "alice", True, T0 + 10, auth_time=T0 - HOUR)
        approved = replace(
            device, state=Device.APPROVED.value, subject="alice", auth_time=T0 - HOUR
        )
        assert await store.device_by_user_code("WDJBMJHT", T0 + 11) == approved
        assert await store.poll_device(device.device_code_hash, "tv-app", T0 + 20) == approved

    async def test_denied_device_code_stays_denied(self, store: Store) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.decide_device("WDJBMJHT", "alice", False, T0 + 10)
        assert not await store.decide_device("WDJBMJHT", "alice", True, T0 + 11)
        denied = replace(device, state=Device.DENIED.value, subject="alice")
        assert await store.poll_device(device.device_code_hash, "tv-app", T0 + 20) == denied
        after = await store.poll_device(device.device_code_hash, "tv-app", T0 + 30)
        assert after == replace(denied, last_poll=T0 + 20)

    async def test_expired_or_unknown_device_code_cannot_be_decided(self, store: Store) -> None:
        device = a_device()
        await store.save_device(device)
        assert not await store.decide_device("WDJBMJHT", "alice", True, device.expires_at)
        assert not await store.decide_device("XXXXXXXX", "alice", True, T0)
        polled = await store.poll_device(device.device_code_hash, "tv-app", T0 + 1)
        assert polled == device

    async def test_pending_poll_records_its_time_and_returns_the_record_before_it(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.poll_device(device.device_code_hash, "tv-app", T0 + 5) == device
        assert await store.poll_device(device.device_code_hash, "tv-app", T0 + 10) == replace(
            device, last_poll=T0 + 5
        )
        assert await store.poll_device(digest("unknown"), "tv-app", T0 + 10) is None

    async def test_a_poll_by_another_client_finds_nothing_and_changes_nothing(
        self, store: Store
    ) -> None:
        pending = a_device("dc-pending", "WDJBMJHT")
        approved = a_device("dc-approved", "BCDFGHJK")
        await store.save_device(pending)
        await store.save_device(approved)
        assert await store.decide_device("BCDFGHJK", "alice", True, T0 + 1)
        for device in (pending, approved):
            assert await store.poll_device(device.device_code_hash, "intruder", T0 + 5) is None
        assert await store.device_by_user_code("WDJBMJHT", T0 + 6) == pending
        assert await store.poll_device(approved.device_code_hash, "tv-app", T0 + 10) == replace(
            approved, state=Device.APPROVED.value, subject="alice"
        )

    async def test_slow_down_lengthens_the_interval(self, store: Store) -> None:
        device = a_device(interval=5.0)
        await store.save_device(device)
        await store.slow_down_device(device.device_code_hash, 10.0)
        await store.slow_down_device(digest("unknown"), 10.0)
        record = await store.device_by_user_code(device.user_code, T0)
        assert record == replace(device, interval=10.0)

    async def test_concurrent_decisions_on_one_device_code_let_exactly_one_through(
        self, store: Store, other: Store
    ) -> None:
        await store.save_device(a_device())
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].decide_device("WDJBMJHT", f"user-{i}", i % 3 != 0, T0 + 1)
                for i in range(RACERS)
            )
        )
        (winner,) = [i for i, won in enumerate(results) if won]
        record = await store.device_by_user_code("WDJBMJHT", T0 + 2)
        assert record is not None and record.subject == f"user-{winner}"
        expected = Device.APPROVED if winner % 3 != 0 else Device.DENIED
        assert record.state == expected

    async def test_concurrent_polls_of_an_approved_code_redeem_it_exactly_once(
        self, store: Store, other: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        await store.decide_device("WDJBMJHT", "alice", True, T0 + 1)
        polls = await asyncio.gather(
            *(
                (store, other)[i % 2].poll_device(device.device_code_hash, "tv-app", T0 + 10)
                for i in range(RACERS)
            )
        )
        states = [poll.state for poll in polls if poll is not None]
        assert states.count(Device.APPROVED) == 1
        assert states.count(Device.REDEEMED) == RACERS - 1

    # -- housekeeping -------------------------------------------------------------------

    async def test_purge_of_an_empty_store_deletes_nothing(self, store: Store) -> None:
        assert await store.purge_expired(T0) == 0

    async def test_purge_deletes_what_expired_and_keeps_what_lives(self, store: Store) -> None:
        at = T0 + 1000
        await store.save_code(a_code("code-old", expires_at=T0 + 60))
        await store.save_code(a_code("code-live", expires_at=at + 60))
        await store.save_session(a_session("sid-old", expires_at=T0 + 500))
        await store.save_session(a_session("sid-live", expires_at=at + HOUR))
        await store.use_jti("client-a", "jti-old", T0 + 300, T0)
        await store.use_jti("client-a", "jti-live", at + 300, T0)
        await store.save_device(a_device("dc-old", "OLDOLDOL", expires_at=T0 + 600))
        await store.save_device(a_device("dc-live", "LIVELIVE", expires_at=at + 600))
        await store.reserve_attempt([Cap("login:old", limit=1, window=MINUTE)], T0)
        await store.reserve_attempt([Cap("login:live", limit=1, window=MINUTE)], at - 10)
        await store.record_access_token("at-old", "grant-1", "webapp", T0 + 300)
        await store.revoke_access_token("at-revoked-old", T0 + 300)
        await store.record_access_token("at-live", "grant-2", "webapp", at + 300)
        await store.revoke_grant("grant-2", T0)
        await store.save_refresh(a_refresh("rt-a0", family="fam-a", family_expires_at=T0 + 900))
        await rotate(store, "rt-a0", "rt-a1", T0 + 100)
        await store.save_refresh(a_refresh("rt-b0", family="fam-b"))
        await store.grant_scopes("alice", "webapp", frozenset({"openid"}))

        # code, session, jti, device code, throttle key: one each; two access token
        # records; the two tokens of the family past its absolute lifetime.
        assert await store.purge_expired(at) == 9
        assert await store.purge_expired(at) == 0

        assert await store.consume_code(digest("code-old"), at) == (None, False)
        assert await store.consume_code(digest("code-live"), at) == (
            a_code("code-live", expires_at=at + 60),
            True,
        )
        assert await store.get_session(digest("sid-old"), T0) is None
        assert await store.get_session(digest("sid-live"), at) is not None
        assert await store.use_jti("client-a", "jti-old", T0 + 300, T0)  # forgotten
        assert not await store.use_jti("client-a", "jti-live", at + 300, at)
        assert await store.device_by_user_code("OLDOLDOL", T0) is None
        assert await store.device_by_user_code("LIVELIVE", at) is not None
        assert await store.reserve_attempt([Cap("login:old", limit=1, window=MINUTE)], T0) is None
        live = Cap("login:live", limit=1, window=MINUTE)
        assert await store.reserve_attempt([live], at) == Refuse(live.key, MINUTE)
        assert not await store.access_token_active("at-live")
        assert await store.get_refresh(digest("rt-a0")) is None
        assert await store.get_refresh(digest("rt-a1")) is None
        assert (await rotate(store, "rt-a1", "rt-a2", at)).outcome is RefreshOutcome.UNKNOWN
        assert await store.get_refresh(digest("rt-b0")) == a_refresh("rt-b0", family="fam-b")
        assert await store.granted_scopes("alice", "webapp") == {"openid"}

    async def test_purge_drops_refresh_tokens_idle_expired_long_ago_and_keeps_recent_ones(
        self, store: Store
    ) -> None:
        # fam-1 lives 400 days; rt-0 idles out on day 14, rt-1 on day 60, rt-2 on day 200.
        await store.save_refresh(a_refresh("rt-0", family_expires_at=T0 + 400 * DAY))
        for old, new, now, idle in (
            ("rt-0", "rt-1", T0 + HOUR, T0 + 60 * DAY),
            ("rt-1", "rt-2", T0 + 2 * HOUR, T0 + 200 * DAY),
        ):
            successor = a_successor(new, now, expires_at=idle)
            use = await store.use_refresh(digest(old), now, 0.0, successor, sealed(new))
            assert use.outcome is RefreshOutcome.ROTATED
        # fam-2's only token idled out on day 14: the whole family is over.
        await store.save_refresh(a_refresh("rt-lone", family="fam-2"))

        at = T0 + 60 * DAY + MINUTE
        assert await store.purge_expired(at) == 2

        assert await store.get_refresh(digest("rt-0")) is None
        assert await store.get_refresh(digest("rt-lone")) is None
        assert (await rotate(store, "rt-lone", "rt-x", at)).outcome is RefreshOutcome.UNKNOWN
        # rt-1 idled out a minute ago: shown again, it is still caught as reuse.
        reuse = await rotate(store, "rt-1", "rt-y", at)
        assert reuse.outcome is RefreshOutcome.REUSED
        latest = await store.get_refresh(digest("rt-2"))
        assert latest is not None and latest.state == Refresh.REVOKED

    # -- durability ---------------------------------------------------------------------

    async def test_everything_survives_closing_and_reopening_the_store(
        self, make_store: StoreFactory
    ) -> None:
        first = make_store()
        await first.open()
        await first.save_code(a_code())
        await first.consume_code(digest("code"), T0 + 1)
        await first.save_code(a_code("code-unused"))
        await first.save_refresh(a_refresh("rt-0"))
        await rotate(first, "rt-0", "rt-1", T0 + HOUR, grace=5.0)
        await first.save_refresh(a_refresh("rt-doomed", family="fam-doomed"))
        await first.revoke_grant("fam-doomed", T0 + HOUR)
        await first.record_access_token("at-doomed", "fam-doomed", "webapp", T0 + HOUR + 300)
        await first.revoke_access_token("at-revoked", T0 + HOUR + 300)
        await first.grant_scopes("alice", "webapp", frozenset({"openid", "orders:read"}))
        await first.save_session(a_session())
        throttle = Cap("login:ip:192.0.2.1", limit=2, window=MINUTE)
        await first.reserve_attempt([throttle], T0)
        await first.reserve_attempt([throttle], T0 + 1)
        await first.use_jti("client-a", "jti-1", T0 + 300, T0)
        await first.save_device(a_device())
        await first.decide_device("WDJBMJHT", "alice", True, T0 + 2)
        await first.close()

        second = make_store()
        await second.open()
        try:
            assert await second.consume_code(digest("code"), T0 + 2) == (a_code(), False)
            assert await second.consume_code(digest("code-unused"), T0 + 2) == (
                a_code("code-unused"),
                True,
            )
            grace = await rotate(second, "rt-0", "rt-x", T0 + HOUR + 1, grace=5.0)
            assert grace.outcome is RefreshOutcome.GRACE
            assert grace.record is not None and grace.record.successor_sealed == sealed("rt-1")
            assert (await rotate(second, "rt-1", "rt-2", T0 + 2 * HOUR)).outcome is (
                RefreshOutcome.ROTATED
            )
            assert await second.family_revoked("fam-doomed")
            assert not await second.access_token_active("at-doomed")
            assert not await second.access_token_active("at-revoked")
            assert await second.granted_scopes("alice", "webapp") == {"openid", "orders:read"}
            assert await second.get_session(digest("sid"), T0) == a_session()
            assert await second.reserve_attempt([throttle], T0 + 2) is not None
            assert not await second.use_jti("client-a", "jti-1", T0 + 300, T0 + 3)
            polled = await second.poll_device(digest("dc"), "tv-app", T0 + 10)
            assert polled is not None and polled.state == Device.APPROVED
        finally:
            await second.close()
