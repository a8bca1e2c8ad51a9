"""Hot reload: on SIGHUP and when the file changes, the new config is validated and swapped
in whole; an invalid one is refused with its FILE:LINE problems and the old one keeps
serving; requests in flight finish on the config they started with; key sets and
introspection caches of an issuer that stays are kept.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import aiohttp

from gateway.verifiers.cache import token_key
from tests.support import (
    EchoUpstream,
    GatewayProcess,
    IntrospectionServer,
    call,
    gateway_yaml,
    header_values,
    issuer_entry,
    running_gateway,
    sample,
    scrape,
)

WATCH = "reload: {watch: true, interval: 20ms}"


async def eventually(check, timeout: float = 5.0, what: str = "condition") -> None:
    """Until the async `check()` is true; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_changed_file_applies_to_new_requests_while_in_flight_ones_finish_on_the_old(
    client, tmp_path
):
    """A request waiting on its token's introspection when the file changes is still
    forwarded as the old config says: old upstream (and its connection pool), old header
    names. Requests after the swap take the new config."""
    server = await IntrospectionServer().start()
    server.active("opaque-1")
    server.delay = 0.5
    old_upstream, new_upstream = await EchoUpstream().start(), await EchoUpstream().start()
    path = tmp_path / "gateway.yaml"
    section = "{client_id: gateway, client_secret: gateway-secret}"
    entry = issuer_entry(server.url, mode="introspection", introspection=section)

    def config(upstream: str, extra: str = "") -> str:
        return gateway_yaml(server.url, upstream, issuers=[entry], extra=WATCH + "\n" + extra)

    try:
        async with running_gateway(config(old_upstream.url), config_file=path) as gateway:
            waiting = asyncio.create_task(call(client, gateway.url + "/orders/1", "opaque-1"))
            while server.in_flight == 0:
                await asyncio.sleep(0.01)
            # While it waits: a new upstream with a new pool, and new identity header names.
            new_upstream_config = config(
                new_upstream.url, "identity_headers: {subject: X-User, scopes: X-Roles}"
            ).replace("read_timeout: 2s", "read_timeout: 2s, max_connections: 8")
            path.write_text(new_upstream_config)

            async def reloaded() -> bool:
                return gateway.gateway.settings.upstream.url == new_upstream.url

            await eventually(reloaded, what="the reload")
            assert not waiting.done()
            finished = await waiting
            fresh = await call(client, gateway.url + "/orders/2", "opaque-1")
    finally:
        await server.stop()
        await old_upstream.stop()
        await new_upstream.stop()
    assert (finished.status, fresh.status) == (200, 200)
    assert [r["raw_path"] for r in old_upstream.requests] == ["/orders/1"]
    in_flight = old_upstream.requests[0]
    assert header_values(in_flight, "X-Auth-Subject") == ["user-123"]
    assert header_values(in_flight, "X-User") == []
    assert [r["raw_path"] for r in new_upstream.requests] == ["/orders/2"]
    assert header_values(new_upstream.requests[0], "X-User") == ["user-123"]
    assert header_values(new_upstream.requests[0], "X-Roles") == ["orders:read"]
    assert header_values(new_upstream.requests[0], "X-Auth-Subject") == []
    assert len(server.calls) == 1  # the introspection cache outlived the reload


async def test_a_cached_jwt_gets_the_identity_header_names_of_the_config_in_force(
    issuer, upstream, client, tmp_path
):
    """The forwarder remembers each principal's identity headers; a reload brings a new
    forwarder, so the same token's next request carries the new names, and only those."""
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url, extra=WATCH)
    token = issuer.token("ES256", email="alice@example.com")
    async with running_gateway(text, config_file=path) as gateway:
        before = await call(client, gateway.url + "/orders/1", token)
        path.write_text(text + "identity_headers: {subject: X-User, claims: {X-Mail: email}}\n")

        async def reloaded() -> bool:
            return gateway.gateway.settings.identity_headers.subject == "X-User"

        await eventually(reloaded, what="the reload")
        after = await call(client, gateway.url + "/orders/2", token)
    assert (before.status, after.status) == (200, 200)
    first, second = upstream.requests
    assert header_values(first, "X-Auth-Subject") == ["user-123"]
    assert header_values(first, "X-Mail") == []
    assert header_values(second, "X-User") == ["user-123"]
    assert header_values(second, "X-Mail") == ["alice@example.com"]
    assert header_values(second, "X-Auth-Subject") == []
    assert header_values(second, "X-Auth-Scopes") == ["orders:read"]


