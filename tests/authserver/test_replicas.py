"""Two replicas, one service: two authorization server processes on one PostgreSQL schema
and one issuer URL, each on its own port, behave as one server whichever of them a request
reaches. Codes, refresh families, sessions and their CSRF secrets, consents, client
assertion ids, device codes and signing keys all live in the database.

`refresh_grace` is 0 here: a rotated refresh token shown again is a replay at once, which
is what the reuse detection tests need (with a grace window the same client's immediate
retry would get the lost response again; tests/authserver/test_crash_safety.py covers it).

Needs the machine's PostgreSQL (tests/authserver/postgres_support.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import jwt
import pytest

from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    SECRET,
    authorize_code,
    basic_auth,
    client_assertion,
    exchange_code,
    fetch_jwks,
    introspect,
    login_page_path,
    parse_form,
    pkce_pair,
    post_token,
    query_of,
    tokens_for,
)
from tests.authserver.device_support import approve_on_pages, device_config, poll, start_device
from tests.authserver.postgres_support import fresh_schema, postgres_url_or_skip
from tests.authserver.process_support import Process, write_config
from tests.authserver.rotation_support import eventually, kid_of
from tests.support import reserve_port

ROOT = Path(__file__).resolve().parents[2]
RACERS = 20
# Keys: the JWKS may be cached 1 s, a new key is published 1 s before it signs, and every
# replica reads the ring again every 500 ms: a rotated key signs 2 s after it appears.
KEYS = {"jwks_max_age": "1s", "publish_ahead": "1s", "reload_every": "500ms"}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # Cookies for 127.0.0.1 go to both replicas, as a browser sends them to one host name.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


@pytest.fixture
async def storage() -> AsyncIterator[str]:
    url = await postgres_url_or_skip()
    async with fresh_schema(url) as schema:
        yield f"{url}?search_path={schema}"


class Replicas:
    def __init__(self, a: Process, b: Process, issuer: str) -> None:
        self.a, self.b, self.issuer = a, b, issuer


@pytest.fixture
async def replicas(
    tmp_path: Path, storage: str, http: aiohttp.ClientSession
) -> AsyncIterator[Replicas]:
    """Replica A and replica B, started together on an empty schema: the issuer is A's
    address, which both serve as theirs."""
    config = device_config()
    config["storage"] = storage
    config["refresh_grace"] = "0s"
    config["keys"] = dict(KEYS)
    ports = reserve_port(), reserve_port()
    config["issuer"] = f"http://127.0.0.1:{ports[0]}"
    processes = []
    for name, port in zip("ab", ports, strict=True):
        directory = tmp_path / name
        directory.mkdir()
        processes.append(
            Process(
                write_config(directory, config, port),
                f"http://127.0.0.1:{port}",
                tmp_path / f"{name}.log",
            )
        )
    try:
        for process in processes:
            process.start()
        await asyncio.gather(*(process.wait_ready(http) for process in processes))
        yield Replicas(processes[0], processes[1], config["issuer"])
    finally:
        for process in processes:
            process.stop()


async def refresh(
    http: aiohttp.ClientSession, replica: Process, token: str
) -> tuple[int, dict[str, Any]]:
    data = {"grant_type": "refresh_token", "refresh_token": token, "client_id": "spa"}
    async with http.post(replica.url + "/token", data=data) as response:
        return response.status, await response.json()


async def published(http: aiohttp.ClientSession, replica: Process) -> set[str]:
    return {key["kid"] for key in (await fetch_jwks(http, replica.server()))["keys"]}


def verify(token: str, jwks: dict[str, Any], issuer: str, audience: str) -> dict[str, Any]:
    kid = kid_of(token)
    (jwk,) = [key for key in jwks["keys"] if key["kid"] == kid]
    claims: dict[str, Any] = jwt.decode(
        token, jwt.PyJWK(jwk).key, algorithms=[jwk["alg"]], issuer=issuer, audience=audience
    )
    return claims


async def test_both_replicas_started_on_an_empty_database_sign_with_the_same_keys(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    a, b = replicas.a.server(), replicas.b.server()
    jwks_a, jwks_b = await fetch_jwks(http, a), await fetch_jwks(http, b)
    assert jwks_a == jwks_b
    assert sorted(key["alg"] for key in jwks_a["keys"]) == ["ES256", "RS256"]
    tokens = await tokens_for(http, a)
    # A token B signed verifies against A's key set, and the other way round.
    from_b = await tokens_for(http, b)
    for token, jwks in ((tokens["access_token"], jwks_b), (from_b["access_token"], jwks_a)):
        assert verify(token, jwks, replicas.issuer, "orders-api")["iss"] == replicas.issuer


async def test_a_code_issued_by_one_replica_is_redeemed_at_the_other_once(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    result = await authorize_code(http, replicas.a.server())
    status, tokens = await exchange_code(http, replicas.b.server(), result)
    assert status == 200, tokens
    assert tokens["refresh_token"] and tokens["id_token"]
    again, body = await exchange_code(http, replicas.a.server(), result)
    assert (again, body["error"]) == (400, "invalid_grant")
    # Redeeming it twice revokes what the first redemption issued (RFC 6749 §4.1.2).
    assert (await introspect(http, replicas.b.server(), tokens["access_token"]))["active"] is False


async def test_a_refresh_token_rotated_at_one_replica_and_replayed_at_the_other_revokes_the_family(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, replicas.a.server())
    status, rotated = await refresh(http, replicas.a, tokens["refresh_token"])
    assert status == 200, rotated
    status, replay = await refresh(http, replicas.b, tokens["refresh_token"])
    assert (status, replay["error"]) == (400, "invalid_grant")
    # The whole family is revoked: the successor A handed out no longer works at A.
    status, body = await refresh(http, replicas.a, rotated["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant")
    for replica in (replicas.a, replicas.b):
        answer = await introspect(http, replica.server(), rotated["access_token"])
        assert answer == {"active": False}


async def test_of_concurrent_refreshes_of_one_token_at_both_replicas_exactly_one_succeeds(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, replicas.a.server())
    targets = [replicas.a if n % 2 else replicas.b for n in range(RACERS)]
    results = await asyncio.gather(
        *(refresh(http, target, tokens["refresh_token"]) for target in targets)
    )
    statuses = Counter(status for status, _ in results)
    assert statuses == {200: 1, 400: RACERS - 1}, results
    assert all(body["error"] == "invalid_grant" for status, body in results if status == 400)
    # Without a grace window the losers are replays: they revoke the family, the winner's
    # successor included, so no two holders of one token can both go on.
    (winner,) = [body for status, body in results if status == 200]
    status, body = await refresh(http, replicas.b, winner["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant")


async def test_a_session_made_at_one_replica_signs_in_at_the_other(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    a, b = replicas.a.server(), replicas.b.server()
    await authorize_code(http, a, scope="openid orders:read")  # login and consent at A
    verifier, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": "openid orders:read",
        "state": "s-1",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    response = await http.get(b.url + "/authorize?" + urlencode(params), allow_redirects=False)
    # No login form: B knows the session (and the consent) A recorded.
    assert response.status == 302, (await response.text())[:500]
    code = query_of(response.headers["Location"])["code"]
    data = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": REDIRECT,
        "code_verifier": verifier,
        "client_id": "spa",
    }
    status, tokens, _ = await post_token(http, a, data)
    assert status == 200, tokens
    claims = jwt.decode(tokens["id_token"], options={"verify_signature": False})
    assert claims["sub"] == a.subject("alice")

    # A form one replica served is accepted by the other: the CSRF secret is the session's.
    params.update(scope="openid orders:read orders:write", state="s-2")
    page = await http.get(a.url + "/authorize?" + urlencode(params), allow_redirects=False)
    assert page.status == 200
    action, fields = parse_form(await page.text())
    assert action.endswith("/consent")
    fields["decision"] = "approve"
    answer = await http.post(b.url + "/consent", data=fields, allow_redirects=False)
    assert answer.status in (302, 303), (await answer.text())[:500]
    assert "code" in query_of(answer.headers["Location"])
    # And a forged token is refused there all the same.
    fields["csrf_token"] = "forged"
    forged = await http.post(b.url + "/consent", data=fields, allow_redirects=False)
    assert forged.status in (400, 403)


async def test_a_login_form_from_one_replica_is_posted_to_the_other(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    page = await http.get(replicas.a.url + login_page_path(), allow_redirects=False)
    action, fields = parse_form(await page.text())
    assert action.endswith("/login")
    fields.update(username="alice", password=PASSWORD)
    answer = await http.post(replicas.b.url + "/login", data=fields, allow_redirects=False)
    assert answer.status in (200, 302, 303), (await answer.text())[:500]
    assert "Wrong" not in await answer.text()


async def sign_in(http: aiohttp.ClientSession, replica: Process, password: str) -> int:
    """Open a login page at `replica` and post it there; the answer's status."""
    page = await http.get(replica.url + login_page_path(), allow_redirects=False)
    action, fields = parse_form(await page.text())
    assert action.endswith("/login")
    fields.update(username="alice", password=password)
    answer = await http.post(replica.url + "/login", data=fields, allow_redirects=False)
    return answer.status


