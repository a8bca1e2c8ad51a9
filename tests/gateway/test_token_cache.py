"""The verified-token cache, seen through the running gateway: hits skip verification, entries
end with the token's expiry, the cache is bounded, and it holds digests rather than tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.core.exchange import Exchange
from gateway.core.principal import Principal
from gateway.steps.pipeline import REMEMBERED_AUTHORIZATION_CHARS, Admitted, LastToken
from gateway.verifiers.cache import TokenCache
from tests.support import (
    Answer,
    ManualClock,
    RunningGateway,
    assert_invalid_token,
    call,
    gateway_yaml,
    header_values,
    issuer_entry,
    running_gateway,
)


async def orders(
    client: aiohttp.ClientSession, gateway: RunningGateway, token: str, path: str = "/orders/1"
) -> Answer:
    return await call(client, gateway.url + path, token)


def cache_of(gateway: RunningGateway) -> TokenCache:
    return gateway.gateway.token_cache


async def test_second_request_with_the_same_token_is_not_verified_again(
    gateway, issuer, upstream, client
):
    cache = cache_of(gateway)
    token = issuer.token("ES256", sub="cached-user")
    first = await orders(client, gateway, token)
    assert first.status == 200
    assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)

    second = await orders(client, gateway, token)
    assert second.status == 200
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    # The cached principal carries the same identity upstream.
    assert header_values(second.body, "X-Auth-Subject") == ["cached-user"]
    assert len(upstream.requests) == 2

    other = await orders(client, gateway, issuer.token("ES256"))
    assert other.status == 200
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)


async def test_cached_token_is_refused_once_it_expires(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, issuers=[issuer_entry(issuer.url, leeway="0s")])
    clock = ManualClock()
    async with running_gateway(config, clock=clock.clock) as gateway:
        cache = cache_of(gateway)
        token = issuer.token("ES256", exp=clock.wall + 60, iat=clock.wall)
        assert (await orders(client, gateway, token)).status == 200
        clock.advance(59.9)
        assert (await orders(client, gateway, token)).status == 200
        assert cache.hits == 1

        clock.advance(0.2)
        assert_invalid_token(await orders(client, gateway, token), "the token has expired")
        assert cache.hits == 1, "an expired entry must not be served"
        assert len(cache) == 0
        assert len(upstream.requests) == 2


async def test_cache_holds_at_most_token_cache_size_entries(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 5")
    async with running_gateway(config) as gateway:
        cache = cache_of(gateway)
        tokens = [issuer.token("ES256", sub=f"user-{i}") for i in range(20)]
        for token in tokens:
            assert (await orders(client, gateway, token)).status == 200
        assert len(cache) == 5
        assert cache.misses == 20

        # The most recent five are held; an older one was evicted and is verified again.
        for token in tokens[-5:]:
            assert (await orders(client, gateway, token)).status == 200
        assert cache.hits == 5
        assert (await orders(client, gateway, tokens[0])).status == 200
        assert (cache.hits, cache.misses, len(cache)) == (5, 21, 5)


async def test_cache_is_keyed_by_sha256_digests_and_holds_no_token(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 5")
    async with running_gateway(config) as gateway:
        tokens = [issuer.token("RS256", sub=f"user-{i}") for i in range(8)]
        for token in tokens:
            assert (await orders(client, gateway, token)).status == 200
        keys = cache_of(gateway).keys()
        assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
        # Least recently used first: exactly the digests of the last five tokens, in order.
        assert keys == tuple(hashlib.sha256(t.encode()).digest() for t in tokens[-5:])


async def test_refused_tokens_are_not_cached(gateway, issuer, upstream, client):
    cache = cache_of(gateway)
    token = issuer.token("ES256", aud="nobody", drop=("sub",))
    for _ in range(3):
        assert_invalid_token(await orders(client, gateway, token), "the token has no subject")
    assert (cache.hits, cache.misses, len(cache)) == (0, 3, 0)
    assert upstream.requests == []


async def test_cached_token_is_still_held_to_each_routes_audience(issuer, upstream, client):
    """The cache remembers that a token is genuine, not where it may be used."""
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        extra_routes='  - {name: billing, path: "/billing/**", audience: billing-api}',
    )
    async with running_gateway(config) as gateway:
        cache = cache_of(gateway)
        token = issuer.token("ES256")  # aud: orders-api
        assert (await orders(client, gateway, token)).status == 200
        answer = await orders(client, gateway, token, "/billing/1")
        assert_invalid_token(answer, "the token is not meant for this API (audience)")
        assert cache.hits == 1
        assert len(upstream.requests) == 1


async def test_zero_token_cache_size_verifies_every_request(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 0")
    async with running_gateway(config) as gateway:
        cache = cache_of(gateway)
        token = issuer.token("EdDSA")
        for _ in range(3):
            assert (await orders(client, gateway, token)).status == 200
        assert (cache.hits, cache.misses, len(cache)) == (0, 3, 0)


def test_a_cache_of_zero_entries_is_off_and_one_resized_to_zero_is_emptied():
    cache = TokenCache(0)
    assert cache.off
    cache.count_miss()
    assert (cache.hits, cache.misses, len(cache)) == (0, 1, 0)
    cache.resize(2)
    assert not cache.off
    principal = Principal("https://issuer", "u", None, frozenset(), (), 2e9, {})
    cache.put(b"k", principal, 2e9)
    assert cache.get(b"k") is principal
    cache.resize(0)
    assert cache.off
    assert len(cache) == 0


async def test_a_cached_token_still_goes_through_every_header_rule(
    gateway, issuer, upstream, client
):
    token = issuer.token("ES256")
    assert (await orders(client, gateway, token)).status == 200
    forwarded = len(upstream.requests)
    # Twice in two headers: refused even though the token itself is cached.
    twice = [("Authorization", f"Bearer {token}"), ("Authorization", f"Bearer {token}")]
    async with client.get(gateway.url + "/orders/1", headers=twice) as response:
        assert response.status == 400
        assert 'error="invalid_request"' in response.headers["WWW-Authenticate"]
    # Other spellings of the scheme still reach the same principal through full parsing.
    for header in (f"bearer {token}", f"Bearer   {token}", f"BEARER {token}"):
        async with client.get(
            gateway.url + "/orders/1", headers={"Authorization": header}
        ) as response:
            assert response.status == 200
    # Trailing junk after a cached token is not the cached token.
    async with client.get(
        gateway.url + "/orders/1", headers={"Authorization": f"Bearer {token} x"}
    ) as response:
        assert response.status == 400
    assert len(upstream.requests) == forwarded + 3


# ---------------------------------------------------------------------------- one connection
# A connection remembers the cache key of the Authorization value it sent last (LastToken):
# the cache itself is still asked on every request.


def one_connection() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))


async def test_tokens_alternating_on_one_connection_each_carry_their_own_identity(
    gateway, issuer, upstream
):
    cache = cache_of(gateway)
    first = issuer.token("ES256", sub="first-user")
    second = issuer.token("ES256", sub="second-user")
    async with one_connection() as client:
        for round_ in range(3):
            for token, subject in ((first, "first"), (second, "second"), (first, "first")):
                answer = await orders(client, gateway, token)
                assert answer.status == 200
                assert header_values(answer.body, "X-Auth-Subject") == [f"{subject}-user"], round_
        # The one connection remembers the value it sent last.
        remembered = [
            connection.last_token.credentials
            for runner in gateway.runners
            for connection in getattr(runner.server, "connections", ())
            if hasattr(connection, "last_token")
        ]
        assert remembered == [("Bearer", first)]
    assert (cache.hits, cache.misses) == (7, 2)
    assert len(upstream.requests) == 9


async def test_a_remembered_token_evicted_from_the_cache_is_verified_again(issuer, upstream):
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 1")
    async with (
        running_gateway(config) as gateway,
        one_connection() as mine,
        one_connection() as other,
    ):
        cache = cache_of(gateway)
        token = issuer.token("ES256", sub="kept")
        for _ in range(3):
            assert (await orders(mine, gateway, token)).status == 200
        assert (cache.hits, cache.misses) == (2, 1)
        # Another connection's token takes the cache's one place.
        assert (await orders(other, gateway, issuer.token("ES256"))).status == 200
        answer = await orders(mine, gateway, token)
        assert answer.status == 200
        assert header_values(answer.body, "X-Auth-Subject") == ["kept"]
        assert (cache.hits, cache.misses) == (2, 3), "the evicted token must be verified again"


async def test_a_remembered_token_is_refused_once_it_expires(issuer, upstream):
    config = gateway_yaml(issuer.url, upstream.url, issuers=[issuer_entry(issuer.url, leeway="0s")])
    clock = ManualClock()
    async with running_gateway(config, clock=clock.clock) as gateway, one_connection() as client:
        token = issuer.token("ES256", exp=clock.wall + 60, iat=clock.wall)
        for _ in range(3):
            assert (await orders(client, gateway, token)).status == 200
        clock.advance(60.1)
        assert_invalid_token(await orders(client, gateway, token), "the token has expired")
        assert len(upstream.requests) == 3


async def test_a_remembered_token_meets_the_rules_of_its_scheme_spelling(gateway, issuer, upstream):
    """The value remembered is the exact header value: a different spelling of the same
    token is parsed in full again, and malformed values are refused on the same connection."""
    token = issuer.token("ES256", sub="spelt")
    async with one_connection() as client:
        assert (await orders(client, gateway, token)).status == 200
        assert (await orders(client, gateway, token)).status == 200
        for header, status in (
            (f"bearer {token}", 200),
            (f"Bearer {token} x", 400),
            (f"Bearer {token}", 200),
            (f"DPoP {token}", 401),
            (f"Bearer {token}", 200),
        ):
            async with client.get(
                gateway.url + "/orders/1", headers={"Authorization": header}
            ) as response:
                await response.read()
                assert response.status == status, header


async def test_only_authorization_values_up_to_the_bound_are_remembered(gateway, issuer):
    pipeline = gateway.gateway.pipeline
    short = issuer.token("ES256")
    long = issuer.token("ES256", padding="x" * REMEMBERED_AUTHORIZATION_CHARS)
    for token in (short, long):
        async with aiohttp.ClientSession() as client:
            assert (await orders(client, gateway, token)).status == 200  # now cached
    last = LastToken()
    for token, remembered in ((short, True), (long, False)):
        headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {token}"}))
        found = pipeline.cached(headers, last)
        assert found is not None and found[1].token == token
        assert (last.recall(f"Bearer {token}") is not None) is remembered
    # The short one stays remembered, and its hit gives the same principal as a full look.
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {short}"}))
    assert pipeline.cached(headers, last) == pipeline.cached(headers)


async def test_tokens_of_the_same_length_on_one_connection_are_told_apart(
    gateway, issuer, upstream
):
    """The remembered value is compared as a whole: a token as long as the last one, sharing
    its start (the same header and most claims), is not taken for it."""
    tokens = [issuer.token("ES256", sub=f"user-{c}", jti="j") for c in "abab"]
    assert len({len(t) for t in tokens}) == 1
    async with one_connection() as client:
        for token, subject in zip(tokens, ("user-a", "user-b", "user-a", "user-b"), strict=True):
            for _ in range(2):
                answer = await orders(client, gateway, token)
                assert answer.status == 200
                assert header_values(answer.body, "X-Auth-Subject") == [subject]


# A connection remembers the Authorization value it sent last and its token's cache key
# (LastToken), nothing of what was decided for it: every request of that value is decided
# anew, on its own route, by the configuration of the moment.


async def test_a_remembered_decision_holds_for_its_own_route_only(gateway, issuer, upstream):
    reader = issuer.token("ES256", sub="reader", scope="orders:read")
    async with one_connection() as client:
        for _ in range(2):
            assert (await orders(client, gateway, reader)).status == 200
        # orders-write needs orders:write too: the decision on orders-read does not carry over.
        async with client.put(
            gateway.url + "/orders/1", headers={"Authorization": f"Bearer {reader}"}, data=b"x"
        ) as response:
            await response.read()
            assert response.status == 403
        assert (await orders(client, gateway, reader)).status == 200
        assert len(upstream.requests) == 3


async def test_a_remembered_decision_is_not_kept_across_a_reload(issuer, upstream, tmp_path):
    config = tmp_path / "gateway.yaml"
    reader = issuer.token("ES256", sub="reader", scope="orders:read")
    async with (
        running_gateway(gateway_yaml(issuer.url, upstream.url), config_file=config) as gateway,
        one_connection() as client,
    ):
        for _ in range(2):
            assert (await orders(client, gateway, reader)).status == 200
        # The route now needs a scope the token lacks: the next request on the same
        # connection is decided by the new configuration.
        config.write_text(
            gateway_yaml(issuer.url, upstream.url).replace(
                '"orders:read", "orders:admin"', '"orders:admin"'
            )
        )
        assert await gateway.gateway.reload()
        answer = await orders(client, gateway, reader)
        assert answer.status == 403
        assert len(upstream.requests) == 2


async def test_a_bearer_decision_does_not_admit_the_token_sent_as_dpop(gateway, issuer, upstream):
    """RFC 9449 §7.1: the DPoP scheme is for bound tokens. A token allowed as Bearer on this
    connection and route is still refused when it comes as DPoP."""
    token = issuer.token("ES256", sub="unbound")
    async with one_connection() as client:
        for _ in range(2):
            assert (await orders(client, gateway, token)).status == 200
        async with client.get(
            gateway.url + "/orders/1", headers={"Authorization": f"DPoP {token}"}
        ) as response:
            await response.read()
            assert response.status == 401
        assert (await orders(client, gateway, token)).status == 200


async def test_a_bearer_decision_is_not_remembered_for_a_dpop_value(gateway, issuer, upstream):
    """A token whose `DPoP` value is short enough to be remembered and whose `Bearer` value is
    not: once the connection remembers the DPoP value, allowing the Bearer one must not let
    the DPoP value through without its proof."""
    token = ""
    for size in range(2500, 2800):
        token = issuer.token("ES256", sub="edge", padding="x" * size)
        if len(token) in (REMEMBERED_AUTHORIZATION_CHARS - 6, REMEMBERED_AUTHORIZATION_CHARS - 5):
            break
    assert len(f"DPoP {token}") <= REMEMBERED_AUTHORIZATION_CHARS < len(f"Bearer {token}")

    async def as_dpop() -> int:
        async with client.get(
            gateway.url + "/orders/1", headers={"Authorization": f"DPoP {token}"}
        ) as response:
            await response.read()
            return response.status

    async with one_connection() as client:
        assert (await orders(client, gateway, token)).status == 200  # verified and cached
        assert await as_dpop() == 401  # remembered, and refused: no proof, no binding
        for _ in range(2):
            assert (await orders(client, gateway, token)).status == 200
            assert await as_dpop() == 401
    assert len(upstream.requests) == 3


async def test_a_request_of_a_remembered_value_counts_one_cache_hit(gateway, issuer):
    """After another token on the same connection (its value now the one remembered, with
    its principal), a request of the first token is one look in the cache, one hit."""
    cache = cache_of(gateway)
    first = issuer.token("ES256", sub="first", scope="orders:read")
    second = issuer.token("ES256", sub="second", scope="orders:read")
    async with one_connection() as client:
        for token in (first, first, second, first, first, second, second):
            assert (await orders(client, gateway, token)).status == 200
    assert (cache.hits, cache.misses) == (5, 2)


async def test_a_token_verified_anew_counts_one_cache_hit_and_is_decided_anew(issuer, upstream):
    """Another connection evicts the token from a cache of one entry and has it verified
    again: the connection that remembers it gets a new principal from the cache for the same
    value, which is one hit, decided in full, and then remembered."""
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 1")
    async with (
        running_gateway(config) as gateway,
        one_connection() as mine,
        one_connection() as other,
    ):
        cache = cache_of(gateway)
        token = issuer.token("ES256", sub="kept", scope="orders:read")
        for _ in range(3):
            assert (await orders(mine, gateway, token)).status == 200
        assert (cache.hits, cache.misses) == (2, 1)
        assert (await orders(other, gateway, issuer.token("ES256"))).status == 200
        assert (await orders(other, gateway, token)).status == 200
        assert (cache.hits, cache.misses) == (2, 3)
        for hits in (3, 4):
            answer = await orders(mine, gateway, token)
            assert answer.status == 200
            assert header_values(answer.body, "X-Auth-Subject") == ["kept"]
            assert cache.hits == hits


async def test_admit_remembers_a_value_and_its_cache_key_and_decides_every_request(gateway, issuer):
    pipeline = gateway.gateway.pipeline
    reader = issuer.token("ES256", sub="memo", scope="orders:read")
    headers = {"Authorization": f"Bearer {reader}"}
    last = LastToken()

    def admit(method: str) -> Any:
        request = make_mocked_request(method, "/orders/1", headers=headers)
        return pipeline.admit(request, Exchange(0.0, "id", method, "/orders/1"), last)

    first = await admit("GET")  # verified, and cached from now on
    assert isinstance(first, Admitted) and first.principal is not None
    assert last.credentials is None, "an empty cache is not searched, and nothing remembered"
    allowed = await admit("GET")
    assert isinstance(allowed, Admitted) and allowed.principal is first.principal
    assert last.credentials == ("Bearer", reader) and last.recall(f"Bearer {reader}") is not None
    assert last.key == hashlib.sha256(reader.encode()).digest()
    refused = await admit("PUT")  # orders-write: the token lacks orders:write
    assert getattr(refused, "status", None) == 403
    again = await admit("GET")
    assert isinstance(again, Admitted) and again.principal is allowed.principal
    assert not hasattr(last, "plan") and not hasattr(last, "principal")
