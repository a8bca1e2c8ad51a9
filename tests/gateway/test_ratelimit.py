"""Rate limits with the in-memory backend: token buckets per key, a default and per-route
policies, the pre-authentication limit per client address, trusted proxies, the 429 answer
with Retry-After and the RateLimit fields, and a backend that stays bounded.

The bucket arithmetic is also checked directly against a clock the test moves.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.settings import LimitRule
from gateway.steps.ratelimit import MemoryBuckets, Policy
from portcullis.addresses import ClientAddresses
from portcullis.yamlconf import rate
from tests.hypothesis_profiles import examples
from tests.support import (
    Answer,
    ManualClock,
    TestIssuer,
    assert_invalid_token,
    call,
    gateway_yaml,
    header_values,
    issuer_entry,
    running_gateway,
)


class Clock:
    """Time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(spec: str = "2/s", burst: int = 4, key: str = "route", name: str = "p") -> Policy:
    return Policy(name, LimitRule(rate(spec), burst, key), ClientAddresses(()))


# ---------------------------------------------------------------------------- buckets


def test_a_bucket_allows_its_burst_then_refuses_until_a_token_is_back():
    clock = Clock()
    buckets = MemoryBuckets(100, clock)
    p = policy("2/s", burst=3)
    verdicts = [buckets.take_now(p, "k") for _ in range(4)]
    assert [v.allowed for v in verdicts] == [True, True, True, False]
    assert [v.remaining for v in verdicts] == [2, 1, 0, 0]
    assert verdicts[3].retry_after == 0.5  # one token at 2/s
    assert verdicts[3].reset == 1.5  # three tokens at 2/s
    clock.now += 0.5
    assert buckets.take_now(p, "k").allowed
    assert not buckets.take_now(p, "k").allowed


def test_a_bucket_never_holds_more_than_its_burst_however_long_it_rests():
    clock = Clock()
    buckets = MemoryBuckets(100, clock)
    p = policy("10/s", burst=2)
    buckets.take_now(p, "k")
    clock.now += 3600
    assert [buckets.take_now(p, "k").allowed for _ in range(3)] == [True, True, False]


def test_keys_and_policies_have_separate_buckets():
    buckets = MemoryBuckets(100, Clock())
    a, b = policy(burst=1, name="a"), policy(burst=1, name="b")
    assert buckets.take_now(a, "k").allowed
    assert not buckets.take_now(a, "k").allowed
    assert buckets.take_now(a, "other").allowed
    assert buckets.take_now(b, "k").allowed


def test_buckets_that_filled_up_again_are_dropped_as_new_keys_arrive():
    clock = Clock()
    buckets = MemoryBuckets(1000, clock)
    p = policy("10/s", burst=5)
    for n in range(50):
        buckets.take_now(p, f"old-{n}")
    assert len(buckets) == 50
    clock.now += 1.0  # every old bucket is full again: it holds nothing a new one would not
    for n in range(30):
        buckets.take_now(p, f"new-{n}")
    assert len(buckets) == 30
    clock.now += 1.0
    buckets.sweep()
    assert len(buckets) == 0


def test_a_flood_of_distinct_keys_never_grows_the_buckets_past_max_keys():
    buckets = MemoryBuckets(100, Clock())  # the clock stands still: nothing refills
    p = policy("1/h", burst=5)
    for n in range(10_000):
        buckets.take_now(p, f"key-{n}")
        assert len(buckets) <= 100
    assert len(buckets) == 100


@settings(max_examples=examples(60), deadline=None)
@given(
    per_second=st.floats(min_value=0.5, max_value=50),
    burst=st.integers(min_value=1, max_value=20),
    gaps=st.lists(st.floats(min_value=0, max_value=0.5), min_size=1, max_size=200),
)
def test_no_sequence_of_requests_gets_more_than_burst_plus_what_was_refilled(
    per_second, burst, gaps
):
    clock = Clock()
    buckets = MemoryBuckets(10, clock)
    p = Policy("p", LimitRule(rate(f"{per_second}/s"), burst, "route"), ClientAddresses(()))
    start = clock.now
    allowed = 0
    for gap in gaps:
        clock.now += gap
        verdict = buckets.take_now(p, "k")
        allowed += verdict.allowed
        if not verdict.allowed:
            assert verdict.retry_after > 0
        assert allowed <= burst + (clock.now - start) * per_second + 1e-9
    # A client that waits as long as a refusal said is let through.
    while (verdict := buckets.take_now(p, "k")).allowed:
        pass
    clock.now += verdict.retry_after + 1e-6
    assert buckets.take_now(p, "k").allowed


