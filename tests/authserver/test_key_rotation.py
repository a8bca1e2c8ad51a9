"""Signing-key rotation: `keys rotate` and `keys list` against a running server's key
directory, the automatic schedule, the JWKS cache time it is measured against, the lock that
lets several processes change the directory, and the configuration's rules."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from authserver import settings as authserver_settings
from authserver.keys import CHECK_EVERY, LOCK, NOTICE_WITHIN, KeyRing, RotationPolicy
from portcullis.yamlconf import ConfigError
from tests.authserver.conftest import (
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    SteppingClock,
    client_credentials,
    default_config,
    introspect,
    render_config,
    tokens_for,
    verify_jwt,
)
from tests.authserver.postgres_support import fresh_schema, postgres_url_or_skip
from tests.authserver.rotation_support import (
    ROOT,
    config_file,
    eventually,
    keys_command,
    kid_of,
    listed,
    on_disk,
    published,
    rotate,
)
from tests.support import UNBOUND_PORT, wait_for

NOTICE = NOTICE_WITHIN.total_seconds()


def rotation_config(**keys: Any) -> dict[str, Any]:
    """Short times: the JWKS may be cached 1 s, so a key is published 1 s before it signs;
    tokens live 2 s, so a retired key stays 2 s."""
    config = default_config()
    config["keys"] = {"jwks_max_age": "1s", "publish_ahead": "1s", **keys}
    config["lifetimes"] = {"access_token": "2s", "id_token": "2s"}
    return config


@pytest.fixture(params=["directory", "postgresql"])
async def keys_kept(request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    """What to add to a config for its keys to live in a directory (SQLite storage), or in
    PostgreSQL (sealed, in a schema of the test's own)."""
    if request.param == "directory":
        yield {}
        return
    url = await postgres_url_or_skip()
    async with fresh_schema(url) as schema:
        yield {"storage": f"{url}?search_path={schema}"}


def waiting_config() -> dict[str, Any]:
    """For the commands alone: a rotated key waits a minute before it signs, so that what
    they list does not depend on how fast the machine runs them."""
    return rotation_config(publish_ahead="1m")


async def move_clock(server: RunningAuthServer, clock: MovableClock, moment: float) -> None:
    """Move the server's time to `moment`. A ring kept in the storage is trusted only as
    recently as it was read (a jump looks like a store that went silent): wait for the
    server's next read, which comes every CHECK_EVERY of real time, at the new time."""
    clock.advance(moment - clock.now)
    ring = server.services.keyring

    async def current() -> bool:
        return ring.stale(clock.now) is None

    if not await current():  # only a jump past what the last read allows
        await eventually(current, 5, "the server to read its key ring at the moved time")


async def machine_token(http: aiohttp.ClientSession, server: Any) -> str:
    status, body = await client_credentials(http, server)
    assert status == 200, body
    return str(body["access_token"])


# ---------------------------------------------------------------------------- the command, live


async def test_a_rotated_key_is_published_at_once_signs_after_publish_ahead_and_goes_with_its_last_token(  # noqa: E501
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, keys_kept: dict[str, Any]
) -> None:
    config = {**rotation_config(), **keys_kept}
    # The server's time, moved to the moments the rotation names; the command that rotates
    # and the server's checks every CHECK_EVERY run on real time.
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    path = config_file(server, config)
    old = kid_of(await machine_token(http, server))
    before = await listed(path)
    assert {(e["alg"], e["state"]) for e in before.values()} == {
        ("ES256", "active"),
        ("RS256", "active"),
    }
    old_rs = next(kid for kid, e in before.items() if e["alg"] == "RS256")

    rotated_at = time.time()
    out = await rotate(path)
    lines = out.splitlines()
    assert len(lines) == 2 and all("next: published now; signs from " in line for line in lines)
    created = {line.split()[1]: line.split()[0] for line in lines}
    new, new_rs = created["ES256"], created["RS256"]

    async def new_key_published() -> bool:
        return {new, new_rs} <= await published(http, server)

    # Published while the server's time stands before activate_at - publish_ahead (its
    # time moves only below, once the key is seen): how long after the rotation's writing the
    # real time shows it depends on the server's timer, which a busy machine runs late.
    await eventually(new_key_published, NOTICE + 0.5, "the new key in the JWKS")
    signed_by = kid_of(await machine_token(http, server))
    # The ring as written, not `keys list`: the command judges the states at the real time,
    # which passes activate_at while the server's time stands still, as soon as the machine
    # takes more than publish_ahead + NOTICE to get here.
    after = await on_disk(server)
    waiting = {e["alg"]: e for e in after.values() if e["state"] == "next"}
    assert {alg: e["kid"] for alg, e in waiting.items()} == created
    activate_at = waiting["ES256"]["activate_at"]
    # publish_ahead, plus the time every running server may take to notice the new key.
    assert rotated_at + 1 + NOTICE <= activate_at <= time.time() + 1 + NOTICE
    assert clock.now <= activate_at - 1 - NOTICE and signed_by == old

    await move_clock(server, clock, activate_at - 0.4)
    last_old = await machine_token(http, server)
    assert kid_of(last_old) == old
    await move_clock(server, clock, activate_at + 0.05)
    first_new = await machine_token(http, server)
    assert kid_of(first_new) == new
    id_token = (await tokens_for(http, server))["id_token"]
    assert kid_of(id_token) == new_rs
    await verify_jwt(http, server, first_new, audience="orders-api")
    # The retired key stays published: what it signed is still good.
    await verify_jwt(http, server, last_old, audience="orders-api")
    assert (await introspect(http, server, last_old))["active"] is True

    async def retired_on_disk() -> bool:
        return (await on_disk(server))[old]["state"] == "retired"

    await eventually(retired_on_disk, 1.5, "the server to write the retirement")
    disk = await on_disk(server)
    assert disk[new]["state"] == "active"
    assert disk[old]["retired_at"] == activate_at
    assert disk[old]["remove_after"] == activate_at + 2  # the longest token lifetime
    assert disk[old_rs]["state"] == "retired"

    await move_clock(server, clock, disk[old]["remove_after"])

    async def old_key_gone() -> bool:
        return not {old, old_rs} & await published(http, server)

    await eventually(old_key_gone, 1.5, "the retired keys to leave the JWKS")
    if server.settings.keys.dir is not None:
        keys_dir = Path(server.settings.keys.dir)
        assert not (keys_dir / f"{old}.pem").exists()
        assert (keys_dir / f"{new}.pem").exists()
    else:
        assert set(await on_disk(server)) == {new, new_rs}
    listing = await listed(path)
    assert old not in listing and old_rs not in listing
    assert {(e["kid"], e["state"]) for e in listing.values()} == {
        (new, "active"),
        (new_rs, "active"),
    }
    # Nothing unexpired depended on it.
    assert jwt.decode(last_old, options={"verify_signature": False})["exp"] <= clock.now


async def test_keys_list_prints_each_keys_kid_algorithm_state_and_dates(tmp_path: Path) -> None:
    path = tmp_path / "authserver.yaml"
    path.write_text(render_config(waiting_config(), tmp_path, UNBOUND_PORT))
    out = await rotate(path, "--alg", "ES256")
    status, table, err = await keys_command("list", "--config", str(path))
    assert status == 0, err
    header, *rows = table.splitlines()
    columns = ["KID", "ALG", "STATE", "CREATED", "SIGNS FROM", "RETIRED", "REMOVED AFTER"]
    assert header.split() == " ".join(columns).split(" ")
    cells = [row.split() for row in rows]
    assert sorted((c[1], c[2]) for c in cells) == [
        ("ES256", "active"),
        ("ES256", "next"),
        ("RS256", "active"),
    ]
    waiting = next(c for c in cells if c[2] == "next")
    assert waiting[0] in out
    for cell in cells:
        assert cell[5:] == ["-", "-"]  # not retired
        for moment in cell[3:5]:
            time.strptime(moment, "%Y-%m-%dT%H:%M:%SZ")
    assert waiting[4] > waiting[3]  # it signs later than it was made


async def test_a_second_rotate_keeps_the_key_already_waiting(tmp_path: Path) -> None:
    path = tmp_path / "authserver.yaml"
    path.write_text(render_config(waiting_config(), tmp_path, UNBOUND_PORT))
    first = await rotate(path)
    second = await rotate(path)
    kids = lambda out: sorted(line.split()[0] for line in out.splitlines())  # noqa: E731
    assert kids(first) == kids(second)
    assert all("already waiting" in line for line in second.splitlines())
    states = sorted((e["alg"], e["state"]) for e in (await listed(path)).values())
    assert states == [
        ("ES256", "active"),
        ("ES256", "next"),
        ("RS256", "active"),
        ("RS256", "next"),
    ]


def test_a_key_rotated_in_the_directory_is_dated_from_its_writing(tmp_path: Path) -> None:
    # Every read of the clock half a second later: the lock waited for and the key's
    # generation take time between the decision and the write.
    clock = SteppingClock(0.5)
    policy = RotationPolicy(publish_ahead=1, retain=2)
    ring = KeyRing(tmp_path / "keys", policy, clock)
    ring.load(["RS256"])
    began = clock()
    (rotation,) = ring.rotate(["RS256"], began)
    info = rotation.info
    assert info.created_at > began
    assert info.activate_at == info.created_at + policy.lead
    (entry,) = [e for e in on_disk_entries(tmp_path / "keys") if e["kid"] == info.kid]
    assert (entry["state"], entry["created_at"], entry["activate_at"]) == (
        "next",
        info.created_at,
        info.activate_at,
    )


def on_disk_entries(keys_dir: Path) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads((keys_dir / "keyring.json").read_text())
    return entries


async def test_rotate_refuses_an_algorithm_the_server_does_not_sign_with(tmp_path: Path) -> None:
    path = tmp_path / "authserver.yaml"
    path.write_text(render_config(waiting_config(), tmp_path, UNBOUND_PORT))
    status, out, err = await keys_command("rotate", "--config", str(path), "--alg", "EdDSA")
    assert status == 1
    assert out == ""
    assert "does not sign with EdDSA (it signs with ES256, RS256)" in err


async def test_list_says_when_there_are_no_keys_yet(tmp_path: Path) -> None:
    path = tmp_path / "authserver.yaml"
    path.write_text(render_config(waiting_config(), tmp_path, UNBOUND_PORT))
    status, _, err = await keys_command("list", "--config", str(path))
    assert status == 1
    assert "no keys in" in err and "when it first starts" in err
    assert not (tmp_path / "keys").exists()  # listing changes nothing


def _waits_for_flock(pid: int, path: Path) -> bool:
    """Whether process `pid` is blocked on an flock of `path` (Linux /proc/locks lists each
    waiter with `->` before the lock it waits for)."""
    inode = str(path.stat().st_ino)
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if (
            len(fields) > 6
            and fields[1:3] == ["->", "FLOCK"]
            and fields[5] == str(pid)
            and fields[6].rsplit(":", 1)[-1] == inode
        ):
            return True
    return False


async def test_key_commands_wait_for_the_lock_another_process_holds(tmp_path: Path) -> None:
    path = tmp_path / "authserver.yaml"
    path.write_text(render_config(waiting_config(), tmp_path, UNBOUND_PORT))
    keys_dir = tmp_path / "keys"
    KeyRing(keys_dir).load(["ES256", "RS256"])
    metadata = (keys_dir / "keyring.json").read_text()

    fd = os.open(keys_dir / LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "authserver",
            "keys",
            "rotate",
            "--config",
            str(path),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        # The kernel lists the command as a waiter on the lock: it got that far and waits.
        await wait_for(
            lambda: _waits_for_flock(process.pid, keys_dir / LOCK) or process.returncode,
            30,
            "the command to wait for the lock",
        )
        assert process.returncode is None  # still waiting for the lock
        assert (keys_dir / "keyring.json").read_text() == metadata
    finally:
        os.close(fd)
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    states = sorted(e["state"] for e in (await listed(path)).values())
    assert states == ["active", "active", "next", "next"]


# ---------------------------------------------------------------------------- the schedule


def test_the_automatic_schedule_publishes_ahead_switches_on_time_and_removes_after_retention(
    tmp_path: Path,
) -> None:
    policy = RotationPolicy(publish_ahead=60, retain=300, rotate_every=3600)
    ring = KeyRing(tmp_path / "keys", policy)
    ring.load(["ES256"])
    (first,) = ring.infos()
    t0 = first.created_at
    # Published early enough that even a check coming CHECK_EVERY late switches on time.
    lead = policy.publish_ahead + NOTICE + CHECK_EVERY.total_seconds()

    assert ring.check(t0 + 3600 - lead - 0.5) == []
    events = ring.check(t0 + 3600 - lead + CHECK_EVERY.total_seconds())
    assert [(e.alg, e.what) for e in events] == [("ES256", "published")]
    second = events[0].kid
    infos = {i.kid: i for i in ring.infos()}
    assert (infos[second].state, infos[second].activate_at) == ("next", t0 + 3600)
    assert second.encode() in ring.jwks_body and first.kid.encode() in ring.jwks_body
    # The clock decides which key signs, whenever the state change is written.
    assert ring.active("ES256", t0 + 3599.9).kid == first.kid
    assert ring.active("ES256", t0 + 3600).kid == second

    events = ring.check(t0 + 3600 + 1)
    assert sorted((e.kid, e.what) for e in events) == sorted(
        [(first.kid, "retired"), (second, "activated")]
    )
    infos = {i.kid: i for i in ring.infos()}
    assert infos[first.kid].state == "retired"
    assert (infos[first.kid].retired_at, infos[first.kid].remove_after) == (t0 + 3600, t0 + 3900)
    assert ring.check(t0 + 3899) == []

    events = ring.check(t0 + 3900)
    assert [(e.kid, e.what) for e in events] == [(first.kid, "removed")]
    assert first.kid.encode() not in ring.jwks_body
    assert not (tmp_path / "keys" / f"{first.kid}.pem").exists()
    # Another process reading the directory sees the same ring.
    other = KeyRing(tmp_path / "keys")
    other.reload()
    assert other.infos() == ring.infos()
    # And the next rotation is due rotate_every after the second key started.
    events = ring.check(t0 + 7200 - lead)
    assert [(e.what, ring.infos()[-1].activate_at) for e in events] == [("published", t0 + 7200)]


async def test_a_running_server_rotates_on_its_own_when_rotate_every_is_set(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, keys_kept: dict[str, Any]
) -> None:
    server = await start_authserver({**rotation_config(rotate_every="2s"), **keys_kept})
    first = kid_of(await machine_token(http, server))
    published_at: dict[str, float] = {}

    async def rotated() -> bool:
        for kid in await published(http, server):
            published_at.setdefault(kid, time.time())
        return kid_of(await machine_token(http, server)) != first

    # rotate_every is shorter than the lead a successor needs, so one is due at once:
    # published within a check, signing publish_ahead plus the notice time later.
    switched = await eventually(rotated, 1 + NOTICE + 2, "an automatic rotation", every=0.1)
    second = kid_of(await machine_token(http, server))
    assert switched - published_at[second] >= 1  # at least publish_ahead in the JWKS first
    assert (await on_disk(server))[second]["activate_at"] <= switched


# ---------------------------------------------------------------------------- JWKS and config


@pytest.mark.parametrize(("jwks_max_age", "header"), [(None, "max-age=300"), ("7s", "max-age=7")])
async def test_the_jwks_cache_time_is_keys_jwks_max_age(
    start_authserver: StartAuthServer,
    http: aiohttp.ClientSession,
    jwks_max_age: str | None,
    header: str,
) -> None:
    config = default_config()
    if jwks_max_age:
        config["keys"] = {"jwks_max_age": jwks_max_age}
    server = await start_authserver(config)
    async with http.get(server.endpoint("/jwks")) as response:
        assert response.headers["Cache-Control"] == f"public, {header}"
    seconds = int(header.removeprefix("max-age="))
    assert server.settings.keys.publish_ahead.total_seconds() == seconds


def settings_problems(tmp_path: Path, keys: dict[str, Any]) -> list[str]:
    config = default_config()
    config["keys"] = keys
    text = render_config(config, tmp_path, UNBOUND_PORT)
    try:
        authserver_settings.load_text(text, "authserver.yaml")
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        (
            {"jwks_max_age": "1m", "publish_ahead": "30s"},
            "keys.publish_ahead: must be at least keys.jwks_max_age (60s)",
        ),
        ({"publish_ahead": "10m", "rotate_every": "5m"}, "keys.rotate_every: must be at least"),
        ({"jwks_max_age": "1500ms"}, "keys.jwks_max_age: '1500ms' must be a whole number"),
        ({"jwks_max_age": "0s"}, "keys.jwks_max_age: '0s' must be a whole number"),
    ],
)
def test_key_times_that_would_let_a_key_sign_before_verifiers_have_it_are_refused(
    tmp_path: Path, keys: dict[str, Any], problem: str
) -> None:
    problems = settings_problems(tmp_path, keys)
    assert len(problems) == 1, problems
    assert problem in problems[0]
    assert problems[0].startswith("authserver.yaml:")


def test_publish_ahead_defaults_to_the_jwks_cache_time(tmp_path: Path) -> None:
    config = default_config()
    config["keys"] = {"jwks_max_age": "2m", "rotate_every": "30d"}
    settings = authserver_settings.load_text(render_config(config, tmp_path, UNBOUND_PORT))
    assert settings.keys.publish_ahead.total_seconds() == 120
    assert settings.keys.rotate_every is not None
    assert settings.keys.rotate_every.days == 30
    assert settings_problems(tmp_path, {"publish_ahead": "10m"}) == []
