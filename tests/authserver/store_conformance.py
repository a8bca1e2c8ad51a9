"""The Store conformance suite: one set of tests that every storage backend passes.

A backend's test module subclasses `StoreConformance` and provides the `make_store`
fixture: a callable that returns a new, unopened store on one database, empty when the
test starts. Every call returns another store on that same database, which is how the
suite plays a restart (close, then open again) and a second process (two stores at once).

Each invariant the Store protocol's docstrings state (store/base.py) has a test here, named
after it: what a call changes, what it leaves unchanged when its compare-and-set condition
fails or a key is taken, and how many of many concurrent callers, on one store and on two
stores sharing the database, may succeed. A backend never decides a lifecycle question:
tests hand it decisions that look wrong (an expired code redeemed, an idle-expired token
rotated) and expect them applied as given.

Every test passes `now` explicitly, so nothing sleeps. Where the protocol leaves a backend
a choice, the suite holds it to bounds: refresh tokens idle-expired a minute ago are still
kept (reuse detection), those idle-expired 30 days ago are gone.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

from authserver.protocol.lifecycle import Code, Device, Move, Refresh
from authserver.protocol.throttle import Backoff, Cap, Refuse
from authserver.store.base import (
    MANAGED_BY_API,
    MANAGED_BY_CONFIG,
    MANAGED_BY_DYNAMIC,
    MANAGED_BY_METADATA_DOCUMENT,
    SIGN_INS_KEPT,
    AccessTokenRecord,
    AlreadyExists,
    ClientRecord,
    CodeRecord,
    Consent,
    CutOff,
    DeviceRecord,
    EventKind,
    GrantRecord,
    IdentityLink,
    Issuance,
    PasskeyRecord,
    Poll,
    RefreshRecord,
    RevokedToken,
    SessionRecord,
    SigningKeyRecord,
    SigningKeys,
    SignInRecord,
    Store,
    StoreObserver,
    TotpRecord,
    UserRecord,
)

StoreFactory = Callable[[], Store]
ObservedStoreFactory = Callable[[StoreObserver], Store]
# The Store's calls, each timed under its own name; opening and closing are not calls.
STORE_CALLS = frozenset(
    name
    for name, member in vars(Store).items()
    if inspect.iscoroutinefunction(member) and name not in ("open", "close")
)

T0 = 1_700_000_000.0
MINUTE = 60.0
HOUR = 3600.0
DAY = 86400.0
RACERS = 20

REDEEM = Move(Code.ISSUED, Code.CONSUMED)
ROTATE = Move(Refresh.ACTIVE, Refresh.ROTATED)
APPROVE = Move(Device.PENDING, Device.APPROVED)
DENY = Move(Device.PENDING, Device.DENIED)
# A DPoP key's JWK SHA-256 thumbprint (RFC 7638), as codes and refresh tokens are bound to.
JKT = "0ZcOCORZNYy-DWpqq30jZyJGHTN0d2HglBV3uiguA4I"


def timed_operations(backend: type) -> dict[str, set[str]]:
    """For each Store call of `backend`, the operation names it hands the backend's timed
    choke points (`_call`, `_connection`, `_transaction`), read from its source."""
    tree = ast.parse(inspect.getsource(backend))
    methods = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.AsyncFunctionDef) and node.name in STORE_CALLS
    ]
    return {
        method.name: {
            node.args[0].value
            for node in ast.walk(method)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("_call", "_connection", "_transaction")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        }
        for method in methods
    }


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


def a_grant(grant_id: str = "fam-1", now: float = T0, **changes: Any) -> GrantRecord:
    record = GrantRecord(
        grant_id=grant_id,
        client_id="webapp",
        subject="alice",
        created_at=now,
        expires_at=now + 90 * DAY,
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
        amr=("pwd", "otp", "mfa"),  # read back as written, by every test of refresh tokens
    )
    return replace(record, **changes)


def an_access_token(
    jti: str, grant_id: str = "fam-1", expires_at: float = T0 + 300
) -> AccessTokenRecord:
    return AccessTokenRecord(jti, grant_id, "webapp", expires_at)


def redemption(
    grant_id: str = "fam-1",
    jti: str = "at-0",
    refresh: str | None = "rt-0",
    now: float = T0,
    family_expires_at: float = T0 + 90 * DAY,
) -> Issuance:
    """What a grant hands redeem_code: a new grant, its access token and first refresh token."""
    token = None
    if refresh is not None:
        token = a_refresh(
            refresh,
            family=grant_id,
            created_at=now,
            expires_at=min(now + 14 * DAY, family_expires_at),
            family_expires_at=family_expires_at,
        )
    grant = a_grant(grant_id, now, expires_at=family_expires_at)
    return Issuance(an_access_token(jti, grant_id, now + 300), token, grant)


def rotation(
    new: str, now: float, family: str = "fam-1", jti: str | None = None, **changes: Any
) -> Issuance:
    """What a grant hands rotate_refresh: the successor (idle expiry slid) and an access
    token, in an existing grant."""
    successor = a_refresh(
        new, family=family, **{"created_at": now, "expires_at": now + 14 * DAY, **changes}
    )
    return Issuance(an_access_token(jti or f"at-{new}", family, now + 300), successor)


def sealed(label: str) -> bytes:
    return b"sealed-response-for-" + label.encode()


async def start_family(
    store: Store, label: str = "rt-0", family: str = "fam-1", now: float = T0, **kw: Any
) -> RefreshRecord:
    """A grant with one active refresh token, as a code redemption leaves it."""
    code = a_code(f"code-of-{family}")
    await store.save_code(code)
    issuance = redemption(family, f"at-of-{family}", label, now, **kw)
    assert await store.redeem_code(code.code_hash, REDEEM, issuance)
    assert issuance.refresh_token is not None
    return issuance.refresh_token


async def rotate(store: Store, old: str, new: str, now: float, family: str = "fam-1") -> bool:
    return await store.rotate_refresh(digest(old), ROTATE, rotation(new, now, family), sealed(new))


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


def a_poll(
    state: str, last_poll: float | None, at: float, interval: float = 5.0, to: str | None = None
) -> Poll:
    return Poll(Move(state, to or state), last_poll, at, interval)


def a_signing_key(
    kid: str, alg: str = "ES256", state: str = "active", **changes: Any
) -> SigningKeyRecord:
    record = SigningKeyRecord(
        kid=kid,
        alg=alg,
        state=state,
        created_at=T0,
        activate_at=None,
        retired_at=None,
        remove_after=None,
        sealed_private_key=b"\x01sealed:" + kid.encode(),
    )
    return replace(record, **changes)


def a_client(client_id: str = "webapp", **changes: Any) -> ClientRecord:
    record = ClientRecord(
        client_id=client_id,
        metadata={
            "client_name": "Web App",
            "redirect_uris": ["https://app.example.com/callback"],
            "scope": "openid orders:read",
            "jwks": None,
        },
        secret_sha256=digest("secret-of-" + client_id),
        managed_by=MANAGED_BY_API,
        created_at=T0,
        updated_at=T0,
        tokens_valid_from=T0,
    )
    return replace(record, **changes)


def a_user(subject: str = "sub-alice", username: str = "alice", **changes: Any) -> UserRecord:
    record = UserRecord(
        subject=subject,
        username=username,
        password_hash="scrypt$4$1$1$c2FsdA$aGFzaA",
        claims={
            "email": f"{username}@example.com",
            "email_verified": True,
            "address": {"country": "FR"},
        },
        roles=("admin", "auditor"),
        disabled=False,
        managed_by=MANAGED_BY_API,
        created_at=T0,
        updated_at=T0,
    )
    return replace(record, **changes)


def a_passkey(label: str = "pk-1", subject: str = "sub-alice", **changes: Any) -> PasskeyRecord:
    record = PasskeyRecord(
        credential_id=digest(label),
        subject=subject,
        user_handle=b"handle-" + subject.encode(),
        public_key=b"cose-key-" + label.encode(),
        sign_count=0,
        transports=("internal", "hybrid"),
        backup_eligible=True,
        backed_up=False,
        name=f"Passkey {label}",
        created_at=T0,
        rp_id="auth.example",
    )
    return replace(record, **changes)


class StoreConformance:
    """Subclass in a backend's test module and provide the `make_store` fixture."""

    @pytest.fixture
    def make_store(self) -> StoreFactory:
        raise NotImplementedError("a backend's test class provides make_store")

    @pytest.fixture
    def make_observed_store(self) -> ObservedStoreFactory:
        raise NotImplementedError("a backend's test class provides make_observed_store")

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

    # -- opening ------------------------------------------------------------------------

    async def test_stores_opening_one_new_database_at_once_all_work(
        self, make_store: StoreFactory
    ) -> None:
        stores = [make_store() for _ in range(4)]
        await asyncio.gather(*(store.open() for store in stores))
        try:
            await stores[0].save_code(a_code())
            for store in stores:
                assert await store.get_code(digest("code")) == a_code()
        finally:
            await asyncio.gather(*(store.close() for store in stores))

    # -- timing ---------------------------------------------------------------------------

    async def test_each_call_is_observed_once_under_its_method_name_failures_included(
        self, make_observed_store: ObservedStoreFactory
    ) -> None:
        seen: list[tuple[str, float]] = []
        store = make_observed_store(lambda operation, seconds: seen.append((operation, seconds)))
        await store.open()
        try:
            await start_family(store)
            with pytest.raises(AlreadyExists):
                await store.save_code(a_code("code-of-fam-1"))
            await store.purge_expired(T0)
            await store.ping()
        finally:
            await store.close()
        operations = [operation for operation, _ in seen]
        assert operations == ["save_code", "redeem_code", "save_code", "purge_expired", "ping"]
        assert all(seconds > 0 for _, seconds in seen)

    def test_every_call_is_timed_under_the_name_of_its_method(
        self, make_store: StoreFactory
    ) -> None:
        assert timed_operations(type(make_store())) == {name: {name} for name in STORE_CALLS}

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
        [
            a_code(),
            a_code(nonce=None, code_challenge=None),
            a_code(state=Code.CONSUMED.value),
            a_code(dpop_jkt=JKT),
            a_code(amr=("pwd", "otp", "mfa")),
        ],
        ids=[
            "with-nonce-and-challenge",
            "without-nonce-or-challenge",
            "given-consumed",
            "bound-to-a-dpop-key",
            "signed-in-with-two-factors",
        ],
    )
    async def test_a_saved_code_reads_back_issued(self, store: Store, code: CodeRecord) -> None:
        await store.save_code(code)
        assert await store.get_code(code.code_hash) == replace(code, state=Code.ISSUED.value)
        assert await store.get_code(digest("unknown")) is None

    async def test_redeeming_a_code_consumes_it_creates_its_grant_and_records_its_tokens(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        issuance = redemption("fam-1", "at-1", "rt-1", T0 + 1)

        assert await store.redeem_code(code.code_hash, REDEEM, issuance)

        assert await store.get_code(code.code_hash) == replace(code, state=Code.CONSUMED.value)
        assert await store.get_grant("fam-1") == issuance.grant
        assert await store.get_refresh(digest("rt-1")) == issuance.refresh_token
        await store.revoke_grant("fam-1", T0 + 2)
        assert not await store.access_token_active("at-1")

    async def test_a_redemption_without_a_refresh_token_records_the_grant_and_access_token(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        issuance = redemption("grant-1", "at-1", refresh=None)
        assert await store.redeem_code(code.code_hash, REDEEM, issuance)
        assert await store.get_grant("grant-1") == issuance.grant
        assert await store.revoke_grant("grant-1", T0 + 1)
        assert not await store.access_token_active("at-1")

    async def test_a_code_no_longer_in_the_expected_state_is_not_redeemed_and_nothing_changes(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        assert await store.redeem_code(code.code_hash, REDEEM, redemption("fam-1", "at-1", "rt-1"))

        again = redemption("fam-2", "at-2", "rt-2")
        assert not await store.redeem_code(code.code_hash, REDEEM, again)
        assert not await store.redeem_code(digest("unknown"), REDEEM, again)

        assert await store.get_grant("fam-2") is None
        assert await store.get_refresh(digest("rt-2")) is None
        assert await store.revoke_grant("fam-1", T0 + 1)
        assert await store.access_token_active("at-2")  # never recorded
        assert await store.get_code(code.code_hash) == replace(code, state=Code.CONSUMED.value)

    @pytest.mark.parametrize("taken", ["grant", "access-token", "refresh-token"])
    async def test_a_redemption_clashing_with_a_stored_key_raises_and_changes_nothing(
        self, store: Store, taken: str
    ) -> None:
        await start_family(store, "rt-taken", "fam-taken")  # its access token: at-of-fam-taken
        code = a_code()
        await store.save_code(code)
        clash = {
            "grant": redemption("fam-taken", "at-1", "rt-1"),
            "access-token": redemption("fam-1", "at-of-fam-taken", "rt-1"),
            "refresh-token": redemption("fam-1", "at-1", "rt-taken"),
        }[taken]

        with pytest.raises(AlreadyExists):
            await store.redeem_code(code.code_hash, REDEEM, clash)

        assert await store.get_code(code.code_hash) == code
        if taken != "grant":
            assert await store.get_grant("fam-1") is None
        if taken != "refresh-token":
            assert await store.get_refresh(digest("rt-1")) is None
        assert await store.redeem_code(code.code_hash, REDEEM, redemption("fam-1", "at-1", "rt-1"))

    async def test_refresh_tokens_keep_their_dpop_binding_through_redemption_and_rotation(
        self, store: Store
    ) -> None:
        code = a_code(dpop_jkt=JKT)
        await store.save_code(code)
        issuance = redemption("fam-1", "at-1", "rt-1", T0)
        assert issuance.refresh_token is not None
        bound = Issuance(
            issuance.access_token, replace(issuance.refresh_token, dpop_jkt=JKT), issuance.grant
        )
        assert await store.redeem_code(code.code_hash, REDEEM, bound)
        first = await store.get_refresh(digest("rt-1"))
        assert first is not None and first.dpop_jkt == JKT

        # The successor is stored as given: bound to the key it names, or to none.
        successor = rotation("rt-2", T0 + 1, dpop_jkt=JKT)
        assert await store.rotate_refresh(digest("rt-1"), ROTATE, successor, sealed("rt-2"))
        second = await store.get_refresh(digest("rt-2"))
        assert second is not None and second.dpop_jkt == JKT
        assert second == successor.refresh_token
        unbound = rotation("rt-3", T0 + 2)
        assert await store.rotate_refresh(digest("rt-2"), ROTATE, unbound, sealed("rt-3"))
        third = await store.get_refresh(digest("rt-3"))
        assert third is not None and third.dpop_jkt is None

    async def test_redeeming_a_code_leaves_its_expiry_to_the_caller(self, store: Store) -> None:
        code = a_code()
        await store.save_code(code)
        late = code.expires_at + HOUR
        assert await store.redeem_code(code.code_hash, REDEEM, redemption("fam-1", now=late))

    async def test_saving_a_stored_code_again_raises_and_keeps_its_state(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        await store.redeem_code(code.code_hash, REDEEM, redemption())
        with pytest.raises(AlreadyExists):
            await store.save_code(replace(code, subject="mallory"))
        assert await store.get_code(code.code_hash) == replace(code, state=Code.CONSUMED.value)

    async def test_of_concurrent_redemptions_of_one_code_exactly_one_succeeds(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        results = await asyncio.gather(
            *(
                store.redeem_code(
                    code.code_hash, REDEEM, redemption(f"g-{i}", f"at-{i}", f"rt-{i}")
                )
                for i in range(RACERS)
            )
        )
        (winner,) = [i for i, won in enumerate(results) if won]
        grants = [await store.get_grant(f"g-{i}") for i in range(RACERS)]
        assert [i for i, grant in enumerate(grants) if grant is not None] == [winner]

    async def test_two_stores_on_one_database_redeem_a_code_exactly_once(
        self, store: Store, other: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].redeem_code(
                    code.code_hash, REDEEM, redemption(f"g-{i}", f"at-{i}", f"rt-{i}")
                )
                for i in range(RACERS)
            )
        )
        assert results.count(True) == 1

    # -- grants and access tokens -------------------------------------------------------

    async def test_access_token_never_recorded_is_active(self, store: Store) -> None:
        assert await store.access_token_active("client-credentials-jti")

    async def test_revoking_a_grant_revokes_its_family_and_access_tokens_and_says_so_once(
        self, store: Store
    ) -> None:
        await start_family(store, "rt-0", "fam-1")
        assert await rotate(store, "rt-0", "rt-1", T0 + HOUR)
        await start_family(store, "rt-other", "fam-2")

        assert await store.revoke_grant("fam-1", T0 + 2 * HOUR)
        assert not await store.revoke_grant("fam-1", T0 + 3 * HOUR)  # again: no change

        grant = await store.get_grant("fam-1")
        assert grant is not None and grant.revoked_at == T0 + 2 * HOUR
        for label in ("rt-0", "rt-1"):
            record = await store.get_refresh(digest(label))
            assert record is not None and record.state == Refresh.REVOKED
        for jti in ("at-of-fam-1", "at-rt-1"):
            assert not await store.access_token_active(jti)
        other = await store.get_refresh(digest("rt-other"))
        assert other is not None and other.state == Refresh.ACTIVE
        assert await store.access_token_active("at-of-fam-2")
        other_grant = await store.get_grant("fam-2")
        assert other_grant is not None and other_grant.revoked_at is None

    async def test_revoking_an_unknown_grant_changes_nothing(self, store: Store) -> None:
        assert not await store.revoke_grant("no-such-grant", T0)
        assert await store.get_grant("no-such-grant") is None

    async def test_revoked_access_token_is_inactive_whether_or_not_it_was_recorded(
        self, store: Store
    ) -> None:
        await start_family(store, "rt-0", "fam-1")
        assert await rotate(store, "rt-0", "rt-1", T0 + 1)

        await store.revoke_access_token("at-of-fam-1", T0 + 300, T0)
        await store.revoke_access_token("at-unrecorded", T0 + 300, T0)
        await store.revoke_access_token("at-unrecorded", T0 + 300, T0)  # again: no error

        assert not await store.access_token_active("at-of-fam-1")
        assert not await store.access_token_active("at-unrecorded")
        assert await store.access_token_active("at-rt-1")
        grant = await store.get_grant("fam-1")
        assert grant is not None and grant.revoked_at is None

    async def test_a_revocation_racing_rotations_leaves_no_active_token_in_the_family(
        self, store: Store, other: Store
    ) -> None:
        await start_family(store, "rt-0", "fam-1")
        half = RACERS // 2
        rotations = [
            rotate((store, other)[i % 2], "rt-0", f"rt-racer-{i}", T0 + HOUR) for i in range(RACERS)
        ]
        revocation = other.revoke_grant("fam-1", T0 + HOUR)
        results = await asyncio.gather(*rotations[:half], revocation, *rotations[half:])
        revoked, rotated = results[half], results[:half] + results[half + 1 :]

        assert revoked
        assert rotated.count(True) <= 1
        for label in ["rt-0", *(f"rt-racer-{i}" for i in range(RACERS))]:
            record = await store.get_refresh(digest(label))
            assert record is None or record.state == Refresh.REVOKED, label
        for i, won in enumerate(rotated):
            assert not await rotate(store, f"rt-racer-{i}", f"rt-after-{i}", T0 + 2 * HOUR)
            if won:
                assert not await store.access_token_active(f"at-rt-racer-{i}")

    # -- refresh tokens ---------------------------------------------------------------

    async def test_a_refresh_token_reads_back_with_its_familys_absolute_expiry(
        self, store: Store
    ) -> None:
        token = await start_family(store, "rt-0", "fam-1", family_expires_at=T0 + 30 * DAY)
        record = await store.get_refresh(digest("rt-0"))
        assert record == token
        assert record is not None and record.family_expires_at == T0 + 30 * DAY
        assert await store.get_refresh(digest("other")) is None

    async def test_a_rotation_marks_the_token_rotated_and_stores_the_successor_as_given(
        self, store: Store
    ) -> None:
        token = await start_family(store, "rt-0")
        now = T0 + HOUR
        issuance = rotation("rt-1", now, scope="orders:read", auth_time=T0 - 5)

        assert await store.rotate_refresh(token.token_hash, ROTATE, issuance, sealed("rt-1"))

        assert await store.get_refresh(token.token_hash) == replace(
            token,
            state=Refresh.ROTATED.value,
            rotated_at=now,
            successor_hash=digest("rt-1"),
            successor_sealed=sealed("rt-1"),
        )
        assert await store.get_refresh(digest("rt-1")) == issuance.refresh_token
        assert await store.revoke_grant("fam-1", now + 1)
        assert not await store.access_token_active("at-rt-1")

    async def test_a_rotation_chain_keeps_one_active_token(self, store: Store) -> None:
        await start_family(store, "rt-0")
        for n in range(5):
            assert await rotate(store, f"rt-{n}", f"rt-{n + 1}", T0 + (n + 1) * HOUR)
        states = [(await store.get_refresh(digest(f"rt-{n}"))) for n in range(6)]
        assert [record.state for record in states if record] == [Refresh.ROTATED] * 5 + [
            Refresh.ACTIVE
        ]

    async def test_a_token_no_longer_in_the_expected_state_is_not_rotated_and_nothing_changes(
        self, store: Store
    ) -> None:
        await start_family(store, "rt-0")
        assert await rotate(store, "rt-0", "rt-1", T0 + HOUR)
        first = await store.get_refresh(digest("rt-0"))

        assert not await rotate(store, "rt-0", "rt-again", T0 + HOUR + 1)
        assert not await rotate(store, "rt-never-issued", "rt-x", T0 + HOUR + 1)

        assert await store.get_refresh(digest("rt-0")) == first
        assert await store.get_refresh(digest("rt-again")) is None
        assert await store.get_refresh(digest("rt-x")) is None
        assert await store.access_token_active("at-rt-again")  # never recorded
        await store.revoke_grant("fam-1", T0 + 2 * HOUR)
        assert await store.access_token_active("at-rt-again")

    async def test_a_token_is_not_rotated_into_another_family(self, store: Store) -> None:
        token = await start_family(store, "rt-0", "fam-1")
        await start_family(store, "rt-other", "fam-2")
        assert not await rotate(store, "rt-0", "rt-1", T0 + HOUR, family="fam-2")
        assert await store.get_refresh(digest("rt-0")) == token
        assert await store.get_refresh(digest("rt-1")) is None

    async def test_a_token_of_a_revoked_grant_is_not_rotated(self, store: Store) -> None:
        await start_family(store, "rt-0", "fam-1")
        await store.revoke_grant("fam-1", T0 + 1)
        revoked = await store.get_refresh(digest("rt-0"))
        # Even told that the token is revoked, or active, it does not rotate.
        for move in (ROTATE, Move(Refresh.REVOKED, Refresh.ROTATED)):
            issuance = rotation("rt-1", T0 + 2)
            assert not await store.rotate_refresh(digest("rt-0"), move, issuance, sealed("rt-1"))
        assert await store.get_refresh(digest("rt-0")) == revoked
        assert await store.get_refresh(digest("rt-1")) is None

    @pytest.mark.parametrize("taken", ["refresh-token", "access-token"])
    async def test_a_rotation_clashing_with_a_stored_key_raises_and_changes_nothing(
        self, store: Store, taken: str
    ) -> None:
        token = await start_family(store, "rt-0", "fam-1")
        await start_family(store, "rt-taken", "fam-2")  # its access token: at-of-fam-2
        clash = {
            "refresh-token": rotation("rt-taken", T0 + HOUR),
            "access-token": rotation("rt-1", T0 + HOUR, jti="at-of-fam-2"),
        }[taken]
        with pytest.raises(AlreadyExists):
            await store.rotate_refresh(token.token_hash, ROTATE, clash, sealed("rt-x"))
        assert await store.get_refresh(token.token_hash) == token
        assert await store.get_refresh(digest("rt-1")) is None
        assert await rotate(store, "rt-0", "rt-1", T0 + HOUR)

    async def test_rotating_a_token_leaves_its_expiry_to_the_caller(self, store: Store) -> None:
        await start_family(store, "rt-0", family_expires_at=T0 + DAY)
        assert await rotate(store, "rt-0", "rt-1", T0 + 30 * DAY)

    async def test_of_concurrent_rotations_of_one_token_exactly_one_succeeds(
        self, store: Store
    ) -> None:
        await start_family(store, "rt-0")
        results = await asyncio.gather(
            *(rotate(store, "rt-0", f"rt-racer-{i}", T0 + HOUR) for i in range(RACERS))
        )
        (winner,) = [i for i, won in enumerate(results) if won]
        stored = [await store.get_refresh(digest(f"rt-racer-{i}")) for i in range(RACERS)]
        assert [i for i, record in enumerate(stored) if record is not None] == [winner]
        rotated = await store.get_refresh(digest("rt-0"))
        assert rotated is not None and rotated.successor_sealed == sealed(f"rt-racer-{winner}")

    async def test_two_stores_on_one_database_rotate_a_token_exactly_once(
        self, store: Store, other: Store
    ) -> None:
        await start_family(store, "rt-0")
        results = await asyncio.gather(
            *(
                rotate((store, other)[i % 2], "rt-0", f"rt-racer-{i}", T0 + HOUR)
                for i in range(RACERS)
            )
        )
        assert results.count(True) == 1

    async def test_a_family_rotated_from_two_stores_at_once_never_has_two_active_tokens(
        self, store: Store, other: Store
    ) -> None:
        await start_family(store, "rt-0")
        created: list[str] = []

        async def newest(on: Store) -> bytes:
            token_hash = digest("rt-0")
            while True:
                record = await on.get_refresh(token_hash)
                assert record is not None
                if record.successor_hash is None:
                    return token_hash
                token_hash = record.successor_hash

        async def follow(i: int) -> None:
            # Each racer rotates the token it finds newest, again and again.
            on = (store, other)[i % 2]
            for step in range(5):
                label = f"rt-{i}-{step}"
                issuance = rotation(label, T0 + step)
                if await on.rotate_refresh(await newest(on), ROTATE, issuance, sealed(label)):
                    created.append(label)

        await asyncio.gather(*(follow(i) for i in range(4)))
        states = [await store.get_refresh(digest(label)) for label in ["rt-0", *created]]
        assert sorted(record.state for record in states if record) == (
            [Refresh.ACTIVE] + [Refresh.ROTATED] * len(created)
        )

    # -- consent ------------------------------------------------------------------------

    async def test_without_consent_no_scope_is_granted(self, store: Store) -> None:
        assert await store.granted_scopes("alice", "webapp") == frozenset()

    async def test_consent_accumulates_the_union_of_scopes_per_subject_and_client(
        self, store: Store
    ) -> None:
        await store.grant_scopes("alice", "webapp", frozenset({"openid", "orders:read"}), T0)
        await store.grant_scopes("alice", "webapp", frozenset({"orders:read", "profile"}), T0)
        await store.grant_scopes("alice", "webapp", frozenset(), T0)
        await store.grant_scopes("alice", "other-app", frozenset({"email"}), T0)
        await store.grant_scopes("bob", "webapp", frozenset({"orders:write"}), T0)

        assert await store.granted_scopes("alice", "webapp") == {"openid", "orders:read", "profile"}
        assert await store.granted_scopes("alice", "other-app") == {"email"}
        assert await store.granted_scopes("bob", "webapp") == {"orders:write"}
        assert await store.granted_scopes("bob", "other-app") == frozenset()

    async def test_concurrent_consents_lose_no_scope(self, store: Store, other: Store) -> None:
        await asyncio.gather(
            *(
                (store, other)[i % 2].grant_scopes("alice", "webapp", frozenset({f"scope-{i}"}), T0)
                for i in range(RACERS)
            )
        )
        assert await store.granted_scopes("alice", "webapp") == {
            f"scope-{i}" for i in range(RACERS)
        }

    async def test_the_consents_of_a_subject_are_listed_per_client(self, store: Store) -> None:
        await store.grant_scopes("alice", "webapp", frozenset({"openid", "orders:read"}), T0)
        await store.grant_scopes("alice", "webapp", frozenset({"profile"}), T0 + HOUR)
        await store.grant_scopes("alice", "another", frozenset({"email"}), T0 + 2 * HOUR)
        await store.grant_scopes("bob", "webapp", frozenset({"orders:write"}), T0)
        assert await store.consents_of("alice") == [
            Consent("another", ("email",), T0 + 2 * HOUR),
            Consent("webapp", ("openid", "orders:read", "profile"), T0),
        ]
        assert await store.consents_of("nobody") == []

    async def test_withdrawing_consent_revokes_the_grants_in_force_and_records_their_events(
        self, store: Store
    ) -> None:
        await store.grant_scopes("alice", "webapp", frozenset({"openid", "orders:read"}), T0)
        await store.grant_scopes("alice", "another", frozenset({"email"}), T0)
        await start_family(store, "rt-a", "fam-a")  # alice's, to webapp
        await start_family(store, "rt-b", "fam-b")
        await store.revoke_grant("fam-b", T0 + 1)  # revoked already: no second event
        code = a_code("code-of-bob", subject="bob")
        await store.save_code(code)
        bob = redemption("fam-bob", "at-bob", "rt-bob")
        bob = replace(bob, grant=replace(bob.grant, subject="bob"))  # type: ignore[arg-type]
        assert await store.redeem_code(code.code_hash, REDEEM, bob)
        before = len(await store.revocation_events(0, T0 + 2, 100))

        assert await store.withdraw_consent("alice", "webapp", T0 + 2) == ["fam-a"]

        assert await store.granted_scopes("alice", "webapp") == frozenset()
        assert await store.granted_scopes("alice", "another") == {"email"}
        grant = await store.get_grant("fam-a")
        assert grant is not None and grant.revoked_at == T0 + 2
        assert not await store.access_token_active("at-of-fam-a")
        refresh = await store.get_refresh(digest("rt-a"))
        assert refresh is not None and refresh.state == Refresh.REVOKED.value
        bobs = await store.get_grant("fam-bob")
        assert bobs is not None and bobs.revoked_at is None  # another subject's: untouched
        events = await store.revocation_events(0, T0 + 2, 100)
        assert len(events) == before + 1
        assert events[-1].reason == "consent_withdrawn"
        assert events[-1].tokens == (RevokedToken("at-of-fam-a", T0 + 300),)
        assert await store.withdraw_consent("alice", "webapp", T0 + 3) == []  # again: nothing

    # -- login sessions -----------------------------------------------------------------

    async def test_the_sessions_of_a_subject_are_listed_latest_first_until_they_expire(
        self, store: Store
    ) -> None:
        await store.save_session(a_session("s1", auth_time=T0))
        await store.save_session(a_session("s2", auth_time=T0 + HOUR, expires_at=T0 + 2 * HOUR))
        await store.save_session(a_session("s3", subject="bob"))
        sessions = await store.sessions_of("alice", T0 + HOUR)
        assert [s.session_hash for s in sessions] == [digest("s2"), digest("s1")]
        assert sessions[0] == a_session("s2", auth_time=T0 + HOUR, expires_at=T0 + 2 * HOUR)
        later = await store.sessions_of("alice", T0 + 2 * HOUR)
        assert [s.session_hash for s in later] == [digest("s1")]

    async def test_sign_ins_are_kept_latest_first_only_the_latest_few_and_until_they_expire(
        self, store: Store
    ) -> None:
        def sign_in(at: float, outcome: str = "succeeded", subject: str = "alice") -> SignInRecord:
            return SignInRecord(subject, at, outcome, "192.0.2.7", "webapp", at + DAY)

        await store.record_sign_in(sign_in(T0, "failed"))
        await store.record_sign_in(sign_in(T0 + 1))
        await store.record_sign_in(sign_in(T0 + 2, subject="bob"))
        await store.record_sign_in(SignInRecord("alice", T0 + 3, "failed", "::1", None, T0 + 10))
        assert await store.sign_ins_of("alice", T0 + 3) == [
            SignInRecord("alice", T0 + 3, "failed", "::1", None, T0 + 10),
            sign_in(T0 + 1),
            sign_in(T0, "failed"),
        ]
        assert [s.at for s in await store.sign_ins_of("alice", T0 + 10)] == [T0 + 1, T0]
        assert await store.purge_expired(T0 + 10) == 1
        for n in range(SIGN_INS_KEPT + 5):
            await store.record_sign_in(sign_in(T0 + 100 + n))
        kept = await store.sign_ins_of("alice", T0 + 100)
        assert len(kept) == SIGN_INS_KEPT
        assert kept[0].at == T0 + 100 + SIGN_INS_KEPT + 4  # the latest stay
        assert [s.subject for s in await store.sign_ins_of("bob", T0)] == ["bob"]

    async def test_ending_the_other_sessions_keeps_this_one_and_other_subjects(
        self, store: Store
    ) -> None:
        for label in ("s1", "s2", "s3"):
            await store.save_session(a_session(label))
        await store.save_session(a_session("b1", subject="bob"))
        assert await store.delete_other_sessions("alice", digest("s2")) == 2
        assert await store.get_session(digest("s2"), T0) is not None
        assert await store.get_session(digest("s1"), T0) is None
        assert await store.get_session(digest("b1"), T0) is not None
        assert await store.delete_other_sessions("alice", digest("s2")) == 0

    async def test_session_is_found_until_it_expires(self, store: Store) -> None:
        session = a_session(address="2001:db8::7")
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

    async def test_a_session_keeps_how_the_user_signed_in(self, store: Store) -> None:
        session = a_session(amr=("pwd", "otp", "mfa"))
        await store.save_session(session)
        assert await store.get_session(session.session_hash, T0) == session

    # -- second factors -----------------------------------------------------------------

    async def test_an_enrolment_waits_until_confirmed_then_is_the_factor(
        self, store: Store
    ) -> None:
        await store.save_user(a_user(), None)
        assert await store.get_totp("sub-alice") is None
        assert await store.begin_totp(TotpRecord("sub-alice", b"sealed-1", T0))
        assert await store.get_totp("sub-alice") == TotpRecord("sub-alice", b"sealed-1", T0)
        # A second enrolment replaces the one waiting.
        assert await store.begin_totp(TotpRecord("sub-alice", b"sealed-2", T0 + 1))
        # Confirming the replaced one changes nothing.
        assert not await store.confirm_totp("sub-alice", b"sealed-1", 7, [b"r" * 32], T0 + 2)
        assert await store.confirm_totp("sub-alice", b"sealed-2", 7, [b"r" * 32, b"s" * 32], T0 + 2)
        assert await store.get_totp("sub-alice") == TotpRecord(
            "sub-alice", b"sealed-2", T0 + 1, T0 + 2, 7, 2
        )
        # Confirmed: neither confirmed again nor replaced by a new enrolment.
        assert not await store.confirm_totp("sub-alice", b"sealed-2", 8, [], T0 + 3)
        assert not await store.begin_totp(TotpRecord("sub-alice", b"sealed-3", T0 + 3))
        assert (await store.get_totp("sub-alice")) == TotpRecord(
            "sub-alice", b"sealed-2", T0 + 1, T0 + 2, 7, 2
        )

    async def test_a_time_step_is_accepted_once_and_never_an_earlier_one(
        self, store: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.begin_totp(TotpRecord("sub-alice", b"sealed", T0))
        assert not await store.use_totp_step("sub-alice", 9)  # not confirmed yet
        await store.confirm_totp("sub-alice", b"sealed", 7, [], T0)
        assert not await store.use_totp_step("sub-alice", 7)
        assert not await store.use_totp_step("sub-alice", 6)
        assert await store.use_totp_step("sub-alice", 8)
        assert not await store.use_totp_step("sub-alice", 8)
        assert await store.use_totp_step("sub-alice", 10)
        assert not await store.use_totp_step("sub-alice", 9)
        assert (await store.get_totp("sub-alice")).last_step == 10  # type: ignore[union-attr]
        assert not await store.use_totp_step("sub-unknown", 11)

    async def test_of_concurrent_uses_of_one_step_exactly_one_succeeds(
        self, store: Store, other: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.begin_totp(TotpRecord("sub-alice", b"sealed", T0))
        await store.confirm_totp("sub-alice", b"sealed", 7, [], T0)
        results = await asyncio.gather(
            *((store if i % 2 else other).use_totp_step("sub-alice", 8) for i in range(RACERS))
        )
        assert results.count(True) == 1

    async def test_a_recovery_code_is_used_once_even_when_raced(
        self, store: Store, other: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.begin_totp(TotpRecord("sub-alice", b"sealed", T0))
        await store.confirm_totp("sub-alice", b"sealed", 7, [b"a" * 32, b"b" * 32], T0)
        results = await asyncio.gather(
            *(
                (store if i % 2 else other).use_recovery_code("sub-alice", b"a" * 32, T0 + 1)
                for i in range(RACERS)
            )
        )
        assert results.count(True) == 1
        assert not await store.use_recovery_code("sub-alice", b"c" * 32, T0 + 1)
        assert not await store.use_recovery_code("sub-bob", b"b" * 32, T0 + 1)
        assert (await store.get_totp("sub-alice")).recovery_codes_left == 1  # type: ignore[union-attr]

    async def test_a_new_confirmation_replaces_every_recovery_code(self, store: Store) -> None:
        await store.save_user(a_user(), None)
        await store.begin_totp(TotpRecord("sub-alice", b"sealed", T0))
        await store.confirm_totp("sub-alice", b"sealed", 7, [b"a" * 32], T0)
        assert await store.delete_totp("sub-alice")
        assert not await store.delete_totp("sub-alice")
        assert await store.get_totp("sub-alice") is None
        assert not await store.use_recovery_code("sub-alice", b"a" * 32, T0)
        await store.begin_totp(TotpRecord("sub-alice", b"sealed-2", T0 + 1))
        await store.confirm_totp("sub-alice", b"sealed-2", 9, [b"b" * 32], T0 + 1)
        assert not await store.use_recovery_code("sub-alice", b"a" * 32, T0 + 2)
        assert await store.use_recovery_code("sub-alice", b"b" * 32, T0 + 2)

    async def test_renewed_recovery_codes_replace_every_earlier_one(
        self, store: Store, other: Store
    ) -> None:
        await store.save_user(a_user(), None)
        assert not await store.replace_recovery_codes("sub-alice", [b"x" * 32])  # no factor
        await store.begin_totp(TotpRecord("sub-alice", b"sealed", T0))
        assert not await store.replace_recovery_codes("sub-alice", [b"x" * 32])  # waiting
        assert await store.get_totp("sub-alice") == TotpRecord("sub-alice", b"sealed", T0)
        await store.confirm_totp("sub-alice", b"sealed", 7, [b"a" * 32, b"b" * 32], T0)
        assert await store.use_recovery_code("sub-alice", b"a" * 32, T0 + 1)
        assert await other.replace_recovery_codes("sub-alice", [b"c" * 32, b"d" * 32, b"e" * 32])
        assert (await store.get_totp("sub-alice")).recovery_codes_left == 3  # type: ignore[union-attr]
        assert not await store.use_recovery_code("sub-alice", b"b" * 32, T0 + 2)  # unused, gone
        assert await store.use_recovery_code("sub-alice", b"c" * 32, T0 + 2)
        assert (await store.get_totp("sub-alice")).last_step == 7  # type: ignore[union-attr]

    async def test_a_users_factor_goes_with_the_user(self, store: Store) -> None:
        await store.save_user(a_user(), None)
        await store.begin_totp(TotpRecord("sub-alice", b"sealed", T0))
        await store.confirm_totp("sub-alice", b"sealed", 7, [b"a" * 32], T0)
        assert await store.delete_user("sub-alice")
        assert await store.get_totp("sub-alice") is None
        await store.save_user(a_user(), None)
        assert await store.get_totp("sub-alice") is None
        assert not await store.use_recovery_code("sub-alice", b"a" * 32, T0)

    # -- passkeys -----------------------------------------------------------------------

    async def test_a_passkey_is_stored_once_under_its_credential_id(
        self, store: Store, other: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.save_user(a_user("sub-bob", "bob"), None)
        first = a_passkey("pk-1")
        assert await store.add_passkey(first)
        assert await other.get_passkey(first.credential_id) == first
        # WebAuthn §7.1 step 26: a credential id registered once is refused, for anyone.
        assert not await store.add_passkey(replace(first, name="again"))
        assert not await store.add_passkey(replace(first, subject="sub-bob"))
        # No passkey for a user the store does not hold.
        assert not await store.add_passkey(a_passkey("pk-x", subject="sub-nobody"))
        # The relying party id is kept as given, or unknown (a passkey of before it was).
        second = a_passkey(
            "pk-2", created_at=T0 + 1, backup_eligible=False, transports=(), rp_id=None
        )
        assert await store.add_passkey(second)
        assert await store.add_passkey(a_passkey("pk-3", subject="sub-bob"))
        assert await other.passkeys_of("sub-alice") == [first, second]
        assert await store.passkeys_of("sub-nobody") == []
        assert await store.get_passkey(digest("pk-x")) is None

    async def test_a_passkeys_counter_only_moves_forward(self, store: Store) -> None:
        await store.save_user(a_user(), None)
        await store.add_passkey(a_passkey(sign_count=5))
        cid = digest("pk-1")
        assert not await store.use_passkey(cid, 5, False, T0 + 1)  # not greater: a clone?
        assert not await store.use_passkey(cid, 4, False, T0 + 1)
        assert not await store.use_passkey(cid, 0, False, T0 + 1)
        assert (await store.get_passkey(cid)) == a_passkey(sign_count=5)  # nothing changed
        assert await store.use_passkey(cid, 9, True, T0 + 2)
        assert (await store.get_passkey(cid)) == a_passkey(
            sign_count=9, backed_up=True, last_used_at=T0 + 2
        )
        assert not await store.use_passkey(digest("pk-unknown"), 10, False, T0 + 3)

    async def test_a_passkey_without_a_counter_is_used_while_both_counters_are_zero(
        self, store: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.add_passkey(a_passkey())
        cid = digest("pk-1")
        assert await store.use_passkey(cid, 0, False, T0 + 1)
        assert await store.use_passkey(cid, 0, False, T0 + 2)
        assert await store.use_passkey(cid, 1, False, T0 + 3)
        # Once it counted, a 0 is a counter gone back.
        assert not await store.use_passkey(cid, 0, False, T0 + 4)
        assert (await store.get_passkey(cid)).last_used_at == T0 + 3  # type: ignore[union-attr]

    async def test_of_concurrent_uses_of_a_passkey_with_one_counter_exactly_one_succeeds(
        self, store: Store, other: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.add_passkey(a_passkey(sign_count=1))
        results = await asyncio.gather(
            *(
                (store if i % 2 else other).use_passkey(digest("pk-1"), 2, False, T0 + 1)
                for i in range(RACERS)
            )
        )
        assert results.count(True) == 1

    async def test_a_passkey_is_removed_by_its_owner_and_goes_with_the_user(
        self, store: Store
    ) -> None:
        await store.save_user(a_user(), None)
        await store.save_user(a_user("sub-bob", "bob"), None)
        await store.add_passkey(a_passkey("pk-1"))
        await store.add_passkey(a_passkey("pk-2"))
        assert not await store.delete_passkey("sub-bob", digest("pk-1"))  # not Bob's
        assert await store.delete_passkey("sub-alice", digest("pk-1"))
        assert not await store.delete_passkey("sub-alice", digest("pk-1"))
        assert [p.credential_id for p in await store.passkeys_of("sub-alice")] == [digest("pk-2")]
        assert await store.delete_user("sub-alice")
        assert await store.get_passkey(digest("pk-2")) is None

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

    async def test_concurrent_releases_each_give_back_one_attempt(
        self, store: Store, other: Store
    ) -> None:
        cap = Cap("login:ip:192.0.2.1", limit=RACERS, window=MINUTE)
        for _ in range(RACERS):
            assert await store.reserve_attempt([cap], T0) is None
        await asyncio.gather(
            *((store, other)[i % 2].release_attempt([cap.key], T0) for i in range(RACERS))
        )
        results = [await store.reserve_attempt([cap], T0 + 1) for _ in range(RACERS + 1)]
        assert results.count(None) == RACERS

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

    async def test_device_code_is_read_by_its_hash_whatever_its_state_or_expiry(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.get_device(device.device_code_hash) == device
        assert await store.get_device(digest("unknown")) is None

    async def test_saving_a_taken_device_code_or_live_user_code_raises(self, store: Store) -> None:
        await store.save_device(a_device("dc-1", "WDJBMJHT"))
        with pytest.raises(AlreadyExists):
            await store.save_device(a_device("dc-2", "WDJBMJHT"))
        with pytest.raises(AlreadyExists):
            await store.save_device(a_device("dc-1", "BCDFGHJK"))
        assert await store.device_by_user_code("BCDFGHJK", T0) is None
        assert await store.get_device(digest("dc-2")) is None

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
        assert await store.get_device(digest("dc-old")) is None

    async def test_a_pending_code_is_decided_once_recording_who_and_when_they_signed_in(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)

        assert await store.decide_device(
            "WDJBMJHT", APPROVE, "alice", T0 + 10, T0 - HOUR, ("pwd", "otp", "mfa")
        )
        assert not await store.decide_device("WDJBMJHT", APPROVE, "mallory", T0 + 11)
        assert not await store.decide_device("WDJBMJHT", DENY, "mallory", T0 + 12)

        approved = replace(
            device,
            state=Device.APPROVED.value,
            subject="alice",
            auth_time=T0 - HOUR,
            amr=("pwd", "otp", "mfa"),
        )
        assert await store.device_by_user_code("WDJBMJHT", T0 + 13) == approved

    async def test_a_denial_is_recorded_as_given(self, store: Store) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.decide_device("WDJBMJHT", DENY, "alice", T0 + 10)
        assert not await store.decide_device("WDJBMJHT", APPROVE, "alice", T0 + 11)
        assert await store.get_device(device.device_code_hash) == replace(
            device, state=Device.DENIED.value, subject="alice"
        )

    async def test_an_expired_or_unknown_device_code_is_not_decided(self, store: Store) -> None:
        device = a_device()
        await store.save_device(device)
        assert not await store.decide_device("WDJBMJHT", APPROVE, "alice", device.expires_at)
        assert not await store.decide_device("XXXXXXXX", APPROVE, "alice", T0)
        assert await store.get_device(device.device_code_hash) == device

    async def test_a_poll_records_its_time_state_and_interval_when_nothing_came_in_between(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.record_poll(device.device_code_hash, a_poll("pending", None, T0 + 5))
        assert await store.get_device(device.device_code_hash) == replace(device, last_poll=T0 + 5)
        slower = a_poll("pending", T0 + 5, T0 + 6, interval=10.0)
        assert await store.record_poll(device.device_code_hash, slower)
        assert await store.get_device(device.device_code_hash) == replace(
            device, last_poll=T0 + 6, interval=10.0
        )

    async def test_a_poll_decided_from_a_stale_read_changes_nothing(self, store: Store) -> None:
        device = a_device()
        await store.save_device(device)
        assert await store.record_poll(device.device_code_hash, a_poll("pending", None, T0 + 5))
        stale = [
            a_poll("pending", None, T0 + 6),  # another poll came in between
            a_poll("approved", T0 + 5, T0 + 6),  # the state read was not this one
        ]
        for poll in stale:
            assert not await store.record_poll(device.device_code_hash, poll)
        assert not await store.record_poll(digest("unknown"), a_poll("pending", None, T0 + 6))
        assert await store.get_device(device.device_code_hash) == replace(device, last_poll=T0 + 5)

    async def test_of_concurrent_polls_read_from_one_state_exactly_one_is_recorded(
        self, store: Store, other: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].record_poll(
                    device.device_code_hash, a_poll("pending", None, T0 + i)
                )
                for i in range(RACERS)
            )
        )
        (winner,) = [i for i, won in enumerate(results) if won]
        polled = await store.get_device(device.device_code_hash)
        assert polled is not None and polled.last_poll == T0 + winner

    async def test_redeeming_a_device_code_records_the_poll_the_grant_and_the_tokens_together(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        await store.decide_device("WDJBMJHT", APPROVE, "alice", T0 + 1)
        issuance = redemption("d-1", "at-1", "rt-1", T0 + 20)
        poll = a_poll("approved", None, T0 + 20, to="redeemed")

        assert await store.redeem_device(device.device_code_hash, poll, issuance)

        redeemed = await store.get_device(device.device_code_hash)
        assert redeemed is not None
        assert (redeemed.state, redeemed.last_poll) == (Device.REDEEMED, T0 + 20)
        assert await store.get_grant("d-1") == issuance.grant
        assert await store.get_refresh(digest("rt-1")) == issuance.refresh_token
        assert await store.revoke_grant("d-1", T0 + 21)
        assert not await store.access_token_active("at-1")

    async def test_a_device_code_not_in_the_expected_state_is_not_redeemed_and_nothing_changes(
        self, store: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)  # pending, not approved
        poll = a_poll("approved", None, T0 + 20, to="redeemed")
        assert not await store.redeem_device(device.device_code_hash, poll, redemption("d-1"))
        assert await store.get_grant("d-1") is None
        assert await store.get_refresh(digest("rt-0")) is None
        assert await store.get_device(device.device_code_hash) == device

    async def test_a_device_redemption_clashing_with_a_stored_key_changes_nothing(
        self, store: Store
    ) -> None:
        await start_family(store, "rt-taken", "fam-taken")
        device = a_device()
        await store.save_device(device)
        await store.decide_device("WDJBMJHT", APPROVE, "alice", T0 + 1)
        before = await store.get_device(device.device_code_hash)
        poll = a_poll("approved", None, T0 + 20, to="redeemed")
        with pytest.raises(AlreadyExists):
            await store.redeem_device(device.device_code_hash, poll, redemption("fam-taken"))
        assert await store.get_device(device.device_code_hash) == before

    async def test_of_concurrent_decisions_on_one_device_code_exactly_one_is_recorded(
        self, store: Store, other: Store
    ) -> None:
        await store.save_device(a_device())
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].decide_device(
                    "WDJBMJHT", APPROVE if i % 3 else DENY, f"user-{i}", T0 + 1
                )
                for i in range(RACERS)
            )
        )
        (winner,) = [i for i, won in enumerate(results) if won]
        record = await store.device_by_user_code("WDJBMJHT", T0 + 2)
        assert record is not None and record.subject == f"user-{winner}"
        assert record.state == (Device.APPROVED if winner % 3 else Device.DENIED)

    async def test_of_concurrent_redemptions_of_a_device_code_exactly_one_succeeds(
        self, store: Store, other: Store
    ) -> None:
        device = a_device()
        await store.save_device(device)
        await store.decide_device("WDJBMJHT", APPROVE, "alice", T0 + 1)
        results = await asyncio.gather(
            *(
                (store, other)[i % 2].redeem_device(
                    device.device_code_hash,
                    a_poll("approved", None, T0 + 10, to="redeemed"),
                    redemption(f"d-{i}", f"at-{i}", f"rt-{i}", T0 + 10),
                )
                for i in range(RACERS)
            )
        )
        (winner,) = [i for i, won in enumerate(results) if won]
        grants = [await store.get_grant(f"d-{i}") for i in range(RACERS)]
        assert [i for i, grant in enumerate(grants) if grant is not None] == [winner]

    # -- revocation events ----------------------------------------------------------------

    async def test_revoking_an_access_token_records_an_event_naming_it(self, store: Store) -> None:
        await store.revoke_access_token("at-1", T0 + 300, T0, "revoked")
        (event,) = await store.revocation_events(0, T0, 100)
        assert event.kind is EventKind.TOKENS
        assert event.tokens == (RevokedToken("at-1", T0 + 300),)
        assert (event.reason, event.created_at, event.expires_at) == ("revoked", T0, T0 + 300)
        assert event.key is None and event.issued_before is None

    async def test_revoking_a_grant_records_one_event_naming_its_unexpired_access_tokens(
        self, store: Store
    ) -> None:
        await start_family(store)  # at-of-fam-1 expires at T0 + 300
        assert await rotate(store, "rt-0", "rt-1", T0 + 200)  # at-rt-1 expires at T0 + 500
        assert await rotate(store, "rt-1", "rt-2", T0 + 250)  # at-rt-2 expires at T0 + 550
        assert await store.revoke_grant("fam-1", T0 + 400, "refresh_reuse")
        (event,) = await store.revocation_events(0, T0 + 400, 100)
        assert event.kind is EventKind.TOKENS and event.reason == "refresh_reuse"
        assert set(event.tokens) == {
            RevokedToken("at-rt-1", T0 + 500),
            RevokedToken("at-rt-2", T0 + 550),
        }
        assert event.expires_at == T0 + 550

        assert not await store.revoke_grant("fam-1", T0 + 401)  # again: no second event
        assert len(await store.revocation_events(0, T0 + 401, 100)) == 1

    async def test_a_grant_whose_access_tokens_all_expired_is_revoked_without_an_event(
        self, store: Store
    ) -> None:
        await start_family(store)
        assert await store.revoke_grant("fam-1", T0 + HOUR)
        assert await store.revocation_events(0, T0 + HOUR, 100) == []

    async def test_a_cut_off_revokes_the_older_grants_of_its_subject_alone_and_records_it(
        self, store: Store
    ) -> None:
        await start_family(store, "rt-old", "fam-old")  # alice, created at T0
        await start_family(store, "rt-new", "fam-new", now=T0 + 20)  # alice, after the cut
        code = a_code("code-bob", subject="bob")
        await store.save_code(code)
        bob = redemption("fam-bob", "at-bob", "rt-bob")
        bob = replace(bob, grant=replace(bob.grant, subject="bob"))  # type: ignore[arg-type]
        assert await store.redeem_code(code.code_hash, REDEEM, bob)

        cut = CutOff(EventKind.SUBJECT, "alice", T0 + 10, T0 + 310, "user_disabled", T0 + 15)
        event_id = await store.cut_off(cut)

        old = await store.get_grant("fam-old")
        assert old is not None and old.revoked_at == T0 + 15
        assert not await store.access_token_active("at-of-fam-old")
        assert not await rotate(store, "rt-old", "rt-old-1", T0 + 30, family="fam-old")
        assert await store.access_token_active("at-of-fam-new")
        assert await store.access_token_active("at-bob")
        (event,) = await store.revocation_events(0, T0 + 15, 100)
        assert event.event_id == event_id
        assert (event.kind, event.key, event.issued_before) == (EventKind.SUBJECT, "alice", T0 + 10)
        assert (event.reason, event.created_at, event.expires_at) == (
            "user_disabled",
            T0 + 15,
            T0 + 310,
        )
        assert event.tokens == ()

    async def test_a_cut_off_ends_the_codes_its_subject_had_not_redeemed_and_approved_devices(
        self, store: Store
    ) -> None:
        older = a_code("code-old")  # alice, issued at T0
        newer = a_code("code-new", created_at=T0 + 20)  # alice, after the cut
        bobs = a_code("code-bob", subject="bob")
        for code in (older, newer, bobs):
            await store.save_code(code)
        approved = Device.APPROVED.value
        alices = a_device("dc-alice", "WDJBMJHT", state=approved, subject="alice")
        bob_device = a_device("dc-bob", "BCDFGHJK", state=approved, subject="bob")
        pending = a_device("dc-pending", "CDFGHJKL")
        for device in (alices, bob_device, pending):
            await store.save_device(device)

        cut = CutOff(EventKind.SUBJECT, "alice", T0 + 10, T0 + 310, "user_disabled", T0 + 15)
        await store.cut_off(cut)

        # Gone: its redemption finds nothing to consume, whoever the user is by then.
        assert await store.get_code(older.code_hash) is None
        assert not await store.redeem_code(older.code_hash, REDEEM, redemption("fam-x", "at-x"))
        assert await store.get_grant("fam-x") is None
        assert await store.get_code(newer.code_hash) == newer
        assert await store.get_code(bobs.code_hash) == bobs
        # The approval is withdrawn: the device is told access_denied (RFC 8628 §3.5).
        assert await store.get_device(alices.device_code_hash) == replace(
            alices, state=Device.DENIED.value
        )
        redeem = a_poll(approved, None, T0 + 20, to=Device.REDEEMED.value)
        assert not await store.redeem_device(
            alices.device_code_hash, redeem, redemption("fam-d", "at-d")
        )
        assert await store.get_device(bob_device.device_code_hash) == bob_device
        assert await store.get_device(pending.device_code_hash) == pending

    async def test_of_redemptions_racing_a_cut_off_each_is_revoked_by_it_or_fails(
        self, store: Store, other: Store
    ) -> None:
        codes = [a_code(f"race-{i}") for i in range(20)]
        for code in codes:
            await store.save_code(code)
        cut = CutOff(EventKind.SUBJECT, "alice", T0 + 10, T0 + 310, "user_disabled", T0 + 15)

        async def redeem(i: int) -> bool:
            issuance = redemption(f"fam-race-{i}", f"at-race-{i}", f"rt-race-{i}")
            return await other.redeem_code(codes[i].code_hash, REDEEM, issuance)

        *redeemed, _ = await asyncio.gather(*(redeem(i) for i in range(20)), store.cut_off(cut))
        for i, won in enumerate(redeemed):
            grant = await store.get_grant(f"fam-race-{i}")
            if won:  # committed before the cut-off: it revoked what was issued
                assert grant is not None and grant.revoked_at == T0 + 15
                assert not await store.access_token_active(f"at-race-{i}")
            else:  # the code was gone
                assert grant is None and await store.get_code(codes[i].code_hash) is None

    async def test_a_client_cut_off_revokes_the_clients_grants(self, store: Store) -> None:
        await start_family(store)
        cut = CutOff(EventKind.CLIENT, "webapp", T0 + 1, T0 + 301, "client_deleted", T0 + 1)
        await store.cut_off(cut)
        assert not await store.access_token_active("at-of-fam-1")
        (event,) = await store.revocation_events(0, T0 + 1, 100)
        assert (event.kind, event.key) == (EventKind.CLIENT, "webapp")

    async def test_events_are_read_after_an_id_in_order_without_the_expired_ones(
        self, store: Store
    ) -> None:
        await store.revoke_access_token("at-1", T0 + 300, T0)
        await store.revoke_access_token("at-2", T0 + 100, T0)
        await store.revoke_access_token("at-3", T0 + 300, T0)
        events = await store.revocation_events(0, T0, 100)
        assert [e.tokens[0].jti for e in events] == ["at-1", "at-2", "at-3"]
        ids = [e.event_id for e in events]
        assert ids == sorted(ids) and len(set(ids)) == 3
        assert [e.tokens[0].jti for e in await store.revocation_events(ids[0], T0, 100)] == [
            "at-2",
            "at-3",
        ]
        assert [e.tokens[0].jti for e in await store.revocation_events(0, T0 + 200, 100)] == [
            "at-1",
            "at-3",
        ]
        assert len(await store.revocation_events(0, T0, 2)) == 2

    async def test_purge_deletes_expired_events_and_ids_are_never_reused(
        self, store: Store
    ) -> None:
        await store.revoke_access_token("at-1", T0 + 300, T0)
        await store.revoke_access_token("at-2", T0 + 300, T0)
        (_, last) = await store.revocation_events(0, T0, 100)
        assert await store.purge_expired(T0 + 400) >= 2
        assert await store.revocation_events(0, T0, 100) == []
        await store.revoke_access_token("at-3", T0 + 900, T0 + 400)
        (event,) = await store.revocation_events(0, T0 + 400, 100)
        assert event.event_id > last.event_id

    async def test_the_events_signal_is_set_when_this_store_records_an_event(
        self, store: Store
    ) -> None:
        signal = store.events_signal()
        assert not signal.is_set()
        await store.revoke_access_token("at-1", T0 + 300, T0)
        assert signal.is_set()
        assert not store.events_signal().is_set()  # a new one for the next reader

    async def test_a_reader_following_the_log_meets_every_event_of_concurrent_writers(
        self, store: Store, other: Store
    ) -> None:
        """Ids are committed in increasing order: reading on from the last id seen while
        two stores write, nothing is skipped."""
        seen: list[int] = []
        done = asyncio.Event()

        async def follow() -> None:
            while True:
                finished = done.is_set()
                for event in await store.revocation_events(seen[-1] if seen else 0, T0, 1000):
                    seen.append(event.event_id)
                if finished:
                    return
                await asyncio.sleep(0)

        async def write(writer: Store, i: int) -> None:
            await writer.revoke_access_token(f"at-{i}", T0 + 300, T0)

        reader = asyncio.create_task(follow())
        await asyncio.gather(*(write(store if i % 2 else other, i) for i in range(2 * RACERS)))
        done.set()
        await reader
        assert len(seen) == 2 * RACERS
        assert seen == sorted(seen)

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
        await store.revoke_access_token("at-revoked-old", T0 + 300, T0)
        # fam-a: over at T0 + 900, its first access token expired at T0 + 300; fam-b lives,
        # revoked, with an access token that lives too.
        await start_family(store, "rt-a0", "fam-a", family_expires_at=T0 + 900)
        assert await rotate(store, "rt-a0", "rt-a1", T0 + 100, family="fam-a")
        await start_family(store, "rt-b0", "fam-b", now=at - 10)
        await store.revoke_grant("fam-b", at - 5)
        await store.grant_scopes("alice", "webapp", frozenset({"openid"}), T0)

        # Three codes (code-old, and the two the families were redeemed from); session, jti,
        # device code, throttle key: one each; three access token records (at-of-fam-a,
        # at-rt-a1, at-revoked-old); the two tokens of the family past its absolute lifetime;
        # the revocation event of at-revoked-old (fam-b's names a token that lives).
        assert await store.purge_expired(at) == 13
        assert await store.purge_expired(at) == 0

        assert await store.get_code(digest("code-old")) is None
        assert await store.get_code(digest("code-live")) == a_code("code-live", expires_at=at + 60)
        assert await store.get_session(digest("sid-old"), T0) is None
        assert await store.get_session(digest("sid-live"), at) is not None
        assert await store.use_jti("client-a", "jti-old", T0 + 300, T0)  # forgotten
        assert not await store.use_jti("client-a", "jti-live", at + 300, at)
        assert await store.device_by_user_code("OLDOLDOL", T0) is None
        assert await store.device_by_user_code("LIVELIVE", at) is not None
        assert await store.reserve_attempt([Cap("login:old", limit=1, window=MINUTE)], T0) is None
        live = Cap("login:live", limit=1, window=MINUTE)
        assert await store.reserve_attempt([live], at) == Refuse(live.key, MINUTE)
        assert await store.get_refresh(digest("rt-a0")) is None
        assert await store.get_refresh(digest("rt-a1")) is None
        assert await store.get_grant("fam-a") is None
        assert not await store.access_token_active("at-of-fam-b")
        revoked = await store.get_refresh(digest("rt-b0"))
        assert revoked is not None and revoked.state == Refresh.REVOKED
        assert await store.granted_scopes("alice", "webapp") == {"openid"}

    async def test_purge_keeps_a_grant_while_an_access_token_recorded_under_it_lives(
        self, store: Store
    ) -> None:
        code = a_code()
        await store.save_code(code)
        issuance = redemption("grant-1", "at-1", refresh=None)  # the grant ends with at-1
        assert await store.redeem_code(code.code_hash, REDEEM, issuance)
        await store.revoke_grant("grant-1", T0 + 1)
        await store.purge_expired(T0 + 299)
        assert not await store.access_token_active("at-1")
        await store.purge_expired(T0 + 300)
        assert await store.get_grant("grant-1") is None

    async def test_purge_drops_refresh_tokens_idle_expired_long_ago_and_keeps_recent_ones(
        self, store: Store
    ) -> None:
        # fam-1 lives 400 days; rt-0 idles out on day 14, rt-1 on day 60, rt-2 on day 200.
        await start_family(store, "rt-0", family_expires_at=T0 + 400 * DAY)
        for old, new, now, idle in (
            ("rt-0", "rt-1", T0 + HOUR, T0 + 60 * DAY),
            ("rt-1", "rt-2", T0 + 2 * HOUR, T0 + 200 * DAY),
        ):
            issuance = rotation(new, now, expires_at=idle, family_expires_at=T0 + 400 * DAY)
            assert await store.rotate_refresh(digest(old), ROTATE, issuance, sealed(new))
        # fam-2's only token idled out on day 14: the whole family is over.
        await start_family(store, "rt-lone", "fam-2")

        at = T0 + 60 * DAY + MINUTE
        # rt-0, rt-lone, the two codes the families came from and their four access
        # tokens, long expired.
        assert await store.purge_expired(at) == 8

        assert await store.get_refresh(digest("rt-0")) is None
        assert await store.get_refresh(digest("rt-lone")) is None
        assert await store.get_grant("fam-2") is None
        # rt-1 idled out a minute ago: it is kept, so that shown again it is caught as reuse.
        kept = await store.get_refresh(digest("rt-1"))
        assert kept is not None and kept.state == Refresh.ROTATED
        latest = await store.get_refresh(digest("rt-2"))
        assert latest is not None and latest.state == Refresh.ACTIVE

    # -- durability ---------------------------------------------------------------------

    async def test_everything_survives_closing_and_reopening_the_store(
        self, make_store: StoreFactory
    ) -> None:
        first = make_store()
        await first.open()
        await first.save_code(a_code())
        await first.redeem_code(digest("code"), REDEEM, redemption("fam-1", "at-0", "rt-0"))
        await first.save_code(a_code("code-unused"))
        await rotate(first, "rt-0", "rt-1", T0 + HOUR)
        await start_family(first, "rt-doomed", "fam-doomed")
        await first.revoke_grant("fam-doomed", T0 + HOUR)
        await first.revoke_access_token("at-revoked", T0 + HOUR + 300, T0 + HOUR)
        await first.grant_scopes("alice", "webapp", frozenset({"openid", "orders:read"}), T0)
        await first.save_session(a_session())
        throttle = Cap("login:ip:192.0.2.1", limit=2, window=MINUTE)
        await first.reserve_attempt([throttle], T0)
        await first.reserve_attempt([throttle], T0 + 1)
        await first.use_jti("client-a", "jti-1", T0 + 300, T0)
        await first.save_device(a_device())
        await first.decide_device("WDJBMJHT", APPROVE, "alice", T0 + 2)
        rotated = await first.get_refresh(digest("rt-0"))
        await first.close()

        second = make_store()
        await second.open()
        try:
            code = await second.get_code(digest("code"))
            assert code is not None and code.state == Code.CONSUMED
            unused = await second.get_code(digest("code-unused"))
            assert unused is not None and unused.state == Code.ISSUED
            assert await second.get_refresh(digest("rt-0")) == rotated
            assert rotated is not None and rotated.successor_sealed == sealed("rt-1")
            assert await rotate(second, "rt-1", "rt-2", T0 + 2 * HOUR)
            doomed = await second.get_grant("fam-doomed")
            assert doomed is not None and doomed.revoked_at == T0 + HOUR
            assert not await second.access_token_active("at-of-fam-doomed")
            assert not await second.access_token_active("at-revoked")
            assert await second.granted_scopes("alice", "webapp") == {"openid", "orders:read"}
            assert await second.get_session(digest("sid"), T0) == a_session()
            assert await second.reserve_attempt([throttle], T0 + 2) is not None
            assert not await second.use_jti("client-a", "jti-1", T0 + 300, T0 + 3)
            device = await second.get_device(digest("dc"))
            assert device is not None and device.state == Device.APPROVED
        finally:
            await second.close()

    # -- signing keys -------------------------------------------------------------------

    async def test_a_new_database_has_an_empty_key_ring_at_version_zero(self, store: Store) -> None:
        assert await store.signing_keys() == SigningKeys(0, ())
        assert await store.signing_keys_version() == 0

    async def test_replacing_the_key_ring_adds_changes_and_removes_keys_and_moves_its_version(
        self, store: Store, other: Store
    ) -> None:
        es, rs = a_signing_key("es-1"), a_signing_key("rs-1", "RS256")
        assert await store.replace_signing_keys(0, [es, rs])
        assert await other.signing_keys() == SigningKeys(1, (es, rs))
        successor = a_signing_key("es-2", state="next", created_at=T0 + 1, activate_at=T0 + 60)
        retired = replace(es, state="retired", retired_at=T0 + 60, remove_after=T0 + 360)
        activated = replace(successor, state="active")
        # The predecessor retired and its successor activated in one change, listed in
        # any order: the ring never has two active keys of one algorithm.
        assert await other.replace_signing_keys(1, [activated, rs, retired])
        assert await store.signing_keys() == SigningKeys(2, (retired, rs, activated))
        assert await store.replace_signing_keys(2, [activated])
        assert await other.signing_keys() == SigningKeys(3, (activated,))
        assert await other.signing_keys_version() == 3

    async def test_a_stored_keys_algorithm_creation_time_and_sealed_key_never_change(
        self, store: Store
    ) -> None:
        key = a_signing_key("es-1")
        assert await store.replace_signing_keys(0, [key])
        tampered = replace(key, alg="RS256", created_at=T0 + 5, sealed_private_key=b"\x01other")
        assert await store.replace_signing_keys(1, [replace(tampered, state="retired")])
        (stored,) = (await store.signing_keys()).keys
        assert stored == replace(key, state="retired")

    async def test_a_key_ring_change_decided_from_an_old_version_changes_nothing(
        self, store: Store, other: Store
    ) -> None:
        first = a_signing_key("es-1")
        assert await store.replace_signing_keys(0, [first])
        assert not await other.replace_signing_keys(0, [a_signing_key("es-other")])
        assert not await other.replace_signing_keys(5, [])
        assert await other.signing_keys() == SigningKeys(1, (first,))

    async def test_two_active_keys_of_one_algorithm_are_refused_and_nothing_changes(
        self, store: Store
    ) -> None:
        first = a_signing_key("es-1")
        assert await store.replace_signing_keys(0, [first])
        with pytest.raises(AlreadyExists):
            await store.replace_signing_keys(1, [first, a_signing_key("es-2")])
        assert await store.signing_keys() == SigningKeys(1, (first,))
        # One active key per algorithm: an ES256 and an RS256 key may both be active.
        assert await store.replace_signing_keys(1, [first, a_signing_key("rs-1", "RS256")])

    @pytest.mark.parametrize("stores", [1, 2], ids=["one-store", "two-stores"])
    async def test_of_concurrent_key_ring_changes_from_one_version_exactly_one_succeeds(
        self, store: Store, other: Store, stores: int
    ) -> None:
        callers = [store, other][:stores]
        rings = [
            [a_signing_key(f"es-{n}"), a_signing_key(f"rs-{n}", "RS256")] for n in range(RACERS)
        ]
        results = await asyncio.gather(
            *(callers[n % stores].replace_signing_keys(0, ring) for n, ring in enumerate(rings))
        )
        assert results.count(True) == 1
        winner = rings[results.index(True)]
        assert await store.signing_keys() == SigningKeys(1, tuple(winner))

    # -- clients and users ----------------------------------------------------------------

    async def test_a_saved_client_reads_back_as_given(self, store: Store, other: Store) -> None:
        client = a_client()
        assert await store.save_client(client, None)
        assert await other.get_client("webapp") == client
        assert await store.get_client("nobody") is None
        assert [c.client_id for c in await store.list_clients()] == ["webapp"]

    async def test_creating_a_client_whose_id_is_taken_raises_and_changes_nothing(
        self, store: Store
    ) -> None:
        await store.save_client(a_client(), None)
        with pytest.raises(AlreadyExists):
            await store.save_client(a_client(metadata={"client_name": "Other"}), None)
        stored = await store.get_client("webapp")
        assert stored is not None and stored.metadata["client_name"] == "Web App"

    async def test_a_client_update_is_a_compare_and_set_on_its_version(
        self, store: Store, other: Store
    ) -> None:
        await store.save_client(a_client(), None)
        changed = a_client(metadata={"client_name": "Renamed"}, updated_at=T0 + 1)
        assert await store.save_client(changed, 1)
        assert not await other.save_client(a_client(metadata={"client_name": "Stale"}), 1)
        stored = await store.get_client("webapp")
        assert stored is not None
        assert (stored.metadata["client_name"], stored.version) == ("Renamed", 2)
        assert not await store.save_client(a_client("nobody"), 1)

    async def test_of_concurrent_client_updates_from_one_version_one_wins(
        self, store: Store, other: Store
    ) -> None:
        await store.save_client(a_client(), None)
        updates = [
            (store if i % 2 else other).save_client(a_client(metadata={"client_name": f"n{i}"}), 1)
            for i in range(RACERS)
        ]
        assert sum(await asyncio.gather(*updates)) == 1

    async def test_a_deleted_client_is_gone(self, store: Store) -> None:
        await store.save_client(a_client(), None)
        assert await store.delete_client("webapp")
        assert await store.get_client("webapp") is None
        assert not await store.delete_client("webapp")

    async def test_clients_that_registered_themselves_read_back_with_their_registration(
        self, store: Store, other: Store
    ) -> None:
        dynamic = a_client(
            "dyn-1",
            managed_by=MANAGED_BY_DYNAMIC,
            secret_sha256=None,
            registration_token_sha256=digest("registration-token"),
            unused_until=T0 + DAY,
        )
        document = a_client(
            "https://app.example.com/client.json",
            managed_by=MANAGED_BY_METADATA_DOCUMENT,
            secret_sha256=None,
        )
        assert await store.save_client(dynamic, None)
        assert await store.save_client(document, None)
        assert await other.get_client("dyn-1") == dynamic
        assert await other.get_client(document.client_id) == document
        blocked = replace(document, blocked=True, updated_at=T0 + 1)
        assert await other.save_client(blocked, 1)
        assert await store.get_client(document.client_id) == replace(blocked, version=2)
        assert [c.client_id for c in await store.list_clients()] == [
            "dyn-1",
            document.client_id,
        ]
        listed = {c.client_id: c for c in await other.list_clients()}
        assert listed["dyn-1"] == dynamic
        assert listed[document.client_id].blocked

    async def test_a_client_that_obtained_a_token_is_kept_and_its_version_stays(
        self, store: Store, other: Store
    ) -> None:
        await store.save_client(a_client("dyn-1", unused_until=T0 + DAY), None)
        await store.save_client(a_client("kept"), None)
        racers = [(store if i % 2 else other).client_used("dyn-1") for i in range(RACERS)]
        assert sum(await asyncio.gather(*racers)) == 1
        used = await other.get_client("dyn-1")
        assert used is not None
        assert (used.unused_until, used.version) == (None, 1)
        assert not await store.client_used("dyn-1")
        assert not await store.client_used("kept")
        assert not await store.client_used("nobody")

    async def test_purge_removes_the_clients_that_never_obtained_a_token_in_time(
        self, store: Store
    ) -> None:
        await store.save_client(a_client("unused", unused_until=T0 + HOUR), None)
        await store.save_client(a_client("fresh", unused_until=T0 + DAY), None)
        await store.save_client(a_client("used", unused_until=T0 + HOUR), None)
        await store.save_client(a_client("configured", managed_by=MANAGED_BY_CONFIG), None)
        assert await store.client_used("used")
        assert await store.purge_expired(T0 + 2 * HOUR) == 1
        assert await store.get_client("unused") is None
        assert [c.client_id for c in await store.list_clients()] == ["configured", "fresh", "used"]

    async def test_syncing_clients_creates_updates_takes_over_and_removes_the_seeded_ones(
        self, store: Store, other: Store
    ) -> None:
        seeded = [
            a_client("a", managed_by=MANAGED_BY_CONFIG),
            a_client("b", managed_by=MANAGED_BY_CONFIG),
        ]
        assert await store.sync_clients(seeded, T0) == []
        await store.save_client(a_client("api-made"), None)
        await store.save_client(a_client("c"), None)  # by the API; then in the file too
        later = T0 + HOUR
        renamed = a_client(
            "a",
            managed_by=MANAGED_BY_CONFIG,
            metadata={"client_name": "A"},
            created_at=later,
            updated_at=later,
            tokens_valid_from=later,
        )
        taken_over = a_client("c", managed_by=MANAGED_BY_CONFIG, created_at=later, updated_at=later)
        assert await other.sync_clients([renamed, taken_over], later) == ["b"]
        a = await store.get_client("a")
        assert a is not None
        assert (a.metadata["client_name"], a.version) == ("A", 2)
        assert (a.created_at, a.tokens_valid_from) == (T0, T0)  # kept from the first seed
        c = await store.get_client("c")
        assert c is not None and c.managed_by == MANAGED_BY_CONFIG
        assert await store.get_client("b") is None
        assert await store.get_client("api-made") is not None
        # Syncing what is stored already changes nothing.
        assert await store.sync_clients([renamed, taken_over], later + 1) == []
        again = await store.get_client("a")
        assert again is not None and again.version == 2

    async def test_a_saved_user_reads_back_by_subject_and_username(
        self, store: Store, other: Store
    ) -> None:
        user = a_user()
        assert await store.save_user(user, None)
        assert await other.get_user("sub-alice") == user
        assert await other.user_by_username("alice") == user
        assert await store.user_by_username("bob") is None
        assert [u.subject for u in await store.list_users()] == ["sub-alice"]

    async def test_users_are_found_by_their_email_without_regard_to_ascii_case(
        self, store: Store, other: Store
    ) -> None:
        def emailed(subject: str, username: str, email: object) -> UserRecord:
            return a_user(subject, username, claims={"email": email, "email_verified": True})

        await store.save_user(emailed("s2", "two", "Pat@Example.COM"), None)
        await store.save_user(emailed("s1", "one", "pat@example.com"), None)
        await store.save_user(emailed("s3", "three", "pat@example.com.evil"), None)
        await store.save_user(emailed("s4", "four", 42), None)
        await store.save_user(a_user("s5", "five", claims={}), None)
        found = await other.users_with_email("PAT@example.com")
        assert [u.subject for u in found] == ["s1", "s2"]
        assert found[1] == await store.get_user("s2")  # whole records, as get_user reads them
        assert await other.users_with_email("pat@example") == []
        assert await other.users_with_email("42") == []
        # Only ASCII letters are folded, alike on every backend.
        await store.save_user(emailed("s6", "six", "élan@example.com"), None)
        assert await other.users_with_email("ÉLAN@example.com") == []
        assert [u.subject for u in await other.users_with_email("élan@EXAMPLE.com")] == ["s6"]
        # A claim holding an escaped NUL is stored and found like any other.
        nul = a_user("s7", "seven", claims={"email": "nul@example.com", "name": "x\u0000y"})
        assert await store.save_user(nul, None)
        assert [u.subject for u in await other.users_with_email("NUL@example.com")] == ["s7"]
        # Changed or deleted, a user is found by what is stored now.
        moved = replace(emailed("s1", "one", "someone@else.org"), version=2)
        assert await store.save_user(moved, 1)
        assert await store.delete_user("s2")
        assert await other.users_with_email("pat@example.com") == []
        assert [u.subject for u in await other.users_with_email("SOMEONE@else.org")] == ["s1"]

    async def test_a_username_belongs_to_one_user(self, store: Store) -> None:
        await store.save_user(a_user(), None)
        await store.save_user(a_user("sub-bob", "bob"), None)
        with pytest.raises(AlreadyExists):
            await store.save_user(a_user("sub-other", "alice"), None)
        with pytest.raises(AlreadyExists):
            await store.save_user(a_user("sub-bob", "alice"), 1)
        bob = await store.get_user("sub-bob")
        assert bob is not None and (bob.username, bob.version) == ("bob", 1)

    async def test_a_user_update_is_a_compare_and_set_and_a_deleted_user_is_gone(
        self, store: Store, other: Store
    ) -> None:
        await store.save_user(a_user(), None)
        assert await store.save_user(a_user(disabled=True, roles=()), 1)
        assert not await other.save_user(a_user(), 1)
        stored = await other.get_user("sub-alice")
        assert stored is not None and (stored.disabled, stored.roles, stored.version) == (
            True,
            (),
            2,
        )
        assert await store.delete_user("sub-alice")
        assert await other.get_user("sub-alice") is None
        assert not await store.delete_user("sub-alice")

    async def test_syncing_users_refuses_a_username_the_api_gave_and_changes_nothing(
        self, store: Store
    ) -> None:
        await store.sync_users([a_user("s1", "carol", managed_by=MANAGED_BY_CONFIG)], T0)
        await store.save_user(a_user("api-1", "dave"), None)
        with pytest.raises(AlreadyExists):
            await store.sync_users([a_user("s2", "dave", managed_by=MANAGED_BY_CONFIG)], T0)
        assert [u.username for u in await store.list_users()] == ["dave", "carol"]
        assert await store.sync_users([], T0) == ["s1"]
        assert [u.username for u in await store.list_users()] == ["dave"]

    async def test_an_identity_links_once_with_its_new_user_and_reads_back_from_another_store(
        self, store: Store, other: Store
    ) -> None:
        link = IdentityLink("https://corp.example", "p-1", "sub-alice", T0)
        await store.link_identity(link, a_user())
        assert await other.identity_owner("https://corp.example", "p-1") == "sub-alice"
        assert await other.identity_owner("https://other.example", "p-1") is None
        assert await other.identity_links("sub-alice") == [link]
        # Linked again, to a new user or an existing one: refused, and no user is created.
        with pytest.raises(AlreadyExists):
            await other.link_identity(replace(link, subject="sub-bob"), a_user("sub-bob", "bob"))
        assert await store.get_user("sub-bob") is None
        with pytest.raises(AlreadyExists):
            await store.link_identity(link, None)
        assert await store.identity_links("sub-alice") == [link]

    async def test_a_new_user_whose_username_is_taken_is_not_linked(self, store: Store) -> None:
        await store.save_user(a_user(), None)
        with pytest.raises(AlreadyExists):
            await store.link_identity(
                IdentityLink("https://corp.example", "p-2", "sub-new", T0),
                a_user("sub-new", "alice"),
            )
        assert await store.identity_owner("https://corp.example", "p-2") is None
        assert await store.get_user("sub-new") is None

    async def test_an_existing_user_gains_links_and_loses_them_when_removed(
        self, store: Store
    ) -> None:
        await store.save_user(a_user(), None)
        second = IdentityLink("https://b.example", "x", "sub-alice", T0 + 1)
        first = IdentityLink("https://a.example", "y", "sub-alice", T0 + 2)
        await store.link_identity(second, None)
        await store.link_identity(first, None)
        assert await store.identity_links("sub-alice") == [first, second]
        assert await store.delete_user("sub-alice")
        assert await store.identity_owner("https://a.example", "y") is None
        assert await store.identity_links("sub-alice") == []

    async def test_of_concurrent_first_sign_ins_of_one_identity_exactly_one_links(
        self, store: Store, other: Store
    ) -> None:
        async def link(index: int) -> bool:
            try:
                await (store, other)[index % 2].link_identity(
                    IdentityLink("https://corp.example", "p-3", f"sub-{index}", T0),
                    a_user(f"sub-{index}", f"user-{index}"),
                )
            except AlreadyExists:
                return False
            return True

        results = await asyncio.gather(*(link(i) for i in range(RACERS)))
        assert results.count(True) == 1
        owner = await store.identity_owner("https://corp.example", "p-3")
        assert owner == f"sub-{results.index(True)}"
        assert [u.subject for u in await store.list_users()] == [owner]

    async def test_ending_the_sessions_of_a_subject_leaves_the_others(self, store: Store) -> None:
        await store.save_session(a_session("s1"))
        await store.save_session(a_session("s2"))
        await store.save_session(a_session("s3", subject="bob"))
        assert await store.delete_sessions("alice") == 2
        assert await store.get_session(digest("s1"), T0) is None
        assert await store.get_session(digest("s3"), T0) is not None
        assert await store.delete_sessions("alice") == 0

    async def test_grants_are_listed_with_their_scope_and_last_use(self, store: Store) -> None:
        await start_family(store, "rt-a", "fam-a")
        await start_family(store, "rt-b", "fam-b")
        assert await rotate(store, "rt-a", "rt-a2", T0 + HOUR, "fam-a")
        listed = await store.list_grants()
        assert [s.grant.grant_id for s in listed] == ["fam-a", "fam-b"]
        assert listed[0].scope == "openid offline_access orders:read"
        assert (listed[0].last_used_at, listed[1].last_used_at) == (T0 + HOUR, T0)
        assert await store.list_grants(client_id="other") == []
        assert len(await store.list_grants(client_id="webapp", subject="alice")) == 2
        assert await store.list_grants(subject="bob") == []

    async def test_a_grant_without_refresh_tokens_is_listed_with_the_scopes_consented(
        self, store: Store
    ) -> None:
        code = a_code("code-x")
        await store.save_code(code)
        assert await store.redeem_code(code.code_hash, REDEEM, redemption("fam-x", "at-x", None))
        await store.grant_scopes("alice", "webapp", frozenset({"openid", "email"}), T0)
        [summary] = await store.list_grants()
        assert (summary.scope, summary.refresh_family) == ("email openid", False)
        await start_family(store, "rt-y", "fam-y")
        listed = await store.list_grants()
        assert [s.refresh_family for s in listed] == [False, True]
