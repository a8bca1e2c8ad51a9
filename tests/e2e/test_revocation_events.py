"""Revocation events end to end: the authorization server records and streams what it
revokes, the gateway (verifying JWTs locally) subscribes and refuses revoked tokens within a
second. Both run on 127.0.0.1 over real HTTP; where a test must cut the stream or slip
events into it, a relay of its own stands between them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from tests.authserver.conftest import (
    SECRET,
    MovableClock,
    RunningAuthServer,
    basic_auth,
    client_credentials,
    default_config,
    post_token,
    tokens_for,
)
from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    EchoUpstream,
    GatewayProcess,
    ManualClock,
    RunningGateway,
    ecdsa_twin,
    running_gateway,
    sample,
    scrape,
    start_site,
    wait_for,
)

ROUTES = """
  - {name: orders-read, path: "/orders/**", methods: [GET], scopes: {any: ["orders:read"]}}
"""
EVENTS = "portcullis_gateway_revocation_events_total"


def gateway_config(issuer: str, upstream: str, events: str = "", mode: str = "jwt") -> str:
    """The gateway in front of `upstream`, trusting `issuer` with its revocation events;
    `events`: more keys of that section, as YAML flow text starting with a comma."""
    introspection = ""
    if mode != "jwt":
        introspection = (
            f"\n    mode: {mode}"
            f'\n    introspection: {{client_id: resource-server, client_secret: "{SECRET}"}}'
        )
    section = f'{{client_id: resource-server, client_secret: "{SECRET}"{events}}}'
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}"}}
issuers:
  - issuer: "{issuer}"
    audiences: [orders-api]
    algorithms: [ES256]
    revocation_events: {section}{introspection}
routes:
{ROUTES}
"""


async def status_of(http: aiohttp.ClientSession, gateway: RunningGateway, token: str) -> int:
    async with http.get(
        gateway.url + "/orders/1", headers={"Authorization": f"Bearer {token}"}
    ) as response:
        await response.read()
        return response.status


async def readiness(http: aiohttp.ClientSession, gateway: RunningGateway) -> tuple[int, Any]:
    async with http.get(gateway.admin_url + "/readyz") as response:
        return response.status, await response.json()