# ---------------------------------------------------------------------------- through the gateway

LIMITED = """
  - {name: limited, path: "/limited/**", rate_limit: {rate: 1/m, burst: 3, key: subject}}
  - {name: unlimited, path: "/unlimited/**", rate_limit: false}
"""


def limited_config(issuer: str, upstream: str, routes: str = LIMITED, extra: str = "") -> str:
    return gateway_yaml(issuer, upstream, extra_routes=routes, extra=extra)


def assert_rate_limited(answer: Answer, retry_after: int, policy_header: str, limit: str) -> None:
    """429 with Retry-After, the RateLimit fields and the resource error body."""
    assert answer.status == 429, answer.body
    assert answer.headers["Retry-After"] == str(retry_after)
    assert answer.headers.getall("RateLimit-Policy") == [policy_header]
    assert answer.headers.getall("RateLimit") == [limit]
    assert "WWW-Authenticate" not in answer.headers
    seconds = "second" if retry_after == 1 else "seconds"
    assert answer.body == {
        "error": {
            "code": "rate_limited",
            "message": f"Too many requests; try again in {retry_after} {seconds}.",
            "details": [],
        }
    }


async def test_requests_past_the_burst_get_429_with_retry_after_and_ratelimit_fields(
    issuer, upstream, client
):
    token = issuer.token("ES256")
    clock = ManualClock()  # no token comes back between the requests, however slow they are
    text = limited_config(issuer.url, upstream.url)
    async with running_gateway(text, clock=clock.clock) as gateway:
        answers = [await call(client, gateway.url + "/limited/x", token) for _ in range(4)]
    assert [a.status for a in answers[:3]] == [200, 200, 200]
    # Accepted answers carry the remaining quota too (draft-ietf-httpapi-ratelimit-headers-10).
    assert [a.headers.getall("RateLimit") for a in answers[:3]] == [
        ['"limited";r=2;t=60'],
        ['"limited";r=1;t=120'],
        ['"limited";r=0;t=180'],
    ]
    assert {a.headers["RateLimit-Policy"] for a in answers[:3]} == {'"limited";q=3;w=180'}
    assert_rate_limited(answers[3], 60, '"limited";q=3;w=180', '"limited";r=0;t=180')
    assert len(upstream.requests) == 3


async def test_each_subject_has_its_own_bucket(issuer, upstream, client):
    alice, bob = issuer.token("ES256", sub="alice"), issuer.token("ES256", sub="bob")
    async with running_gateway(limited_config(issuer.url, upstream.url)) as gateway:
        for _ in range(3):
            assert (await call(client, gateway.url + "/limited/x", alice)).status == 200
        assert (await call(client, gateway.url + "/limited/x", alice)).status == 429
        # Another token of the same subject shares the bucket; another subject does not.
        again = await call(client, gateway.url + "/limited/x", issuer.token("ES256", sub="alice"))
        assert again.status == 429
        assert (await call(client, gateway.url + "/limited/x", bob)).status == 200


@pytest.mark.parametrize("key", ["subject", "client_id", "claim:email"])
async def test_the_same_subject_or_client_at_two_issuers_has_two_buckets(upstream, client, key):
    """RFC 7519 §4.1.2: `sub` is unique only within its issuer (and a client_id within its
    authorization server): one issuer's alice must not spend another's."""
    issuers = [TestIssuer(), TestIssuer()]
    for server in issuers:
        server.add_key("ES256")
        await server.start()
    try:
        routes = (
            f'  - {{name: limited, path: "/limited/**", rate_limit: {{rate: 1/m, burst: 1,'
            f" key: {key}}}}}\n"
        )
        config = gateway_yaml(
            issuers[0].url,
            upstream.url,
            extra_routes=routes,
            issuers=[issuer_entry(server.url) for server in issuers],
        )
        first, second = (
            s.token("ES256", sub="alice", client_id="webapp", email="alice@example.com")
            for s in issuers
        )
        async with running_gateway(config) as gateway:
            url = gateway.url + "/limited/x"
            statuses = [
                (await call(client, url, first)).status,
                (await call(client, url, second)).status,
                (await call(client, url, first)).status,
                (await call(client, url, second)).status,
            ]
        assert statuses == [200, 200, 429, 429]
    finally:
        for server in issuers:
            await server.stop()