async def test_wrong_passwords_at_both_replicas_count_against_one_limit(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    # login_throttle.max_failures: 5 per username at one address, whichever replica.
    statuses = [
        await sign_in(http, replica, "wrong")
        for replica in [replicas.a, replicas.b, replicas.a, replicas.b, replicas.a]
    ]
    assert statuses == [400] * 5
    assert await sign_in(http, replicas.b, PASSWORD) == 429
    assert await sign_in(http, replicas.a, PASSWORD) == 429


async def test_an_access_token_revoked_at_one_replica_is_inactive_at_the_other(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, replicas.a.server())
    a = replicas.a.server()
    assert (await introspect(http, a, tokens["access_token"]))["active"] is True
    async with http.post(
        replicas.b.url + "/revoke",
        data={"token": tokens["access_token"], "client_id": "spa"},
    ) as response:
        assert response.status == 200
    assert await introspect(http, a, tokens["access_token"]) == {"active": False}
    # A machine's token, never recorded, is revoked across replicas too.
    status, body, _ = await post_token(
        http, replicas.a.server(), {"grant_type": "client_credentials"}, auth=("machine", SECRET)
    )
    assert status == 200, body
    async with http.post(
        replicas.b.url + "/revoke",
        data={"token": body["access_token"]},
        headers={"Authorization": basic_auth("machine", SECRET)},
    ) as response:
        assert response.status == 200
    assert await introspect(http, a, body["access_token"]) == {"active": False}


async def test_a_client_assertion_used_at_one_replica_is_refused_at_the_other(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    assertion = client_assertion(replicas.issuer)
    data = {
        "grant_type": "client_credentials",
        "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        "client_assertion": assertion,
    }
    first, body, _ = await post_token(http, replicas.a.server(), data)
    assert first == 200, body
    again, body, _ = await post_token(http, replicas.b.server(), data)
    assert (again, body["error"]) == (401, "invalid_client")


async def test_a_device_started_at_one_replica_is_approved_at_the_other_and_polls_either(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    a, b = replicas.a.server(), replicas.b.server()
    status, started, _ = await start_device(http, a)
    assert status == 200, started
    link = started["verification_uri_complete"].replace(replicas.issuer, replicas.b.url)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        done = await approve_on_pages(browser, b, link)
    assert done.status == 200, done.text[:500]
    status, tokens = await poll(http, a, started["device_code"])
    assert status == 200, tokens
    await asyncio.sleep(1.1)  # the polling interval
    again, body = await poll(http, b, started["device_code"])
    assert (again, body["error"]) == (400, "invalid_grant")


@dataclass(frozen=True)
class KeySetAnswer:
    """What a replica's /jwks answered to a request sent at `asked_at` (time.time())."""

    asked_at: float
    kids: frozenset[str] | None  # None: withheld (503), nothing a verifier may keep
    max_age: int


async def ask_jwks(http: aiohttp.ClientSession, replica: Process) -> KeySetAnswer:
    asked_at = time.time()
    async with http.get(replica.url + "/jwks") as response:
        cache_control = response.headers["Cache-Control"]
        if response.status == 503:
            assert cache_control == "no-store"
            return KeySetAnswer(asked_at, None, 0)
        assert response.status == 200
        body = await response.json()
    found = re.search(r"max-age=(\d+)", cache_control)
    assert found is not None, cache_control
    return KeySetAnswer(asked_at, frozenset(k["kid"] for k in body["keys"]), int(found[1]))


async def signing_kid(http: aiohttp.ClientSession, server: Any) -> tuple[float, str, float]:
    """(time sent, kid of the token, time answered): the replica signed in between."""
    asked_at = time.time()
    kid = kid_of(await machine_token(http, server))
    return asked_at, kid, time.time()


async def test_a_key_rotated_through_one_replica_is_published_by_the_other_before_it_signs(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    # The replicas are processes on the real clock, each reading the ring on its own timer:
    # what is checked holds however late those timers run on a busy machine, and each
    # moment is read before and after the request that shows it.
    a, b = replicas.a.server(), replicas.b.server()
    old = kid_of(await machine_token(http, b))
    before = await published(http, replicas.b)
    rotated_at = time.time()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "authserver",
        "keys",
        "rotate",
        "--config",
        str(replicas.a.config),
        "--alg",
        "ES256",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    new = out.decode().split()[0]
    assert new not in before

    answers: list[KeySetAnswer] = []

    async def b_publishes_it() -> bool:
        answers.append(await ask_jwks(http, replicas.b))
        return answers[-1].kids is not None and new in answers[-1].kids

    await eventually(b_publishes_it, 5, "replica B to publish the new key")
    listing = await keys_list(replicas.b.config)
    activate_at = listing[new]["activate_at"]
    assert activate_at >= rotated_at + 1 + 1.0  # publish_ahead + two reads of the ring
    # Published before it signs: no key set B served without the new key may be kept by a
    # verifier past the moment the key signs (its max-age is cut to what B's last read of
    # the ring allows, or B withholds the set), whenever B's timer read the ring.
    for answer in answers:
        if answer.kids is not None and new not in answer.kids:
            assert answer.asked_at + answer.max_age <= activate_at, (answer, activate_at)
    assert new in await published(http, replicas.a)

    async def b_signs_with_it() -> bool:
        asked_at, kid, answered_at = await signing_kid(http, b)
        # The key B signs with is decided by the clock: the old one until activate_at, the
        # new one (which B publishes already) from then on.
        if answered_at < activate_at:
            assert kid == old
        if asked_at >= activate_at:
            assert kid == new
        return kid == new

    await eventually(b_signs_with_it, 5, "replica B to sign with the new key")
    token = await machine_token(http, a)
    assert kid_of(token) == new
    jwks = await fetch_jwks(http, b)
    assert verify(token, jwks, replicas.issuer, "orders-api")["client_id"] == "machine"


async def machine_token(http: aiohttp.ClientSession, server: Any) -> str:
    status, body, _ = await post_token(
        http, server, {"grant_type": "client_credentials"}, auth=("machine", SECRET)
    )
    assert status == 200, body
    return str(body["access_token"])


async def keys_list(config: Path) -> dict[str, dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "authserver",
        "keys",
        "list",
        "--json",
        "--config",
        str(config),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return {entry["kid"]: entry for entry in json.loads(out)}