async def synced(http: aiohttp.ClientSession, gateway: RunningGateway, timeout: float = 5) -> None:
    """Until /readyz shows every revocation stream up to date."""
    deadline = time.monotonic() + timeout
    while True:
        _, body = await readiness(http, gateway)
        streams = body.get("revocation_events", {})
        if streams and all(s["state"] == "synced" for s in streams.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the revocation stream did not sync: {body}")
        await asyncio.sleep(0.02)


async def refused_within(
    http: aiohttp.ClientSession, gateway: RunningGateway, token: str, limit: float
) -> float:
    """Seconds until the gateway refuses `token` with 401; fails past `limit`."""
    started = time.monotonic()
    while True:
        status = await status_of(http, gateway, token)
        elapsed = time.monotonic() - started
        if status == 401:
            return elapsed
        assert status == 200, status
        assert elapsed < limit, f"still accepted after {elapsed:.2f}s"
        await asyncio.sleep(0.01)


async def revoke(http: aiohttp.ClientSession, server: RunningAuthServer, token: str) -> None:
    response = await http.post(
        server.endpoint("/revoke"),
        data={"token": token},
        headers={"Authorization": basic_auth("machine", SECRET)},
    )
    assert response.status == 200, await response.text()


async def machine_token(http: aiohttp.ClientSession, server: RunningAuthServer) -> str:
    status, body = await client_credentials(http, server, scope="orders:read")
    assert status == 200, body
    return str(body["access_token"])


@contextlib.asynccontextmanager
async def upstream_and_gateway(
    server: RunningAuthServer, events: str = "", mode: str = "jwt", **kw: Any
) -> AsyncIterator[RunningGateway]:
    upstream = await EchoUpstream().start()
    try:
        async with running_gateway(
            gateway_config(server.url, upstream.url, events, mode), **kw
        ) as gateway:
            yield gateway
    finally:
        await upstream.stop()


class Relay:
    """An HTTP relay of the event stream that the test can cut, hold down, or slip events
    into ahead of the real ones; it records each request's Last-Event-ID."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.down = False
        self.inject: list[str] = []  # raw SSE text sent before the relayed stream
        self.last_event_ids: list[str | None] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.runner: Any = None
        self.url = ""

    async def start(self) -> Relay:
        app = web.Application()
        app.router.add_get("/events", self.handle)
        self.runner, base = await start_site(app)
        self.url = base + "/events"
        return self

    async def stop(self) -> None:
        self.cut()
        await self.runner.cleanup()

    def cut(self) -> None:
        """End every stream relayed now."""
        for task in list(self._tasks):
            task.cancel()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            return web.Response(status=503)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.last_event_ids.append(request.headers.get("Last-Event-ID"))
        headers = {"Authorization": request.headers["Authorization"]}
        if "Last-Event-ID" in request.headers:
            headers["Last-Event-ID"] = request.headers["Last-Event-ID"]
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(self.target, headers=headers) as upstream,
            ):
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={"Content-Type": upstream.headers["Content-Type"]},
                )
                await response.prepare(request)
                for text in self.inject:
                    await response.write(text.encode())
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                return response
        finally:
            self._tasks.discard(task)


@contextlib.asynccontextmanager
async def relay_to(server: RunningAuthServer) -> AsyncIterator[Relay]:
    relay = await Relay(server.endpoint("/revocation_events")).start()
    try:
        yield relay
    finally:
        await relay.stop()


# ---------------------------------------------------------------------------- revocation


async def test_a_revoked_access_token_is_refused_within_a_second_while_others_pass(
    start_authserver, http
):
    server = await start_authserver()
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)
        doomed, kept = await machine_token(http, server), await machine_token(http, server)
        assert await status_of(http, gateway, doomed) == 200  # now in the verified-token cache
        assert await status_of(http, gateway, kept) == 200

        await revoke(http, server, doomed)
        await refused_within(http, gateway, doomed, 1.0)

        async with http.get(
            gateway.url + "/orders/1", headers={"Authorization": f"Bearer {doomed}"}
        ) as response:
            assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
            assert "revoked" in response.headers["WWW-Authenticate"]
        assert await status_of(http, gateway, kept) == 200
        samples = await scrape(gateway.admin_url)
        assert sample(samples, EVENTS, issuer=server.url, outcome="applied") == 1
        assert (
            sample(samples, "portcullis_gateway_revocation_stream_synced", issuer=server.url) == 1
        )


async def test_a_revoked_tokens_ecdsa_twin_is_refused_with_it(start_authserver, http):
    # The server signs low S; the twin (r, n - s) verifies as well, and the gateway takes it
    # (issuers sign either spelling) as the same entry of its cache. The deny-set names the
    # token by its jti: revoking the token refuses its twin too.
    server = await start_authserver()
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)
        token = await machine_token(http, server)
        twin = ecdsa_twin(token)
        assert await status_of(http, gateway, token) == 200
        assert await status_of(http, gateway, twin) == 200
        assert len(gateway.gateway.token_cache) == 1
        await revoke(http, server, token)
        await refused_within(http, gateway, token, 1.0)
        assert await status_of(http, gateway, twin) == 401


async def test_refresh_token_reuse_gets_the_newest_access_token_of_the_family_refused(
    start_authserver, http
):
    server = await start_authserver()
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)
        first = await tokens_for(http, server)
        newest = first
        for _ in range(2):  # rotated twice: the first refresh token's successor was used
            status, newest, _ = await post_token(
                http,
                server,
                {
                    "grant_type": "refresh_token",
                    "refresh_token": newest["refresh_token"],
                    "client_id": "spa",
                },
            )
            assert status == 200, newest
        assert await status_of(http, gateway, newest["access_token"]) == 200

        status, body, _ = await post_token(
            http,
            server,
            {
                "grant_type": "refresh_token",
                "refresh_token": first["refresh_token"],
                "client_id": "spa",
            },
        )
        assert status == 400 and body["error"] == "invalid_grant"  # reuse: the family revoked

        await refused_within(http, gateway, newest["access_token"], 1.0)


async def test_a_gateway_started_after_the_revocation_still_refuses_the_token(
    start_authserver, http
):
    server = await start_authserver()
    doomed, kept = await machine_token(http, server), await machine_token(http, server)
    await revoke(http, server, doomed)
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)  # the snapshot of unexpired events came first
        assert await status_of(http, gateway, doomed) == 401
        assert await status_of(http, gateway, kept) == 200


async def test_a_subject_cut_off_refuses_the_users_earlier_tokens_and_not_later_ones(
    start_authserver, http
):
    clock = MovableClock()
    server = await start_authserver(clock=clock)
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)
        alice = [(await tokens_for(http, server))["access_token"] for _ in range(2)]
        jar = aiohttp.CookieJar(unsafe=True)  # cookies of 127.0.0.1; alice signed in `http`
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:
            bob = (await tokens_for(browser, server, username="bob"))["access_token"]
        for token in (*alice, bob):
            assert await status_of(http, gateway, token) == 200

        await server.services.revocations.cut_off_subject(server.subject("alice"))
        for token in alice:
            await refused_within(http, gateway, token, 1.0)
        assert await status_of(http, gateway, bob) == 200

        clock.advance(2)  # past the cut-off's second
        again = (await tokens_for(http, server))["access_token"]
        assert await status_of(http, gateway, again) == 200


async def test_a_client_cut_off_refuses_the_clients_earlier_tokens(start_authserver, http):
    server = await start_authserver()
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)
        machine = await machine_token(http, server)
        user = (await tokens_for(http, server))["access_token"]
        await server.services.revocations.cut_off_client("machine")
        await refused_within(http, gateway, machine, 1.0)
        assert await status_of(http, gateway, user) == 200


async def test_introspected_tokens_are_refused_before_their_cached_answer_expires(
    start_authserver, http
):
    server = await start_authserver()
    async with upstream_and_gateway(server, mode="introspection") as gateway:
        await synced(http, gateway)
        doomed, kept = await machine_token(http, server), await machine_token(http, server)
        assert await status_of(http, gateway, doomed) == 200  # cached for cache_ttl (10s)
        introspector = gateway.gateway.introspectors[server.url]
        assert len(introspector.cache) == 1
        await revoke(http, server, doomed)
        await refused_within(http, gateway, doomed, 1.0)
        assert len(introspector.cache) == 0  # the event evicted the cached answer
        assert await status_of(http, gateway, kept) == 200


async def test_every_worker_of_a_gateway_process_refuses_a_revoked_token(
    start_authserver, http, tmp_path
):
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    gateway = GatewayProcess(
        gateway_config(server.url, upstream.url) + "workers: 2\nshutdown_grace: 1s\n", tmp_path
    )
    try:
        await gateway.wait_ready()
        name = "portcullis_gateway_revocation_stream_synced"
        deadline = time.monotonic() + 10
        while sample(await scrape(gateway.admin_url), name, issuer=server.url) != 1:
            assert time.monotonic() < deadline, gateway.log()
            await asyncio.sleep(0.1)
        doomed = await machine_token(http, server)

        async def statuses() -> set[int]:
            # A new connection each time: the kernel spreads them over the workers.
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as fresh:
                found = set()
                for _ in range(30):
                    async with fresh.get(
                        gateway.url + "/orders/1", headers={"Authorization": f"Bearer {doomed}"}
                    ) as response:
                        found.add(response.status)
                return found

        assert await statuses() == {200}
        await revoke(http, server, doomed)
        answered = time.monotonic()
        while (seen := await statuses()) != {401}:
            assert seen <= {200, 401}, seen
            assert time.monotonic() - answered < 1.0, "a worker still accepts the token"
    finally:
        await gateway.stop()
        await upstream.stop()


async def test_a_reload_keeps_an_unchanged_subscription_and_drops_a_removed_one(
    start_authserver, http, tmp_path
):
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    config = gateway_config(server.url, upstream.url)
    path = tmp_path / "gateway.yaml"
    try:
        async with running_gateway(config, config_file=path) as gateway:
            await synced(http, gateway)
            doomed = await machine_token(http, server)
            await revoke(http, server, doomed)
            await refused_within(http, gateway, doomed, 1.0)
            (stream,) = gateway.gateway.revocations.streams.values()

            assert await gateway.gateway.reload()
            assert list(gateway.gateway.revocations.streams.values()) == [stream]
            assert await status_of(http, gateway, doomed) == 401

            lines = [line for line in config.splitlines() if "revocation_events" not in line]
            path.write_text("\n".join(lines))
            assert await gateway.gateway.reload()
            assert gateway.gateway.revocations.streams == {}
            assert gateway.gateway.pipeline.revocations is None
            await wait_for(lambda: not stream.running, what="the stream closed")
    finally:
        await upstream.stop()


# ---------------------------------------------------------------------------- the stream


async def test_an_interrupted_stream_resumes_from_its_last_event_and_misses_none(
    start_authserver, http
):
    server = await start_authserver()
    async with (
        relay_to(server) as relay,
        upstream_and_gateway(server, f', url: "{relay.url}"') as gateway,
    ):
        await synced(http, gateway)
        first, second, kept = [await machine_token(http, server) for _ in range(3)]
        await revoke(http, server, first)
        await refused_within(http, gateway, first, 1.0)

        relay.down = True
        relay.cut()
        await wait_for(
            lambda: (
                not gateway.gateway.revocations.deny.failing
                and not next(iter(gateway.gateway.revocations.streams.values())).synced
            ),
            what="the stream seen down",
        )
        await revoke(http, server, second)  # while the stream is down
        _, body = await readiness(http, gateway)
        assert body["revocation_events"][server.url]["state"] != "synced"
        assert await status_of(http, gateway, second) == 200  # on_stream_down: serve

        relay.down = False
        await refused_within(http, gateway, second, 15.0)  # after a reconnection's backoff
        assert await status_of(http, gateway, kept) == 200
        assert await status_of(http, gateway, first) == 401
        resumed_from = [value for value in relay.last_event_ids if value is not None]
        assert resumed_from, relay.last_event_ids  # the reconnection said where it was
        assert relay.last_event_ids[0] is None  # the first connection asked for the snapshot


async def test_forged_unsigned_and_mistyped_events_are_ignored_and_counted(start_authserver, http):
    server = await start_authserver()
    victim = await machine_token(http, server)
    header = json.loads(base64.urlsafe_b64decode(victim.split(".")[0] + "=="))
    claims = {
        "iss": server.url,
        "iat": int(time.time()),
        "jti": "900000",
        "events": {
            "https://portcullis.dev/secevent/tokens-revoked": {
                "tokens": [{"jti": json.loads(_payload(victim))["jti"], "exp": 2**33}],
                "reason": "revoked",
            }
        },
    }
    forged = _es256({"alg": "ES256", "typ": "secevent+jwt", "kid": header["kid"]}, claims)
    unsigned = (
        _b64(orjson.dumps({"alg": "none", "typ": "secevent+jwt"}))
        + "."
        + _b64(orjson.dumps(claims))
        + "."
    )
    async with relay_to(server) as relay:
        relay.inject = [
            f"id: 900000\nevent: revocation\ndata: {forged}\n\n",
            f"id: 900001\nevent: revocation\ndata: {unsigned}\n\n",
            # A token the issuer really signed, but an access token (typ at+jwt), not a SET.
            f"id: 900002\nevent: revocation\ndata: {victim}\n\n",
        ]
        async with upstream_and_gateway(server, f', url: "{relay.url}"') as gateway:
            await synced(http, gateway)
            samples = await scrape(gateway.admin_url)
            assert sample(samples, EVENTS, issuer=server.url, outcome="rejected") == 3
            assert sample(samples, EVENTS, issuer=server.url, outcome="applied") == 0
            assert await status_of(http, gateway, victim) == 200
            stream = next(iter(gateway.gateway.revocations.streams.values()))
            assert stream.last_event_id == 0  # no rejected event moved the resume point

            # The real stream still works through the same relay.
            await revoke(http, server, victim)
            await refused_within(http, gateway, victim, 1.0)


async def test_with_on_stream_down_fail_an_issuers_tokens_get_503_after_max_stream_lag(
    start_authserver, http
):
    server = await start_authserver()
    manual = ManualClock()
    token = await machine_token(http, server)
    async with relay_to(server) as relay:
        relay.down = True
        async with upstream_and_gateway(
            server,
            f', url: "{relay.url}", on_stream_down: fail, max_stream_lag: 5s',
            clock=manual.clock,
            wait_ready=False,
        ) as gateway:
            await wait_for(lambda: gateway.gateway.keysets[server.url].loaded, what="keys")
            assert await status_of(http, gateway, token) == 200  # within max_stream_lag
            manual.advance(6)
            await wait_for(lambda: gateway.gateway.revocations.deny.failing, what="failing")
            assert await status_of(http, gateway, token) == 503
            status, body = await readiness(http, gateway)
            assert status == 503
            assert body["revocation_events"][server.url]["state"] == "down"

            relay.down = False
            await synced(http, gateway, timeout=15)
            await wait_for(lambda: not gateway.gateway.revocations.deny.failing, what="served")
            assert await status_of(http, gateway, token) == 200


async def test_the_stream_refuses_clients_that_may_not_introspect(start_authserver, http):
    server = await start_authserver()
    url = server.endpoint("/revocation_events")
    async with http.get(url) as response:
        assert response.status == 401
    async with http.get(url, headers={"Authorization": basic_auth("machine", SECRET)}) as response:
        assert response.status == 403
        assert (await response.json())["error"] == "unauthorized_client"
    async with http.get(
        url, headers={"Authorization": basic_auth("resource-server", SECRET), "Last-Event-ID": "x"}
    ) as response:
        assert response.status == 400


async def test_a_last_event_id_of_non_ascii_digits_is_a_bad_request(start_authserver, http):
    # "²" (U+00B2) is a digit to str.isdigit() but no number to int(): refused as malformed,
    # not a server error (the client sends the header's UTF-8 bytes).
    server = await start_authserver()
    url = server.endpoint("/revocation_events")
    headers = {"Authorization": basic_auth("resource-server", SECRET)}
    async with http.get(url, headers={**headers, "Last-Event-ID": "²"}) as response:
        assert response.status == 400
        assert (await response.json())["error"] == "invalid_request"


async def test_the_stream_sends_signed_sets_with_ids_and_resumes_after_last_event_id(
    start_authserver, http
):
    config = default_config()
    config["revocation_events"] = {"heartbeat": "100ms"}
    server = await start_authserver(config)
    tokens = [await machine_token(http, server) for _ in range(3)]
    for token in tokens:
        await revoke(http, server, token)
    auth = {"Authorization": basic_auth("resource-server", SECRET)}
    events = await _read_events(http, server, auth, until_comments=3)
    assert [e["id"] for e in events] == sorted(e["id"] for e in events) and len(events) == 3
    head = json.loads(base64.urlsafe_b64decode(events[0]["data"].split(".")[0] + "=="))
    assert head["typ"] == "secevent+jwt" and head["alg"] == "ES256"
    claims = json.loads(_payload(events[0]["data"]))
    assert claims["jti"] == events[0]["id"] and claims["iss"] == server.url
    assert "exp" not in claims and "sub" not in claims
    assert json.loads(_payload(tokens[0]))["jti"] in json.dumps(claims["events"])

    resumed = await _read_events(
        http, server, {**auth, "Last-Event-ID": events[0]["id"]}, until_comments=1
    )
    assert [e["id"] for e in resumed] == [e["id"] for e in events[1:]]


async def test_an_event_another_process_writes_to_the_sqlite_file_is_streamed_within_its_poll(
    start_authserver, http
):
    from authserver.store.sqlite import SQLiteStore

    server = await start_authserver()
    token = await machine_token(http, server)
    claims = json.loads(_payload(token))
    async with upstream_and_gateway(server) as gateway:
        await synced(http, gateway)
        # Another process on the same file (the CLI, a second server): it cannot wake this
        # server's streams, which find the event on their next look at the log.
        other = SQLiteStore(server.settings.storage.removeprefix("sqlite://"))
        await other.open()
        try:
            await other.revoke_access_token(claims["jti"], claims["exp"], time.time())
        finally:
            await other.close()
        await refused_within(http, gateway, token, 2.0)  # poll_interval 1s, then delivery


# ---------------------------------------------------------------------------- PostgreSQL


async def test_an_event_recorded_through_one_replica_reaches_a_subscriber_of_another(
    start_authserver, http
):
    from tests.authserver.postgres_support import fresh_schema, postgres_url_or_skip

    url = await postgres_url_or_skip()
    async with fresh_schema(url) as schema:
        storage = f"{url}?search_path={schema}"
        config = default_config()
        config["storage"] = storage
        # Neither the poll of the log nor a heartbeat comes within the test: only
        # LISTEN/NOTIFY can wake the stream of replica B for an event replica A records.
        config["revocation_events"] = {"poll_interval": "1h", "heartbeat": "1h"}
        replica_a = await start_authserver(config)
        replica_b = await start_authserver(config)
        token = await machine_token(http, replica_a)
        jti = json.loads(_payload(token))["jti"]
        auth = {"Authorization": basic_auth("resource-server", SECRET)}
        subscribed = asyncio.Event()

        async def first_event() -> dict[str, str]:
            (event,) = await _read_events(
                http, replica_b, auth, until_events=1, subscribed=subscribed
            )
            return event

        reading = asyncio.create_task(first_event())
        await asyncio.wait_for(subscribed.wait(), 10)  # the (empty) snapshot sent
        await revoke(http, replica_a, token)
        event = await asyncio.wait_for(reading, 10)
        assert jti in _payload(event["data"])
        await replica_a.stop()
        await replica_b.stop()


# ---------------------------------------------------------------------------- helpers


async def _read_events(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    headers: dict[str, str],
    *,
    until_comments: int | None = None,
    until_events: int | None = None,
    subscribed: asyncio.Event | None = None,
) -> list[dict[str, str]]:
    """The events of the stream until so many comments or events; `subscribed` is set at
    the first comment, which follows the snapshot."""
    events: list[dict[str, str]] = []
    comments = 0
    current: dict[str, str] = {}
    async with http.get(server.endpoint("/revocation_events"), headers=headers) as response:
        assert response.status == 200, await response.text()
        assert response.content_type == "text/event-stream"
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                comments += 1
                if subscribed is not None:
                    subscribed.set()
            elif line == "":
                if current:
                    events.append(current)
                    current = {}
            else:
                name, _, value = line.partition(": ")
                current[name] = value
            if until_comments is not None and comments >= until_comments:
                break
            if until_events is not None and len(events) >= until_events:
                break
    return events


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _payload(token: str) -> str:
    part = token.split(".")[1]
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode()


def _es256(header: dict[str, Any], claims: dict[str, Any]) -> str:
    """A SET signed with a key of our own under the issuer's kid."""
    key = ec.generate_private_key(ec.SECP256R1())
    signing_input = _b64(orjson.dumps(header)) + "." + _b64(orjson.dumps(claims))
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return signing_input + "." + _b64(r.to_bytes(32, "big") + s.to_bytes(32, "big"))


async def test_an_event_rejected_for_an_unknown_key_is_not_skipped_by_the_next_one(
    start_authserver, http
):
    # The stream's keys cannot be fetched at first: the snapshot's event is rejected for an
    # unknown key. Once the keys load, the next event must not move the resume point past
    # the rejected one, which would leave its token accepted until it expires.
    server = await start_authserver()
    state = {"down": True}

    async def jwks(_: web.Request) -> web.Response:
        if state["down"]:
            return web.Response(status=503)
        async with http.get(server.endpoint("/jwks")) as response:
            return web.Response(body=await response.read(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/jwks", jwks)
    runner, base = await start_site(app)
    try:
        first, second, kept = [await machine_token(http, server) for _ in range(3)]
        await revoke(http, server, first)  # in the snapshot the gateway is sent
        upstream = await EchoUpstream().start()
        config = gateway_config(server.url, upstream.url).replace(
            "    algorithms: [ES256]\n", f'    algorithms: [ES256]\n    jwks_uri: "{base}/jwks"\n'
        )
        config += "\njwks: {refetch_cooldown: 0s, max_backoff: 200ms}\n"
        try:
            async with running_gateway(config, wait_ready=False) as gateway:
                stream = await _only_stream(gateway)
                await wait_for(lambda: stream.rejected >= 1, what="the first event rejected")
                state["down"] = False
                await wait_for(lambda: stream.keys.loaded, what="the stream's keys loaded")
                await revoke(http, server, second)
                await wait_for(lambda: stream.applied >= 1, what="an event applied")
                await refused_within(http, gateway, second, 5.0)
                await refused_within(http, gateway, first, 5.0)
                assert await status_of(http, gateway, kept) == 200
        finally:
            await upstream.stop()
    finally:
        await runner.cleanup()


async def _only_stream(gateway: RunningGateway) -> Any:
    streams = gateway.gateway.revocations.streams
    await wait_for(lambda: len(streams) == 1, what="the stream configured")
    return next(iter(streams.values()))


async def test_a_reload_that_remakes_a_failing_stream_keeps_its_issuers_tokens_refused(
    start_authserver, http, tmp_path
):
    # A stream made again by a reload (its settings changed) has not synced either: its lag
    # goes on from the last sync, not from the reload, or the tokens refused for a stream
    # down would pass again for max_stream_lag.
    server = await start_authserver()
    manual = ManualClock()
    token = await machine_token(http, server)
    path = tmp_path / "gateway.yaml"
    async with relay_to(server) as relay:
        relay.down = True
        events = f', url: "{relay.url}", on_stream_down: fail, max_stream_lag: 5s'
        async with upstream_and_gateway(
            server, events, clock=manual.clock, wait_ready=False, config_file=path
        ) as gateway:
            revocations = gateway.gateway.revocations
            await wait_for(lambda: gateway.gateway.keysets[server.url].loaded, what="keys")
            manual.advance(6)
            await wait_for(lambda: revocations.deny.failing, what="failing")
            assert await status_of(http, gateway, token) == 503
            (before,) = revocations.streams.values()

            path.write_text(path.read_text().replace("max_stream_lag: 5s", "max_stream_lag: 4s"))
            assert await gateway.gateway.reload()
            (after,) = revocations.streams.values()
            assert after is not before
            revocations.refresh()
            assert revocations.deny.failing
            assert await status_of(http, gateway, token) == 503