async def test_the_default_limit_applies_where_a_route_sets_none_and_false_turns_it_off(
    issuer, upstream, client
):
    extra = "rate_limits: {default: {rate: 1/m, burst: 1, key: route}}"
    token = issuer.token("ES256")
    async with running_gateway(limited_config(issuer.url, upstream.url, extra=extra)) as gateway:
        first = await call(client, gateway.url + "/orders/1", token)
        second = await call(client, gateway.url + "/orders/2", token)
        free = [await call(client, gateway.url + "/unlimited/x", token) for _ in range(3)]
    assert first.status == 200
    assert first.headers["RateLimit-Policy"] == '"orders-read";q=1;w=60'
    assert_rate_limited(second, 60, '"orders-read";q=1;w=60', '"orders-read";r=0;t=60')
    assert [a.status for a in free] == [200, 200, 200]
    assert all("RateLimit" not in a.headers for a in free)


async def test_a_public_route_is_limited_by_client_address_under_an_identity_keyed_default(
    issuer, upstream, client
):
    extra = "rate_limits: {default: {rate: 1/m, burst: 2, key: subject}}"
    async with running_gateway(limited_config(issuer.url, upstream.url, extra=extra)) as gateway:
        answers = [await call(client, gateway.url + "/public/x") for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 429]


async def test_rate_limit_fields_can_be_left_out_of_answers(issuer, upstream, client):
    extra = "rate_limits: {headers: false}"
    token = issuer.token("ES256")
    async with running_gateway(limited_config(issuer.url, upstream.url, extra=extra)) as gateway:
        answers = [await call(client, gateway.url + "/limited/x", token) for _ in range(4)]
    assert [a.status for a in answers] == [200, 200, 200, 429]
    assert all("RateLimit" not in a.headers for a in answers)
    assert all("RateLimit-Policy" not in a.headers for a in answers)
    assert answers[3].headers["Retry-After"] == "60"


async def get_with(client, url, token=None, **headers: str) -> int:
    sent = dict(headers)
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    async with client.get(url, headers=sent) as response:
        await response.read()
        return response.status


async def test_keys_by_client_id_header_claim_ip_and_route_share_buckets_as_named(
    issuer, upstream, client
):
    routes = """
  - {name: by-client, path: "/c/**", rate_limit: {rate: 1/m, burst: 1, key: client_id}}
  - {name: by-header, path: "/h/**", rate_limit: {rate: 1/m, burst: 1, key: "header:X-Api-Key"}}
  - {name: by-claim, path: "/t/**", rate_limit: {rate: 1/m, burst: 1, key: "claim:tenant"}}
  - {name: by-ip, path: "/i/**", rate_limit: {rate: 1/m, burst: 1, key: ip}}
  - {name: by-route, path: "/r/**", rate_limit: {rate: 1/m, burst: 1, key: route}}
"""
    web_a = issuer.token("ES256", sub="a", client_id="web", tenant="acme")
    web_b = issuer.token("ES256", sub="b", client_id="web", tenant="globex")
    cli_c = issuer.token("ES256", sub="c", client_id="cli", tenant="acme")
    async with running_gateway(limited_config(issuer.url, upstream.url, routes)) as gateway:
        url = gateway.url
        by_client = [
            await get_with(client, url + "/c/1", web_a),
            await get_with(client, url + "/c/1", web_b),  # same client: refused
            await get_with(client, url + "/c/1", cli_c),
        ]
        by_header = [
            await get_with(client, url + "/h/1", web_a, **{"X-Api-Key": "k1"}),
            await get_with(client, url + "/h/1", web_b, **{"X-Api-Key": "k1"}),  # refused
            await get_with(client, url + "/h/1", web_a, **{"X-Api-Key": "k2"}),
        ]
        by_claim = [
            await get_with(client, url + "/t/1", web_a),
            await get_with(client, url + "/t/1", cli_c),  # same tenant: refused
            await get_with(client, url + "/t/1", web_b),
        ]
        by_ip = [await get_with(client, url + "/i/1", t) for t in (web_a, web_b)]
        by_route = [
            await get_with(client, url + "/r/1", web_a),
            await get_with(client, url + "/r/2", cli_c),  # anyone, same route: refused
        ]
    assert by_client == [200, 429, 200]
    assert by_header == [200, 429, 200]
    assert by_claim == [200, 429, 200]
    assert by_ip == [200, 429]
    assert by_route == [200, 429]