async def test_an_invalid_file_is_refused_with_its_problems_and_the_old_config_keeps_serving(
    issuer, upstream, client, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="portcullis.gateway")
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url, extra=WATCH)
    token = issuer.token("ES256")
    async with running_gateway(text, config_file=path) as gateway:
        slow = asyncio.create_task(call(client, gateway.url + "/_slow/0.3", token))
        await asyncio.sleep(0.05)
        broken = text.replace("read_timeout: 2s", "read_timeout: soon").replace(
            "name: upload,", "name: upload, colour: red,"
        )
        path.write_text(broken)

        async def rejected() -> bool:
            samples = await scrape(gateway.admin_url)
            return sample(samples, "portcullis_gateway_config_reloads_total", result="rejected") > 0

        await eventually(rejected, what="the rejection")
        still = await call(client, gateway.url + "/orders/1", token)
        no_token = await call(client, gateway.url + "/orders/1")
        finished = await slow
        samples = await scrape(gateway.admin_url)
    assert (finished.status, still.status, no_token.status) == (200, 200, 401)
    lines = broken.splitlines()
    timeout_line = next(n for n, ln in enumerate(lines, 1) if "read_timeout: soon" in ln)
    colour_line = next(n for n, ln in enumerate(lines, 1) if "colour: red" in ln)
    messages = [r.getMessage() for r in caplog.records if r.name == "portcullis.gateway"]
    assert (
        f"{path}:{timeout_line}: upstream.read_timeout: 'soon' is not a duration "
        "(write it like 30s, 5m, 250ms, 2h or 14d)"
    ) in messages
    assert any(
        m.startswith(f"{path}:{colour_line}: route 'upload': unknown key 'colour'")
        for m in messages
    )
    assert "config reload rejected; the previous configuration keeps serving" in messages
    assert sample(samples, "portcullis_gateway_config_reloads_total", result="applied") == 0


async def test_key_sets_and_verified_tokens_of_an_issuer_that_stays_survive_a_reload(
    issuer, upstream, client, tmp_path
):
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url, extra=WATCH)
    token = issuer.token("ES256")
    async with running_gateway(text, config_file=path) as gateway:
        assert (await call(client, gateway.url + "/orders/1", token)).status == 200
        keyset = gateway.gateway.keysets[issuer.url]
        fetches = issuer.jwks_fetches
        # Another route and another realm: the issuer's settings are untouched.
        path.write_text(
            text.replace(
                "routes:\n", 'realm: "changed"\nroutes:\n  - {name: extra, path: "/extra/**"}\n', 1
            )
        )

        async def reloaded() -> bool:
            return gateway.gateway.settings.realm == "changed"

        await eventually(reloaded, what="the reload")
        hits = gateway.gateway.token_cache.hits
        again = await call(client, gateway.url + "/orders/1", token)
        other = await call(client, gateway.url + "/extra/1", issuer.token("ES256"))
        kept = gateway.gateway.keysets[issuer.url]
        cache_hits = gateway.gateway.token_cache.hits - hits
    assert (again.status, other.status) == (200, 200)
    assert kept is keyset
    assert issuer.jwks_fetches == fetches  # no refetch: the keys stayed in memory
    assert cache_hits == 1  # the token verified before the reload was still trusted


async def test_a_changed_issuer_gets_new_keys_and_its_verified_tokens_are_dropped(
    issuer, upstream, client, tmp_path
):
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url, extra=WATCH)
    es256 = issuer.token("ES256")
    async with running_gateway(text, config_file=path) as gateway:
        assert (await call(client, gateway.url + "/orders/1", es256)).status == 200
        path.write_text(text.replace("algorithms: [ES256, RS256, EdDSA]", "algorithms: [RS256]"))

        async def reloaded() -> bool:
            return gateway.gateway.settings.issuers[0].algorithms == ("RS256",)

        await eventually(reloaded, what="the reload")
        refused = await call(client, gateway.url + "/orders/1", es256)
        rs256 = await call(client, gateway.url + "/orders/1", issuer.token("RS256"))
    # The cached ES256 token is not trusted any more: the issuer no longer accepts ES256.
    assert refused.status == 401
    assert rs256.status == 200


async def test_the_introspection_cache_of_an_issuer_that_stays_survives_a_reload(
    upstream, client, tmp_path
):
    server = await IntrospectionServer().start()
    server.active("opaque-1")
    section = "{client_id: gateway, client_secret: gateway-secret, cache_ttl: 10s}"
    entry = issuer_entry(server.url, mode="introspection", introspection=section)
    text = gateway_yaml(server.url, upstream.url, issuers=[entry], extra=WATCH)
    path = tmp_path / "gateway.yaml"
    try:
        async with running_gateway(text, config_file=path) as gateway:
            assert (await call(client, gateway.url + "/orders/1", "opaque-1")).status == 200
            path.write_text(text.replace("routes:\n", 'realm: "changed"\nroutes:\n', 1))

            async def reloaded() -> bool:
                return gateway.gateway.settings.realm == "changed"

            await eventually(reloaded, what="the reload")
            again = await call(client, gateway.url + "/orders/1", "opaque-1")
    finally:
        await server.stop()
    assert again.status == 200
    assert len(server.calls) == 1  # answered from the kept cache


