"""The per-issuer key sets: discovery, refresh, rotation, throttled refetch, stale-if-error,
readiness, and key sets with entries that must be skipped. Through the running gateway and
a real issuer on 127.0.0.1; `jwks_fetches` and `requests` are what the issuer really served.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given
from hypothesis import strategies as st
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from gateway.settings import JwksSettings
from gateway.verifiers.jwks import MIN_REFETCH_GAP, cache_lifetime, discovery_urls
from tests.support import (
    Answer,
    EchoUpstream,
    ManualClock,
    RunningGateway,
    TestIssuer,
    assert_invalid_token,
    assert_unavailable,
    b64url,
    call,
    gateway_yaml,
    issuer_entry,
    public_jwk,
    running_gateway,
    wait_for,
)

UNKNOWN_KEY = "the token is signed with an unknown key"
OIDC = "GET /.well-known/openid-configuration"
RFC8414 = "GET /.well-known/oauth-authorization-server"
JWKS = "GET /jwks"


def config(issuer: TestIssuer, upstream: EchoUpstream, jwks: str, **issuer_options: str) -> str:
    return gateway_yaml(
        issuer.url,
        upstream.url,
        issuers=[issuer_entry(issuer.url, **issuer_options)],
        jwks=jwks,
    )


async def orders(client: aiohttp.ClientSession, gateway: RunningGateway, token: str) -> Answer:
    return await call(client, gateway.url + "/orders/1", token)


async def readyz(client: aiohttp.ClientSession, gateway: RunningGateway) -> Answer:
    return await call(client, gateway.admin_url + "/readyz")


def keyset(gateway: RunningGateway, issuer: TestIssuer) -> Any:
    return gateway.gateway.keysets[issuer.url]


# ---------------------------------------------------------------------------- discovery


async def test_keys_are_found_through_openid_connect_discovery(gateway, issuer, client):
    assert issuer.requests == [OIDC, JWKS]
    assert (await orders(client, gateway, issuer.token("ES256"))).status == 200


async def test_rfc8414_metadata_is_used_when_openid_discovery_answers_404(issuer, upstream, client):
    issuer.oidc_discovery = False
    async with running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway:
        assert issuer.requests == [OIDC, RFC8414, JWKS]
        assert (await orders(client, gateway, issuer.token("RS256"))).status == 200


async def test_configured_jwks_uri_skips_discovery(issuer, upstream, client):
    text = config(issuer, upstream, "{}", jwks_uri=f'"{issuer.url}/jwks"')
    async with running_gateway(text) as gateway:
        assert issuer.requests == [JWKS]
        assert (await orders(client, gateway, issuer.token("EdDSA"))).status == 200


async def test_discovery_naming_another_issuer_is_not_trusted(issuer, upstream, client):
    """RFC 8414 §3.3: metadata must name the issuer it was fetched for (mix-up defence)."""
    issuer.metadata_overrides = {"issuer": "https://impostor.example"}
    text = config(issuer, upstream, "{max_backoff: 100ms}")
    async with running_gateway(text, wait_ready=False) as gateway:
        await wait_for(lambda: keyset(gateway, issuer).failures >= 1, what="a failed discovery")
        ready = await readyz(client, gateway)
        assert ready.status == 503
        assert "names another issuer" in ready.body["reasons"][issuer.url]
        assert JWKS not in issuer.requests
        assert_unavailable(await orders(client, gateway, issuer.token("ES256")))


def test_discovery_urls_follow_oidc_then_rfc8414_path_insertion():
    assert discovery_urls("https://auth.example.com/tenant/") == [
        "https://auth.example.com/tenant/.well-known/openid-configuration",
        "https://auth.example.com/.well-known/oauth-authorization-server/tenant",
    ]
    assert discovery_urls("https://auth.example.com") == [
        "https://auth.example.com/.well-known/openid-configuration",
        "https://auth.example.com/.well-known/oauth-authorization-server",
    ]


# ---------------------------------------------------------------------------- rotation


async def test_key_added_by_rotation_is_fetched_once_the_cooldown_has_passed(
    issuer, upstream, client
):
    clock = ManualClock()
    text = config(issuer, upstream, "{refetch_cooldown: 300ms}")
    async with running_gateway(text, clock=clock.clock) as gateway:
        old = issuer.key("ES256")
        new = issuer.add_key("ES256")
        old.published = False
        token = issuer.token("ES256", key=new)
        # Right after the start-up load (within the gap any fetch imposes, here the 300 ms
        # cool-down, being shorter than MIN_REFETCH_GAP), an unknown kid does not fetch.
        assert_invalid_token(await orders(client, gateway, token), UNKNOWN_KEY)
        assert issuer.jwks_fetches == 1
        clock.advance(0.31)
        answer = await orders(client, gateway, token)
        assert answer.status == 200, answer.body
        assert issuer.jwks_fetches == 2
        # The retired key is gone from the refreshed set.
        assert_invalid_token(
            await orders(client, gateway, issuer.token("ES256", key=old)), UNKNOWN_KEY
        )
        assert len(upstream.requests) == 1


async def test_key_rotated_in_after_the_start_up_load_is_fetched_within_the_cooldown(
    issuer, upstream, client
):
    """The cool-down limits refetches for unknown kids, not the first one after a load: an
    issuer that starts signing with a key it had not published is followed at once (after
    the short gap any fetch imposes), not 30 s later."""
    clock = ManualClock()
    text = config(issuer, upstream, "{refetch_cooldown: 30s}")
    async with running_gateway(text, clock=clock.clock) as gateway:
        assert issuer.jwks_fetches == 1
        old = issuer.key("ES256")
        new = issuer.add_key("ES256")
        old.published = False
        token = issuer.token("ES256", key=new)
        clock.advance(MIN_REFETCH_GAP.total_seconds() - 0.01)
        assert_invalid_token(await orders(client, gateway, token), UNKNOWN_KEY)
        assert issuer.jwks_fetches == 1
        clock.advance(0.02)
        answer = await orders(client, gateway, token)
        assert answer.status == 200, answer.body
        assert issuer.jwks_fetches == 2
        # Further unknown kids within the cool-down of that refetch do not fetch again.
        clock.advance(29.97)
        newer = issuer.add_key("ES256")
        token = issuer.token("ES256", key=newer)
        assert_invalid_token(await orders(client, gateway, token), UNKNOWN_KEY)
        assert issuer.jwks_fetches == 2
        clock.advance(0.04)  # the cool-down is over
        assert (await orders(client, gateway, token)).status == 200
        assert issuer.jwks_fetches == 3
        assert len(upstream.requests) == 2


async def test_a_scheduled_refresh_does_not_start_the_cooldown_of_unknown_kids(
    issuer, upstream, client
):
    clock = ManualClock()
    text = config(issuer, upstream, "{refetch_cooldown: 30s}")
    async with running_gateway(text, clock=clock.clock) as gateway:
        keys = keyset(gateway, issuer)
        clock.advance(MIN_REFETCH_GAP.total_seconds() + 0.01)
        assert await keys.refresh()  # what the refresh schedule runs
        assert issuer.jwks_fetches == 2
        new = issuer.add_key("EdDSA")
        clock.advance(MIN_REFETCH_GAP.total_seconds() + 0.01)
        answer = await orders(client, gateway, issuer.token("EdDSA", key=new))
        assert answer.status == 200, answer.body
        assert issuer.jwks_fetches == 3


async def test_requests_arriving_during_a_fetch_wait_for_it_and_share_it(issuer, upstream, client):
    clock = ManualClock()
    text = config(issuer, upstream, "{refetch_cooldown: 500ms}")
    async with running_gateway(text, clock=clock.clock) as gateway:
        clock.advance(0.51)
        new = issuer.add_key("ES256")
        issuer.jwks_delay = 0.3
        tokens = [issuer.token("ES256", key=new, sub=f"user-{i}") for i in range(50)]
        first = asyncio.create_task(orders(client, gateway, tokens[0]))
        # The others arrive once the fetch has reached the issuer: inside the cool-down, so
        # only joining the fetch in flight can give them the new key.
        await wait_for(lambda: issuer.jwks_fetches == 2, what="the refetch to start")
        others = await asyncio.gather(*(orders(client, gateway, t) for t in tokens[1:]))
        answers = [await first, *others]
        assert [a.status for a in answers] == [200] * 50
        assert issuer.jwks_fetches == 2
        assert len(upstream.requests) == 50


async def test_flood_of_unknown_kids_fetches_at_most_once_per_cooldown(issuer, upstream, client):
    cooldown = 1.0
    text = config(issuer, upstream, f"{{refetch_cooldown: {int(cooldown * 1000)}ms}}")
    stranger = issuer.add_key("ES256", published=False)

    def flood() -> list[str]:
        return [
            issuer.token("ES256", key=stranger, headers={"kid": uuid.uuid4().hex})
            for _ in range(50)
        ]

    async def send(tokens: list[str]) -> None:
        answers = await asyncio.gather(*(orders(client, gateway, t) for t in tokens))
        for answer in answers:
            assert_invalid_token(answer, UNKNOWN_KEY)

    clock = ManualClock()
    async with running_gateway(text, clock=clock.clock) as gateway:
        assert issuer.jwks_fetches == 1
        batch = flood()
        await send(batch)  # within the gap after the start-up load (cool-down = the gap)
        assert issuer.jwks_fetches == 1

        clock.advance(cooldown + 0.01)
        issuer.jwks_delay = 0.1  # later requests join the fetch in flight
        batch = flood()
        await send(batch)
        assert issuer.jwks_fetches == 2
        issuer.jwks_delay = 0
        batch = flood()
        await send(batch)
        assert issuer.jwks_fetches == 2

        clock.advance(cooldown - 0.02)
        await send(flood())
        assert issuer.jwks_fetches == 2
        clock.advance(0.03)
        batch = flood()
        await send(batch)
        assert issuer.jwks_fetches == 3
    assert upstream.requests == []


# ---------------------------------------------------------------------------- failures


FAST_REFRESH = "{min_ttl: 100ms, max_ttl: 100ms, max_backoff: 100ms, refetch_cooldown: 30s}"


async def test_failing_jwks_endpoint_keeps_serving_the_last_good_keys(issuer, upstream, client):
    async with running_gateway(config(issuer, upstream, FAST_REFRESH)) as gateway:
        keys = keyset(gateway, issuer)
        assert keys.failures == 0
        issuer.jwks_status = 500
        await wait_for(lambda: keys.failures >= 2, what="two failed refreshes")
        assert "answered 500" in keys.last_error
        for alg in ("ES256", "RS256", "EdDSA"):
            assert (await orders(client, gateway, issuer.token(alg))).status == 200
        # Stale keys still verify, so the gateway stays ready.
        assert (await readyz(client, gateway)).status == 200

        issuer.jwks_status = 200
        await wait_for(lambda: keys.last_error is None, what="recovery")
        failures, fetches = keys.failures, issuer.jwks_fetches
        await wait_for(lambda: issuer.jwks_fetches >= fetches + 2, what="further refreshes")
        assert keys.failures == failures


async def test_stopped_issuer_keeps_serving_the_last_good_keys(issuer, upstream, client):
    async with running_gateway(config(issuer, upstream, FAST_REFRESH)) as gateway:
        keys = keyset(gateway, issuer)
        port = issuer.port
        await issuer.stop(keep_port=True)
        await wait_for(lambda: keys.failures >= 2, what="two failed refreshes")
        assert "discovery failed" in keys.last_error
        assert (await orders(client, gateway, issuer.token("ES256"))).status == 200
        assert (await readyz(client, gateway)).status == 200

        # Back on the same address with a new key: the gateway rediscovers and reloads.
        issuer.add_key("ES256", kid="after-restart")
        await issuer.start(port)
        await wait_for(lambda: keys.last_error is None, what="recovery")
        answer = await orders(client, gateway, issuer.token("ES256", key=issuer.keys[-1]))
        assert answer.status == 200, answer.body


async def test_gateway_is_not_ready_until_the_first_key_set_loads(issuer, upstream, client):
    issuer.jwks_status = 503
    text = config(issuer, upstream, "{max_backoff: 100ms}")
    async with running_gateway(text, wait_ready=False) as gateway:
        keys = keyset(gateway, issuer)
        await wait_for(lambda: keys.failures >= 2, what="retries")
        ready = await readyz(client, gateway)
        assert ready.status == 503
        assert ready.body["status"] == "not_ready"
        assert ready.body["reasons"] == {issuer.url: f"{issuer.url}/jwks answered 503"}

        for _ in range(3):
            assert_unavailable(await orders(client, gateway, issuer.token("ES256")))
        assert upstream.requests == []

        issuer.jwks_status = 200
        await wait_for(lambda: keys.loaded, what="the key set to load")
        ready = await readyz(client, gateway)
        assert (ready.status, ready.body) == (200, {"status": "ready"})
        assert (await orders(client, gateway, issuer.token("ES256"))).status == 200
        assert len(upstream.requests) == 1


async def test_gateway_becomes_ready_when_an_unreachable_issuer_comes_up(upstream, client):
    issuer = TestIssuer()
    issuer.add_key("ES256")
    await issuer.start()
    port = issuer.port
    await issuer.stop(keep_port=True)
    try:
        text = config(issuer, upstream, "{max_backoff: 100ms}")
        async with running_gateway(text, wait_ready=False) as gateway:
            keys = keyset(gateway, issuer)
            await wait_for(lambda: keys.failures >= 2, what="retries")
            ready = await readyz(client, gateway)
            assert ready.status == 503
            assert "unreachable" in ready.body["reasons"][issuer.url]
            assert_unavailable(await orders(client, gateway, issuer.token("ES256")))

            await issuer.start(port)
            await wait_for(lambda: keys.loaded, what="the key set to load")
            assert (await readyz(client, gateway)).status == 200
            assert (await orders(client, gateway, issuer.token("ES256"))).status == 200
    finally:
        await issuer.stop()


# ---------------------------------------------------------------------------- cache lifetime


def _settings(low: float, high: float) -> JwksSettings:
    return JwksSettings(min_ttl=timedelta(seconds=low), max_ttl=timedelta(seconds=high))


@pytest.mark.parametrize(
    ("cache_control", "expected"),
    [
        ("max-age=600", 600),
        ("public, max-age=600", 600),
        ("MAX-AGE=600, must-revalidate", 600),
        ('max-age="600"', 600),
        ("max-age = 600", 600),
        ("max-age=0", 60),
        ("max-age=5", 60),
        ("max-age=999999999", 3600),
        ("max-age=99999999999999999999999999", 3600),
        ("s-maxage=600", 60),
        ("no-cache", 60),
        ("max-age=abc", 60),
        ("", 60),
        (None, 60),
    ],
)
def test_cache_lifetime_is_max_age_clamped_to_the_bounds(cache_control, expected):
    assert cache_lifetime(cache_control, _settings(60, 3600)) == expected


@given(
    header=st.text(max_size=60),
    low=st.floats(0, 1000, allow_nan=False),
    span=st.floats(0, 100_000, allow_nan=False),
)
def test_cache_lifetime_is_always_within_the_bounds(header, low, span):
    settings = _settings(low, low + span)
    lifetime = cache_lifetime(header, settings)
    assert settings.min_ttl.total_seconds() <= lifetime <= settings.max_ttl.total_seconds()


@given(age=st.integers(0, 10**7), low=st.integers(0, 10**4), span=st.integers(0, 10**6))
def test_cache_lifetime_honours_any_max_age_inside_the_bounds(age, low, span):
    expected = min(max(age, low), low + span)
    assert cache_lifetime(f"private, max-age={age}", _settings(low, low + span)) == expected


async def test_max_age_zero_refreshes_in_the_background_every_min_ttl(issuer, upstream, client):
    issuer.jwks_cache_control = "max-age=0"
    started = time.monotonic()
    async with running_gateway(config(issuer, upstream, "{min_ttl: 200ms}")) as gateway:
        await wait_for(lambda: issuer.jwks_fetches >= 3, what="background refreshes")
        elapsed = time.monotonic() - started
        # Clamped up to min_ttl, not a refresh loop: at most one fetch per 200 ms.
        assert issuer.jwks_fetches <= elapsed / 0.2 + 1
        new = issuer.add_key("EdDSA")
        await wait_for(lambda: keyset(gateway, issuer).knows(new.kid), what="the new key")
        assert (await orders(client, gateway, issuer.token("EdDSA", key=new))).status == 200
    assert issuer.requests.count(OIDC) == 1  # discovery once; only the key set is refreshed


@pytest.mark.parametrize(
    ("jwks", "status"),
    [("{min_ttl: 0s}", 200), ("{max_backoff: 0s}", 500)],
    ids=["refresh", "retry"],
)
async def test_zero_durations_do_not_turn_refreshes_into_a_loop(
    issuer, upstream, client, jwks, status
):
    issuer.jwks_cache_control = "max-age=0"
    issuer.jwks_status = status
    started = time.monotonic()
    async with running_gateway(config(issuer, upstream, jwks), wait_ready=False):
        await wait_for(lambda: issuer.jwks_fetches >= 3, what="scheduled fetches")
        await asyncio.sleep(0.1)  # room for a loop to show itself
        elapsed = time.monotonic() - started
        fetches = issuer.jwks_fetches
    # A floor of 50 ms between scheduled fetches, whatever the configuration says.
    assert fetches <= elapsed / 0.05 + 1


async def test_long_max_age_is_clamped_to_max_ttl(issuer, upstream, client):
    issuer.jwks_cache_control = "max-age=86400"
    clock = ManualClock()
    text = config(issuer, upstream, "{min_ttl: 100ms, max_ttl: 10m}")
    async with running_gateway(text, clock=clock.clock):
        for fetches in (2, 3):
            clock.advance(timedelta(minutes=10).total_seconds() + 0.01)
            await wait_for(lambda n=fetches: issuer.jwks_fetches >= n, what="the refresh")


async def test_max_age_between_the_bounds_decides_the_next_refresh(issuer, upstream, client):
    """The refresh is scheduled on the gateway's clock: moved by hand here, it comes exactly
    when max-age says, neither sooner (min_ttl) nor later (max_ttl)."""
    issuer.jwks_cache_control = "max-age=120"
    clock = ManualClock()
    text = config(issuer, upstream, "{min_ttl: 100ms, max_ttl: 1h}")
    async with running_gateway(text, clock=clock.clock):
        clock.advance(119.9)
        for _ in range(20):
            await asyncio.sleep(0)  # the refresher's turns: it must not fetch yet
        assert issuer.jwks_fetches == 1
        clock.advance(0.2)
        await wait_for(lambda: issuer.jwks_fetches >= 2, what="the refresh")


# ---------------------------------------------------------------------------- parsing


@functools.cache
def _spare_rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _rsa_public(name: str, **members: Any) -> dict[str, Any]:
    """A valid RSA public JWK (of a key nobody signs with) with members changed."""
    jwk = public_jwk(_spare_rsa_key(), name, "RS256")
    jwk.update(members)
    return {k: v for k, v in jwk.items() if v is not None}


def _junk_entries() -> list[Any]:
    return [
        "not an object",
        42,
        None,
        [],
        {},
        {"kty": "oct", "k": b64url(b"a shared secret"), "kid": "oct"},
        {"kty": "oct", "k": b64url(b"a shared secret"), "kid": "oct-hs", "alg": "HS256"},
        {"kty": "unknown", "kid": "unknown-kty"},
        {"kty": ["RSA"], "kid": "kty-array"},
        {"kty": None, "kid": "kty-null"},
        _rsa_public("enc", use="enc"),
        _rsa_public("ops", use=None, key_ops=["encrypt", "wrapKey"]),
        _rsa_public("alg-array", alg=["RS256"]),
        _rsa_public("alg-object", alg={"name": "RS256"}),
        _rsa_public("alg-hs256", alg="HS256"),
        _rsa_public("alg-unknown", alg="RS1"),
        _rsa_public("kid-array", kid=["x"]),
        _rsa_public("use-array", use=["sig"]),
        _rsa_public("no-n", n=None),
        _rsa_public("bad-n", n="!!!not base64!!!"),
        _rsa_public("n-number", n=12345),
        {"kty": "EC", "crv": "P-256", "kid": "ec-missing-y", "x": b64url(b"x" * 32)},
        {"kty": "EC", "crv": "P-999", "kid": "ec-bad-curve", "x": "AA", "y": "AA"},
        {
            "kty": "EC",
            "crv": "P-256",
            "kid": "ec-off-curve",
            "x": b64url(b"\x01" * 32),
            "y": b64url(b"\x02" * 32),
        },
        {"kty": "OKP", "crv": "X25519", "kid": "okp-x25519", "x": b64url(b"\x09" * 32)},
        {"kty": "OKP", "crv": "Ed25519", "kid": "okp-short", "x": b64url(b"\x09" * 5)},
    ]


async def test_key_set_with_junk_entries_still_loads_the_good_keys(issuer, upstream, client):
    issuer.extra_jwks_entries = _junk_entries()
    enc = issuer.add_key("RS256", kid="enc-only", jwk_overrides={"use": "enc"})
    async with running_gateway(config(issuer, upstream, "{}")) as gateway:
        keys = keyset(gateway, issuer)
        assert keys.failures == 0
        for alg in ("ES256", "RS256", "EdDSA"):
            answer = await orders(client, gateway, issuer.token(alg))
            assert answer.status == 200, answer.body
        # An encryption key is never a signature key, even when it would verify.
        assert_invalid_token(
            await orders(client, gateway, issuer.token("RS256", key=enc)), UNKNOWN_KEY
        )
        assert keys.count_fitting("RS256") == 1
        assert len(upstream.requests) == 3


async def test_private_members_of_a_published_key_are_never_loaded(issuer, upstream, client):
    """A key set that leaks private parts is still used only for its public half."""
    ec_private = ec.generate_private_key(ec.SECP256R1())
    ed_private = ed25519.Ed25519PrivateKey.generate()
    rsa_private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    leaked = {
        "ES256": issuer.add_key("ES256", private=ec_private),
        "EdDSA": issuer.add_key("EdDSA", private=ed_private),
        "RS256": issuer.add_key("RS256", private=rsa_private),
    }
    leaked["ES256"].jwk_overrides = _private_members(ECAlgorithm.to_jwk(ec_private, as_dict=True))
    leaked["EdDSA"].jwk_overrides = _private_members(OKPAlgorithm.to_jwk(ed_private, as_dict=True))
    leaked["RS256"].jwk_overrides = _private_members(RSAAlgorithm.to_jwk(rsa_private, as_dict=True))
    async with running_gateway(config(issuer, upstream, "{}")) as gateway:
        keys = keyset(gateway, issuer)
        for alg, key in leaked.items():
            answer = await orders(client, gateway, issuer.token(alg, key=key))
            assert answer.status == 200, answer.body
            loaded = keys.find(key.kid, alg).key
            assert isinstance(
                loaded,
                ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey,
            ), type(loaded)


def _private_members(jwk: dict[str, Any]) -> dict[str, Any]:
    private = {k: v for k, v in jwk.items() if k in ("d", "p", "q", "dp", "dq", "qi")}
    assert private, "the key has no private members to leak"
    return private


async def test_large_key_set_is_read_in_full(issuer, upstream, client):
    # Entries to skip ahead of the real keys make the document span many network reads.
    issuer.extra_jwks_entries = [{"kty": "unknown", "pad": "x" * 50_000} for _ in range(12)]
    async with running_gateway(config(issuer, upstream, "{max_backoff: 100ms}")) as gateway:
        keys = keyset(gateway, issuer)
        assert keys.failures == 0, keys.last_error
        assert (await orders(client, gateway, issuer.token("ES256"))).status == 200


async def test_key_set_larger_than_the_limit_is_refused(issuer, upstream, client):
    issuer.extra_jwks_entries = [{"kty": "unknown", "pad": "x" * 100_000} for _ in range(12)]
    text = config(issuer, upstream, "{max_backoff: 100ms}")
    async with running_gateway(text, wait_ready=False) as gateway:
        keys = keyset(gateway, issuer)
        await wait_for(lambda: keys.failures >= 1, what="a refused key set")
        assert "more than 1048576 bytes" in keys.last_error
        assert not keys.loaded
