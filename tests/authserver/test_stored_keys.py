"""Signing keys kept in the store: sealed with AES-GCM under keys.encryption_key, one ring
shared by every server on the database, changed under compare-and-set, and refused for
signing and publishing once the copy in memory may have fallen behind.

The rings run on both backends (a SQLite file two stores share, and a PostgreSQL schema);
the servers and the command line on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
import yaml
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from authserver.endpoints.discovery import Jwks
from authserver.keys import RotationPolicy
from authserver.settings import load_text
from authserver.store.base import PoolLimits, Store
from authserver.store.postgres import PostgresStore
from authserver.store.sqlite import SQLiteStore
from authserver.stored_keys import KeyCipher, KeyDecryptionError, KeysStale, StoredKeyRing
from portcullis.yamlconf import ConfigError
from tests.authserver.conftest import (
    KEY_SECRET,
    MovableClock,
    SteppingClock,
    client_credentials,
    default_config,
    verify_jwt,
)
from tests.authserver.postgres_support import admin, fresh_schema, postgres_url_or_skip
from tests.authserver.process_support import write_config
from tests.support import start_site

ROOT = Path(__file__).resolve().parents[2]
ALGS = ["ES256", "RS256"]
# Published 1 s before signing, checked every 1 s: a new key signs 3 s after it appears.
POLICY = RotationPolicy(publish_ahead=1, retain=2, check_every=1)
RACERS = 8

StoreMaker = Callable[[], Store]


# ---------------------------------------------------------------------------- the cipher


@pytest.mark.parametrize(
    "key",
    [
        ec.generate_private_key(ec.SECP256R1()),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ed25519.Ed25519PrivateKey.generate(),
    ],
    ids=["ES256", "RS256", "EdDSA"],
)
def test_a_sealed_key_opens_with_its_kid_and_encryption_key_only(key: Any) -> None:
    cipher = KeyCipher(os.urandom(32))
    sealed = cipher.seal("kid-1", key)
    public = key.public_key().public_bytes
    opened = cipher.open("kid-1", sealed)
    assert opened.public_key().public_bytes(*_raw()) == public(*_raw())
    # The key material never appears in the sealed bytes.
    der = key.private_bytes(*_der())
    assert der[-32:] not in sealed
    # Each seal draws its own nonce.
    assert cipher.seal("kid-1", key)[1:13] != sealed[1:13]
    # The kid is associated data: a sealed key moved onto another row does not open.
    with pytest.raises(KeyDecryptionError, match="does not open the stored signing key kid-2"):
        cipher.open("kid-2", sealed)
    with pytest.raises(KeyDecryptionError, match="not the key the ring was written with"):
        KeyCipher(os.urandom(32)).open("kid-1", sealed)
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(KeyDecryptionError):
        cipher.open("kid-1", tampered)
    with pytest.raises(KeyDecryptionError, match="not in a format this version reads"):
        cipher.open("kid-1", b"\x02" + sealed[1:])


def _raw() -> tuple[Any, Any]:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo


def _der() -> tuple[Any, Any, Any]:
    from cryptography.hazmat.primitives import serialization

    return (
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


# ---------------------------------------------------------------------------- settings


def problems_of(tmp_path: Path, storage: str | None, keys: dict[str, Any]) -> list[str]:
    """The problems of a file with these keys, written as given (no directory added)."""
    config: dict[str, Any] = {
        "issuer": "http://127.0.0.1:9000",
        "storage": storage or f"sqlite:///{tmp_path / 'authserver.db'}",
        "keys": {k: v for k, v in keys.items() if v is not None},
    }
    try:
        load_text(yaml.safe_dump(config))
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []


POSTGRES = "postgresql://portcullis@db.internal/auth"


@pytest.mark.parametrize(
    ("storage", "keys", "problem"),
    [
        (POSTGRES, {"encryption_key": None}, "PostgreSQL storage keeps the signing keys"),
        (POSTGRES, {"dir": "/var/lib/keys"}, "keys.dir: replicas on PostgreSQL share"),
        (None, {}, "without keys.dir the signing keys live in the storage"),
        (POSTGRES, {"encryption_key": "c2hvcnQ="}, "base64 encoding of exactly 32 bytes"),
        (POSTGRES, {"encryption_key": "not base64 at all!"}, "exactly 32 bytes"),
        (
            POSTGRES,
            {"encryption_key": KEY_SECRET, "reload_every": "10s", "jwks_max_age": "5s"},
            "keys.reload_every: must be at most keys.jwks_max_age (5s)",
        ),
    ],
)
def test_keys_in_the_storage_need_a_well_formed_encryption_key(
    tmp_path: Path, storage: str | None, keys: dict[str, Any], problem: str
) -> None:
    found = problems_of(tmp_path, storage, keys)
    assert len(found) == 1, found
    assert problem in found[0]
    secret = keys.get("encryption_key")
    if secret:
        assert secret not in found[0]  # a secret never shows in a message


def test_an_encryption_key_in_either_base64_alphabet_is_accepted(tmp_path: Path) -> None:
    raw = bytes([0xFB, 0xFF] * 16)
    for text in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()[:-1]):
        assert problems_of(tmp_path, POSTGRES, {"encryption_key": text}) == []
    assert problems_of(tmp_path, None, {"encryption_key": KEY_SECRET}) == []


# ---------------------------------------------------------------------------- rings


@pytest.fixture(params=["sqlite", "postgresql"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreMaker]:
    """Stores on one database, as separate processes would open them."""
    if request.param == "sqlite":
        yield lambda: SQLiteStore(tmp_path / "authserver.db")
        return
    url = await postgres_url_or_skip()
    async with fresh_schema(url) as schema:
        yield lambda: PostgresStore(url, PoolLimits(min_size=1, max_size=2), schema=schema)


@pytest.fixture
async def stores(make_store: StoreMaker) -> AsyncIterator[list[Store]]:
    opened = [make_store() for _ in range(2)]
    for store in opened:
        await store.open()
    yield opened
    for store in opened:
        await store.close()


def ring(
    store: Store, clock: Callable[[], float], secret: bytes = bytes(range(32))
) -> StoredKeyRing:
    return StoredKeyRing(store, KeyCipher(secret), POLICY, clock)


def active_kids(keyring: StoredKeyRing) -> dict[str, str]:
    return {i.alg: i.kid for i in keyring.infos() if i.state == "active"}


async def test_servers_starting_together_on_an_empty_ring_make_one_active_key_per_algorithm(
    make_store: StoreMaker,
) -> None:
    stores = [make_store() for _ in range(RACERS)]
    await asyncio.gather(*(store.open() for store in stores))
    try:
        clock = MovableClock()
        rings = [ring(store, clock) for store in stores]
        events = await asyncio.gather(*(r.start(ALGS) for r in rings))
        # Keys were made by exactly one of them; the others found them.
        assert sorted(len(e) for e in events) == [0] * (RACERS - 1) + [2]
        stored = await stores[0].signing_keys()
        assert sorted((k.alg, k.state) for k in stored.keys) == [
            ("ES256", "active"),
            ("RS256", "active"),
        ]
        assert stored.version == 1
        assert all(active_kids(r) == active_kids(rings[0]) for r in rings)
        token = rings[3].sign("ES256", {"sub": "x"})
        key = jwt.PyJWK(_jwk(rings[5], token)).key
        assert jwt.decode(token, key, algorithms=["ES256"]) == {"sub": "x"}
    finally:
        await asyncio.gather(*(store.close() for store in stores))


def _jwk(keyring: StoredKeyRing, token: str) -> dict[str, Any]:
    import orjson

    kid = jwt.get_unverified_header(token)["kid"]
    (jwk,) = [k for k in orjson.loads(keyring.jwks_body)["keys"] if k["kid"] == kid]
    return dict(jwk)


async def test_a_key_rotated_through_one_server_is_published_by_the_other_and_signs_on_time(
    stores: list[Store],
) -> None:
    clock = MovableClock()
    a, b = ring(stores[0], clock), ring(stores[1], clock)
    await a.start(ALGS)
    await b.start(ALGS)
    old = active_kids(b)["ES256"]

    (rotation,) = await a.rotate_keys(["ES256"], clock())
    new = rotation.info.kid
    assert rotation.info.activate_at == clock() + POLICY.lead
    assert new.encode() in a.jwks_body and new.encode() not in b.jwks_body
    clock.advance(POLICY.check_every)
    assert await b.tick(clock()) == []  # nothing due: the new key is only read
    assert new.encode() in b.jwks_body

    assert jwt.get_unverified_header(b.sign("ES256", {}))["kid"] == old
    clock.advance(POLICY.lead - POLICY.check_every)
    assert jwt.get_unverified_header(b.sign("ES256", {}))["kid"] == new
    # The transition is written once, by whichever server's check comes first.
    events = await asyncio.gather(a.tick(clock()), b.tick(clock()))
    assert sorted(e.what for e in events[0] + events[1]) == ["activated", "retired"]
    states = {k.kid: k.state for k in (await stores[0].signing_keys()).keys}
    assert (states[old], states[new]) == ("retired", "active")
    clock.advance(POLICY.retain)
    await b.tick(clock())
    await a.tick(clock())
    assert old.encode() not in a.jwks_body and old.encode() not in b.jwks_body
    assert old not in {k.kid for k in (await stores[0].signing_keys()).keys}


async def test_a_rotated_key_is_dated_from_its_writing_not_from_when_the_rotation_began(
    stores: list[Store],
) -> None:
    # Every read of the clock half a second later: the round trips to the store and the
    # key's generation take time between the decision and the write, which must not come
    # out of the time other servers have to publish the key before it signs.
    clock = SteppingClock(0.5)
    keyring = ring(stores[0], clock)
    await keyring.start(ALGS)
    began = clock()
    (rotation,) = await keyring.rotate_keys(["RS256"], began)
    info = rotation.info
    assert info.created_at > began
    assert info.activate_at == info.created_at + POLICY.lead
    (stored,) = [k for k in (await stores[1].signing_keys()).keys if k.kid == info.kid]
    assert (stored.state, stored.created_at, stored.activate_at) == (
        "next",
        info.created_at,
        info.activate_at,
    )


async def test_a_ring_read_for_a_change_is_current_while_the_change_is_made(
    stores: list[Store],
) -> None:
    clock = MovableClock()
    keyring = ring(stores[0], clock)
    await keyring.start(ALGS)
    clock.advance(POLICY.lead + 1)  # no read of the store for longer than a key's lead
    assert keyring.stale(clock.now) is not None
    # A rotation reads the ring, then generates an RSA key in a worker thread and writes:
    # the ring it read is current from that read on, not from the end of the write.
    rotation = asyncio.create_task(keyring.rotate_keys(["RS256"], clock()))
    current_before_done = False
    while not rotation.done():
        current_before_done = current_before_done or keyring.stale(clock.now) is None
        await asyncio.sleep(0)
    (done,) = await rotation
    assert done.created and current_before_done
    assert keyring.stale(clock.now) is None


async def test_an_automatic_rotation_due_on_two_servers_is_published_once(
    stores: list[Store],
) -> None:
    clock = MovableClock()
    policy = RotationPolicy(publish_ahead=1, retain=2, rotate_every=10, check_every=1)
    a, b = (StoredKeyRing(s, KeyCipher(bytes(range(32))), policy, clock) for s in stores)
    await a.start(["ES256"])
    await b.start(["ES256"])
    clock.advance(10)
    events = await asyncio.gather(a.tick(clock()), b.tick(clock()))
    published = [e for e in events[0] + events[1] if e.what == "published"]
    assert len(published) == 1
    assert sorted(k.state for k in (await stores[1].signing_keys()).keys) == ["active", "next"]


async def test_a_ring_not_confirmed_against_the_store_for_too_long_refuses_to_sign_and_publish(
    stores: list[Store],
) -> None:
    clock = MovableClock()
    keyring = ring(stores[0], clock)
    assert keyring.stale(clock()) is not None  # never read
    assert (keyring.jwks_cacheable_for(clock()) or 0) <= 0
    await keyring.start(ALGS)
    assert keyring.stale(clock()) is None
    # A key this ring does not know could sign lead seconds after the ring was confirmed:
    # the JWK Set served now may be kept that long, and no longer.
    assert keyring.jwks_cacheable_for(clock()) == POLICY.lead
    clock.advance(POLICY.lead - 0.5)
    assert keyring.jwks_cacheable_for(clock()) == 0.5
    keyring.sign("ES256", {})

    clock.advance(0.51)
    assert "last read from the storage" in (keyring.stale(clock()) or "")
    with pytest.raises(KeysStale):
        keyring.sign("ES256", {})
    assert (keyring.jwks_cacheable_for(clock()) or 0) < 0

    await keyring.tick(clock())  # the store answers again
    assert keyring.stale(clock()) is None
    assert keyring.jwks_cacheable_for(clock()) == POLICY.lead
    keyring.sign("ES256", {})


async def test_the_jwks_max_age_shrinks_as_the_ring_ages_and_503_once_it_may_lack_a_key(
    stores: list[Store],
) -> None:
    clock = MovableClock()
    keyring = ring(stores[0], clock)
    await keyring.start(ALGS)
    app = web.Application()
    app.router.add_get("/jwks", Jwks(keyring, 2).respond)
    runner, url = await start_site(app, 0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/jwks") as response:
                assert response.status == 200
                assert response.headers["Cache-Control"] == "public, max-age=2"
                assert len((await response.json())["keys"]) == 2
            clock.advance(POLICY.lead - 1.5)  # 1.5 s left: less than jwks_max_age
            async with http.get(url + "/jwks") as response:
                assert response.status == 200
                assert response.headers["Cache-Control"] == "public, max-age=1"
            clock.advance(1)
            async with http.get(url + "/jwks") as response:
                assert response.status == 503
                assert response.headers["Cache-Control"] == "no-store"
                body = await response.json()
                assert body["error"]["code"] == "temporarily_unavailable"
            await keyring.tick(clock())
            async with http.get(url + "/jwks") as response:
                assert response.status == 200
                assert response.headers["Cache-Control"] == "public, max-age=2"
    finally:
        await runner.cleanup()


async def test_a_ring_written_with_another_encryption_key_does_not_open(
    stores: list[Store],
) -> None:
    clock = MovableClock()
    await ring(stores[0], clock).start(ALGS)
    with pytest.raises(KeyDecryptionError, match="not the key the ring was written with"):
        await ring(stores[1], clock, secret=bytes(32)).start(ALGS)
    # Listing needs no key at all.
    listed = await StoredKeyRing(stores[1], None, POLICY, clock).listing(clock())
    assert listed is not None and len(listed) == 2


# ---------------------------------------------------------------------------- servers


@pytest.fixture
async def postgres_storage() -> AsyncIterator[tuple[str, str]]:
    url = await postgres_url_or_skip()
    async with fresh_schema(url) as schema:
        yield url, schema


async def test_a_server_on_postgresql_keeps_its_keys_sealed_in_the_database(
    postgres_storage: tuple[str, str], start_authserver: Any, http: aiohttp.ClientSession
) -> None:
    url, schema = postgres_storage
    config = default_config()
    config["storage"] = f"{url}?search_path={schema}"
    server = await start_authserver(config, fresh_keys=True)
    status, body = await client_credentials(http, server)
    assert status == 200, body
    await verify_jwt(http, server, body["access_token"], audience="orders-api")
    async with admin(url, schema) as conn:
        rows = await conn.fetch("SELECT kid, sealed_private_key FROM signing_keys")
    assert len(rows) == 2
    opener = KeyCipher(base64.b64decode(KEY_SECRET))
    for row in rows:
        assert row["sealed_private_key"].startswith(b"\x01")
        assert b"PRIVATE KEY" not in row["sealed_private_key"]
        opener.open(row["kid"], row["sealed_private_key"])
    assert server.settings.keys.dir is None


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "authserver", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_a_server_given_the_wrong_encryption_key_stops_with_one_line_saying_so(
    postgres_storage: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = postgres_storage
    config = default_config()
    config["storage"] = f"{url}?search_path={schema}"
    first = tmp_path / "first"
    first.mkdir()
    made = await asyncio.to_thread(
        cli, "keys", "rotate", "--config", str(write_config(first, config))
    )
    assert made.returncode == 0, made.stderr
    config["keys"] = {"encryption_key": base64.b64encode(bytes(32)).decode()}
    second = tmp_path / "second"
    second.mkdir()
    path = write_config(second, config)
    result = await asyncio.to_thread(cli, "run", "--config", str(path))
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "cannot use the signing keys in the storage: keys.encryption_key does not open" in output
    assert "Traceback" not in output
    listed = await asyncio.to_thread(cli, "keys", "list", "--config", str(path))
    assert listed.returncode == 0, listed.stderr  # listing opens no key
    rotated = await asyncio.to_thread(cli, "keys", "rotate", "--config", str(path))
    assert rotated.returncode == 1
    assert "cannot rotate the keys in the storage: keys.encryption_key" in rotated.stderr


async def test_check_refuses_postgresql_storage_without_an_encryption_key(tmp_path: Path) -> None:
    path = tmp_path / "authserver.yaml"
    path.write_text(
        "issuer: http://127.0.0.1:9000\n"
        "storage: postgresql://portcullis@127.0.0.1/auth\n"
        "keys: {jwks_max_age: 5m}\n"
    )
    result = await asyncio.to_thread(cli, "check", "--config", str(path))
    assert result.returncode == 1
    assert f"{path}:3: keys: PostgreSQL storage keeps the signing keys in the database" in (
        result.stderr
    )
    assert "set keys.encryption_key" in result.stderr


async def test_a_server_whose_key_ring_cannot_be_read_stops_signing_then_recovers_by_itself(
    postgres_storage: tuple[str, str], start_authserver: Any, http: aiohttp.ClientSession
) -> None:
    url, schema = postgres_storage
    config = default_config()
    config["storage"] = f"{url}?search_path={schema}"
    config["keys"] = {"jwks_max_age": "1s", "publish_ahead": "1s", "reload_every": "200ms"}
    clock = MovableClock()
    server = await start_authserver(config, fresh_keys=True, clock=clock)
    assert (await client_credentials(http, server))[0] == 200
    lead = 1 + 2 * 0.2  # publish_ahead + two reads of the ring
    async with admin(url, schema) as conn:
        # The ring's reads fail from now on (as they would with the table unreachable).
        await conn.execute("ALTER TABLE signing_key_ring RENAME TO signing_key_ring_away")
        try:
            await asyncio.sleep(0.5)  # checks that fail come and go
            clock.advance(lead + 0.1)
            status, body = await client_credentials(http, server)
            assert (status, body["error"]) == (503, "temporarily_unavailable")
            async with http.get(server.endpoint("/jwks")) as response:
                assert response.status == 503
        finally:
            await conn.execute("ALTER TABLE signing_key_ring_away RENAME TO signing_key_ring")

    async def signing_again() -> bool:
        return (await client_credentials(http, server))[0] == 200

    deadline = asyncio.get_running_loop().time() + 5
    while not await signing_again():
        assert asyncio.get_running_loop().time() < deadline, "no recovery"
        await asyncio.sleep(0.1)
    async with http.get(server.endpoint("/jwks")) as response:
        assert response.status == 200