async def test_the_client_address_comes_from_x_forwarded_for_only_through_trusted_proxies(
    issuer, upstream, client
):
    routes = (
        '  - {name: by-ip, path: "/i/**", auth: none, rate_limit: {rate: 1/m, burst: 1, key: ip}}\n'
    )
    trusted = "trusted_proxies: [127.0.0.1/32, 10.0.0.0/8]"
    async with running_gateway(
        limited_config(issuer.url, upstream.url, routes, extra=trusted)
    ) as gateway:
        url = gateway.url + "/i/1"
        through_proxies = [
            await get_with(client, url, **{"X-Forwarded-For": "203.0.113.7"}),
            await get_with(client, url, **{"X-Forwarded-For": "203.0.113.8"}),
            # A trusted proxy (10.1.1.1) in the chain: the client is the hop before it.
            await get_with(client, url, **{"X-Forwarded-For": "203.0.113.7, 10.1.1.1"}),
            # What the client wrote itself, left of an untrusted hop, is not believed.
            await get_with(client, url, **{"X-Forwarded-For": "198.51.100.1, 203.0.113.8"}),
        ]
    assert through_proxies == [200, 200, 429, 429]
    async with running_gateway(limited_config(issuer.url, upstream.url, routes)) as gateway:
        url = gateway.url + "/i/1"
        untrusted = [
            await get_with(client, url, **{"X-Forwarded-For": "203.0.113.7"}),
            await get_with(client, url, **{"X-Forwarded-For": "203.0.113.8"}),
        ]
    assert untrusted == [200, 429]  # without trusted proxies the header changes nothing


async def test_the_pre_auth_limit_stops_floods_of_unverifiable_tokens_but_not_cached_ones(
    issuer, upstream, client
):
    extra = "rate_limits: {pre_auth: {rate: 1/m, burst: 2}}"
    valid = issuer.token("ES256")
    async with running_gateway(limited_config(issuer.url, upstream.url, extra=extra)) as gateway:
        url = gateway.url + "/orders/1"
        first = await call(client, url, valid)  # verified once: counted
        garbage = [await call(client, url, f"garbage-{n}") for n in range(3)]
        cached = [await call(client, url, valid) for _ in range(3)]  # in the cache: free
    assert first.status == 200
    assert_invalid_token(garbage[0], "the token is not a signed JWT")
    assert_rate_limited(garbage[1], 60, '"pre_auth";q=2;w=120', '"pre_auth";r=0;t=120')
    assert garbage[2].status == 429
    assert [a.status for a in cached] == [200, 200, 200]
    assert len(upstream.requests) == 4


async def test_the_memory_backend_stays_bounded_under_a_flood_of_distinct_keys(
    issuer, upstream, client
):
    routes = (
        '  - {name: keyed, path: "/k/**", auth: none,'
        ' rate_limit: {rate: 1/h, burst: 1, key: "header:X-Key"}}\n'
    )
    extra = "rate_limits: {max_keys: 50}"
    async with running_gateway(
        limited_config(issuer.url, upstream.url, routes, extra=extra)
    ) as gateway:
        statuses = await asyncio.gather(
            *(get_with(client, gateway.url + "/k/1", **{"X-Key": f"v{n}"}) for n in range(300))
        )
        held = len(gateway.gateway.rate_limit_buckets)
    assert statuses == [200] * 300  # every key is new: each has its full burst
    assert held <= 50


async def test_a_zero_or_negative_retry_is_never_advertised(issuer, upstream, client):
    routes = '  - {name: fast, path: "/f/**", rate_limit: {rate: 100/s, burst: 1, key: route}}\n'
    token = issuer.token("ES256")
    clock = ManualClock()
    text = limited_config(issuer.url, upstream.url, routes)
    async with running_gateway(text, clock=clock.clock) as gateway:
        answers = await asyncio.gather(
            *(call(client, gateway.url + "/f/1", token) for _ in range(10))
        )
        clock.advance(0.0099)
        answers.append(await call(client, gateway.url + "/f/1", token))
        clock.advance(0.0002)
        again = await call(client, gateway.url + "/f/1", token)
    assert again.status == 200  # the token is back after 10 ms
    refused = [a for a in answers if a.status == 429]
    assert len(refused) == 10, [a.status for a in answers]
    # 10 ms to the next token is still "1": Retry-After counts whole seconds, at least one.
    assert {a.headers["Retry-After"] for a in refused} == {"1"}
    assert all(a.headers["RateLimit"] == '"fast";r=0;t=1' for a in refused)


async def test_identity_headers_and_rate_limit_fields_reach_the_client_not_the_upstream(
    issuer, upstream, client
):
    token = issuer.token("ES256")
    async with running_gateway(limited_config(issuer.url, upstream.url)) as gateway:
        answer = await call(client, gateway.url + "/limited/x", token)
    assert answer.status == 200
    seen = upstream.requests[-1]
    assert header_values(seen, "RateLimit") == []
    assert header_values(seen, "X-Auth-Subject") == ["user-123"]