async def test_sighup_reloads_a_running_process_and_a_broken_file_leaves_it_serving(
    issuer, upstream, tmp_path
):
    process = GatewayProcess(
        gateway_yaml(issuer.url, upstream.url, extra="reload: {watch: false}"), tmp_path
    )
    text = process.config.read_text()  # with the ports the process listens on
    try:
        await process.wait_ready()
        async with aiohttp.ClientSession() as session:

            async def status(path: str) -> int:
                async with session.get(process.url + path) as response:
                    await response.read()
                    return response.status

            assert await status("/open/1") == 401  # the catch-all route wants a token
            opened = text.replace(
                "routes:\n", 'routes:\n  - {name: open, path: "/open/**", auth: none}\n', 1
            )
            process.config.write_text(opened)
            await asyncio.sleep(0.1)
            assert await status("/open/1") == 401  # the file alone changes nothing: watch is off
            process.signal(signal.SIGHUP)

            async def opened_up() -> bool:
                return await status("/open/1") == 200

            await eventually(opened_up, what="the SIGHUP reload")
            broken = opened + "workers: many\n"
            process.config.write_text(broken)
            process.signal(signal.SIGHUP)

            async def refused() -> bool:
                return "config reload rejected" in process.log()

            await eventually(refused, what="the rejection")
            assert await status("/open/1") == 200  # still the last good config
            assert process.process.poll() is None
    finally:
        await process.stop()
    line = len(broken.splitlines())
    assert f"{process.config}:{line}: config.workers: expected an integer" in process.log()


async def test_sighup_to_the_supervisor_reloads_every_worker(issuer, upstream, tmp_path):
    process = GatewayProcess(
        gateway_yaml(issuer.url, upstream.url, extra="workers: 2\nreload: {watch: false}"),
        tmp_path,
    )
    text = process.config.read_text()  # with the ports the process listens on
    try:
        await process.wait_ready()
        process.config.write_text(
            text.replace(
                "routes:\n", 'routes:\n  - {name: open, path: "/open/**", auth: none}\n', 1
            )
        )
        process.signal(signal.SIGHUP)

        async def statuses() -> list[int]:
            found = []
            for _ in range(24):  # a new connection each: the kernel spreads them over workers
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(process.url + "/open/1") as response,
                ):
                    found.append(response.status)
            return found

        async def all_reloaded() -> bool:
            return set(await statuses()) == {200}

        await eventually(all_reloaded, timeout=10, what="every worker's reload")
        assert process.process.poll() is None  # SIGHUP did not end the supervisor
    finally:
        await process.stop()


async def test_a_reload_that_turns_the_token_cache_off_empties_it_at_once(
    issuer, upstream, client, tmp_path
):
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url, extra=WATCH)
    token = issuer.token("ES256")
    async with running_gateway(text, config_file=path) as gateway:
        assert (await call(client, gateway.url + "/orders/1", token)).status == 200
        cache = gateway.gateway.token_cache
        assert len(cache) == 1
        path.write_text(text.replace("routes:\n", "token_cache_size: 0\nroutes:\n", 1))

        async def reloaded() -> bool:
            return gateway.gateway.settings.token_cache_size == 0

        await eventually(reloaded, what="the reload")
        assert len(cache) == 0  # not served from memory until the token expires
        hits = cache.hits
        assert (await call(client, gateway.url + "/orders/1", token)).status == 200
        assert (cache.hits, len(cache)) == (hits, 0)


async def test_a_verdict_of_a_replaced_configuration_is_not_kept_after_a_reload(
    issuer, upstream, client, tmp_path
):
    # A request that started before the reload finishes verifying on the old pipeline (a key
    # fetch can hold it for seconds); the new configuration may refuse what it accepts.
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url, extra=WATCH)
    async with running_gateway(text, config_file=path) as gateway:
        old_verifier = gateway.gateway.pipeline.verifier
        path.write_text(text.replace("routes:\n", 'realm: "changed"\nroutes:\n', 1))

        async def reloaded() -> bool:
            return gateway.gateway.settings.realm == "changed"

        await eventually(reloaded, what="the reload")
        late = issuer.token("ES256", sub="verified-by-the-old-configuration")
        principal = await old_verifier.verify(late)
        assert principal.subject == "verified-by-the-old-configuration"
        assert gateway.gateway.token_cache.get(token_key(late)) is None
        # The configuration in force still caches its own verdicts.
        fresh = issuer.token("ES256", sub="verified-by-the-new-configuration")
        assert (await call(client, gateway.url + "/orders/1", fresh)).status == 200
        assert gateway.gateway.token_cache.get(token_key(fresh)) is not None
