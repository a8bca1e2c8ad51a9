"""Opaque and introspected tokens (RFC 7662): the gateway asks the issuer, caches the answer
briefly, shares one call among concurrent requests, and fails closed when it cannot ask.

Two real introspection servers: Portcullis's own authorization server (tokens it issued,
revoked through its /revoke), and `IntrospectionServer`, whose answers, delays and failures
a test sets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from tests.authserver.conftest import SECRET, basic_auth, client_credentials, tokens_for
from tests.support import (
    EchoUpstream,
    IntrospectionServer,
    ManualClock,
    TestIssuer,
    assert_invalid_token,
    assert_unavailable,
    b64url,
    call,
    challenges_of,
    gateway_yaml,
    header_values,
    issuer_entry,
    running_gateway,
    wait_for,
)


@pytest.fixture
async def server() -> AsyncIterator[IntrospectionServer]:
    introspection = await IntrospectionServer().start()
    yield introspection
    await introspection.stop()


def config(
    issuer: str,
    upstream: str,
    *,
    mode: str = "introspection",
    client_id: str = "gateway",
    secret: str = "gateway-secret",
    **options: str,
) -> str:
    """A gateway trusting one issuer in `mode`; `options` are more introspection keys."""
    settings = {"client_id": client_id, "client_secret": f'"{secret}"', **options}
    section = "{" + ", ".join(f"{k}: {v}" for k, v in settings.items()) + "}"
    entry = issuer_entry(issuer, mode=mode, leeway="0s", introspection=section)
    return gateway_yaml(issuer, upstream, issuers=[entry])


# ---------------------------------------------------------------------------- the exchange


async def test_an_active_opaque_token_is_forwarded_with_the_identity_the_issuer_gave(
    server, upstream, client
):
    server.active("opaque-1", sub="alice", client_id="mobile", scope="orders:read extra")
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert answer.status == 200, answer.body
    seen = upstream.requests[-1]
    assert header_values(seen, "X-Auth-Subject") == ["alice"]
    assert header_values(seen, "X-Auth-Client-Id") == ["mobile"]
    assert header_values(seen, "X-Auth-Scopes") == ["extra orders:read"]
    assert header_values(seen, "X-Auth-Issuer") == [server.url]
    # RFC 7662 §2.1: the token and a hint, with the gateway's own credentials (Basic).
    assert server.calls == [
        {
            "form": {"token": "opaque-1", "token_type_hint": "access_token"},
            "credentials": ("gateway", "gateway-secret"),
        }
    ]


async def test_the_configured_endpoint_is_used_when_discovery_names_none(server, upstream, client):
    server.advertise = False
    server.active("opaque-1")
    async with running_gateway(
        config(server.url, upstream.url, url=f'"{server.endpoint}"')
    ) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert answer.status == 200, answer.body
    assert len(server.calls) == 1


async def test_credentials_are_form_encoded_before_basic_encoding(server, upstream, client):
    # RFC 6749 §2.3.1: "a:b" and "p&ss word" travel as a%3Ab:p%26ss+word.
    server.client_id, server.client_secret = "a:b", "p&ss word"
    server.active("opaque-1")
    async with running_gateway(
        config(server.url, upstream.url, client_id='"a:b"', secret="p&ss word")
    ) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert answer.status == 200, answer.body
    assert server.calls[0]["credentials"] == ("a:b", "p&ss word")


async def test_a_wrong_gateway_secret_fails_closed_without_forwarding(server, upstream, client):
    server.active("opaque-1")
    async with running_gateway(config(server.url, upstream.url, secret="wrong")) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert_unavailable(answer)
    assert upstream.requests == []


# ---------------------------------------------------------------------------- caching


async def test_an_active_answer_is_reused_until_cache_ttl_then_asked_again(
    server, upstream, client
):
    server.active("opaque-1")
    clock = ManualClock()
    text = config(server.url, upstream.url, cache_ttl="300ms")
    async with running_gateway(text, clock=clock.clock) as gateway:
        for _ in range(3):
            assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
        assert len(server.calls) == 1
        clock.advance(0.29)
        assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
        assert len(server.calls) == 1
        clock.advance(0.02)
        assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
        assert len(server.calls) == 2


async def test_the_cache_never_outlives_the_tokens_expiry(server, upstream, client):
    clock = ManualClock()
    server.active("opaque-1", exp=clock.wall + 3)
    text = config(server.url, upstream.url, cache_ttl="10s")
    async with running_gateway(text, clock=clock.clock) as gateway:
        assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
        clock.advance(2.9)
        assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
        assert len(server.calls) == 1
        clock.advance(0.2)
        server.answers["opaque-1"] = {"active": False}
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert_invalid_token(answer, "the token is not active")
    assert len(server.calls) == 2


async def test_no_store_on_the_answer_still_allows_caching_within_the_ttl(server, upstream, client):
    server.cache_control = "no-store"
    server.active("opaque-1")
    async with running_gateway(config(server.url, upstream.url, cache_ttl="10s")) as gateway:
        for _ in range(3):
            assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
    assert len(server.calls) == 1


async def test_an_inactive_token_is_refused_and_remembered_only_briefly(server, upstream, client):
    clock = ManualClock()
    text = config(server.url, upstream.url, inactive_cache_ttl="200ms")
    async with running_gateway(text, clock=clock.clock) as gateway:
        for _ in range(2):
            answer = await call(client, gateway.url + "/orders/7", "unknown-token")
            assert_invalid_token(answer, "the token is not active")
        assert len(server.calls) == 1
        clock.advance(0.21)
        server.active("unknown-token")  # activated meanwhile: seen once the brief entry ends
        assert (await call(client, gateway.url + "/orders/7", "unknown-token")).status == 200
    assert len(server.calls) == 2
    assert len(upstream.requests) == 1


async def test_concurrent_requests_with_one_token_share_a_single_introspection_call(
    server, upstream, client
):
    server.active("opaque-1")
    server.delay = 0.2
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        answers = await asyncio.gather(
            *(call(client, gateway.url + f"/orders/{n}", "opaque-1") for n in range(20))
        )
    assert [a.status for a in answers] == [200] * 20
    assert len(server.calls) == 1
    assert len(upstream.requests) == 20


async def test_distinct_tokens_in_flight_are_bounded_and_the_rest_get_503_at_once(
    server, upstream, client
):
    """A flood of distinct made-up tokens cannot pile up calls (and tasks) without end, even
    with no pre_auth limit: past max_pending distinct tokens being asked about, a new one is
    refused at once with 503 and Retry-After; a token already being asked about still
    waits for that answer."""
    for token in ("t1", "t2", "t3"):
        server.active(token)
    server.delay = 1.0
    async with running_gateway(config(server.url, upstream.url, max_pending="2")) as gateway:
        first = [
            asyncio.create_task(call(client, gateway.url + "/orders/1", token))
            for token in ("t1", "t2")
        ]
        await wait_for(lambda: server.in_flight == 2, what="two calls in flight")
        joining = asyncio.create_task(call(client, gateway.url + "/orders/1", "t1"))
        refused = await call(client, gateway.url + "/orders/1", "t3")
        assert_unavailable(refused)
        assert len(server.calls) == 2
        assert [a.status for a in await asyncio.gather(*first, joining)] == [200] * 3
        server.delay = 0
        assert (await call(client, gateway.url + "/orders/1", "t3")).status == 200
    assert len(server.calls) == 3
    assert len(upstream.requests) == 4


# ---------------------------------------------------------------------------- failing closed


async def test_an_unreachable_introspection_endpoint_fails_closed_with_503(
    upstream, client, refused_port
):
    issuer = "http://127.0.0.1:9"
    dead = f'"http://127.0.0.1:{refused_port}/introspect"'
    async with running_gateway(config(issuer, upstream.url, url=dead)) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert_unavailable(answer)
    assert answer.headers["Retry-After"] == "5"
    assert upstream.requests == []


async def test_a_slow_introspection_endpoint_fails_closed_within_the_timeout(
    server, upstream, client
):
    server.active("opaque-1")
    server.delay = 2.0
    async with running_gateway(config(server.url, upstream.url, timeout="150ms")) as gateway:
        started = time.monotonic()
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
        waited = time.monotonic() - started
    assert_unavailable(answer)
    assert waited < 1.5  # the timeout, not the endpoint, ended the wait
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("status", "garbage"),
    [
        (200, b"<html>maintenance</html>"),
        (200, b"[true]"),
        (200, b'{"active": "true"}'),
        (200, b'{"scope": "orders:read"}'),
        (500, None),
        (302, None),
    ],
    ids=["not-json", "array", "active-not-boolean", "no-active", "status-500", "redirect"],
)
async def test_an_answer_that_is_not_a_valid_introspection_response_fails_closed(
    server, upstream, client, status, garbage
):
    server.active("opaque-1")
    server.status, server.garbage = status, garbage
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert_unavailable(answer)
    assert upstream.requests == []


async def test_a_failed_call_is_not_cached_and_the_next_request_asks_again(
    server, upstream, client
):
    server.active("opaque-1")
    server.status = 503
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        assert_unavailable(await call(client, gateway.url + "/orders/7", "opaque-1"))
        server.status = 200
        assert (await call(client, gateway.url + "/orders/7", "opaque-1")).status == 200
    assert len(server.calls) == 2


# ---------------------------------------------------------------------------- checks


@pytest.mark.parametrize(
    ("claims", "description"),
    [
        ({"iss": "https://elsewhere.example"}, "the token's issuer is not trusted"),
        ({"token_type": "refresh_token"}, "the token is not an access token"),
        ({"sub": None}, "the token has no subject"),
        ({"exp": 1_000_000}, "the token has expired"),
        ({"nbf": 4_000_000_000}, "the token is not valid yet"),
        ({"aud": "billing-api"}, "the token is not meant for this API (audience)"),
        ({"aud": None}, "the token is not meant for this API (audience)"),
    ],
    ids=["issuer", "refresh-token", "no-sub", "expired", "not-yet", "audience", "no-audience"],
)
async def test_an_active_answer_is_checked_like_a_jwt(
    server, upstream, client, claims, description
):
    server.active("opaque-1", **claims)
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert_invalid_token(answer, description)
    assert upstream.requests == []


async def test_an_active_token_without_the_routes_scope_is_403_insufficient_scope(
    server, upstream, client
):
    server.active("opaque-1", scope="profile")
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        answer = await call(client, gateway.url + "/orders/7", "opaque-1")
    assert answer.status == 403
    assert challenges_of(answer.headers, keep_scope=True)[0] == (
        'Bearer realm="portcullis", error="insufficient_scope", '
        'error_description="the token needs one of: orders:admin orders:read", '
        'scope="orders:admin orders:read"'
    )
    assert answer.body["error"]["code"] == "insufficient_scope"
    assert upstream.requests == []


@pytest.mark.parametrize(
    "scope",
    [
        "orders:read x\u00a0orders:write",
        "orders:read\torders:write",
        ["orders:read x orders:write"],
    ],
    ids=["nbsp", "tab", "array-element-with-space"],
)
async def test_an_active_answer_with_a_smuggled_scope_is_refused_and_remembered_as_inactive(
    server, upstream, client, scope
):
    """RFC 7662 §2.2 / RFC 6749 §3.3: scopes are split on U+0020 alone; a scope token with
    other characters makes the answer unusable, so the token is refused (and not asked about
    again for inactive_cache_ttl)."""
    server.active("opaque-1", scope=scope)
    async with running_gateway(config(server.url, upstream.url)) as gateway:
        answers = [
            await call(client, gateway.url + "/orders/7", "opaque-1", method="PUT")
            for _ in range(2)
        ]
    assert_invalid_token(answers[0], "the token's scope is not a list of scope tokens")
    assert_invalid_token(answers[1], "the token is not active")  # remembered, not asked again
    assert len(server.calls) == 1
    assert upstream.requests == []


# ---------------------------------------------------------------------------- auto mode


async def test_auto_mode_verifies_jwts_locally_and_introspects_other_tokens(
    issuer: TestIssuer, server, upstream, client
):
    # One issuer: its keys for JWTs, and (through its discovery) an introspection endpoint.
    issuer.metadata_overrides["introspection_endpoint"] = server.endpoint
    server.active("opaque-1", iss=issuer.url, sub="opaque-user")
    async with running_gateway(config(issuer.url, upstream.url, mode="auto")) as gateway:
        jwt_answer = await call(client, gateway.url + "/orders/1", issuer.token("ES256"))
        assert server.calls == []  # the JWT never left the gateway
        opaque_answer = await call(client, gateway.url + "/orders/2", "opaque-1")
    assert (jwt_answer.status, opaque_answer.status) == (200, 200)
    assert [header_values(r, "X-Auth-Subject") for r in upstream.requests] == [
        ["user-123"],
        ["opaque-user"],
    ]
    assert len(server.calls) == 1


async def test_auto_mode_refuses_malformed_jwts_word_for_word_as_jwt_mode(
    issuer: TestIssuer, server, upstream, client
):
    """In auto mode the payload read to choose the verifier is the one the local checks
    read: every JWT is refused as in jwt mode, whatever is wrong with its payload."""
    issuer.metadata_overrides["introspection_endpoint"] = server.endpoint
    key = issuer.key("ES256")
    header = b64url({"alg": "ES256", "typ": "at+jwt", "kid": key.kid})
    good = issuer.token("ES256")
    _, payload, signature = good.split(".")
    tokens = [
        f"{header}.{b64url(b'not json')}.{signature}",
        f"{header}.{b64url(b'[1, 2]')}.{signature}",
        f"{header}.{payload[:-1]}.{signature}",  # a length no bytes encode to
        f"{header}.{payload}=.{signature}",
        f"{header}.{b64url(issuer.claims(iss=7))}.{signature}",
        f"{header}.{b64url(issuer.claims())}.{signature}",  # the signature of another payload
        f"{b64url({'alg': 'none'})}.{payload}.{signature}",
        issuer.token("ES256", lifetime=-3600, iat=int(time.time()) - 7200),
        issuer.token("ES256", scope=["orders:read", 'x"y']),
        issuer.token("ES256", cnf={"x5t#S256": "abc"}),
        good,
    ]
    configs = {
        "jwt": gateway_yaml(
            issuer.url, upstream.url, issuers=[issuer_entry(issuer.url, leeway="0s")]
        ),
        "auto": config(issuer.url, upstream.url, mode="auto"),
    }
    answers = {}
    for mode, text in configs.items():
        async with running_gateway(text) as gateway:
            answers[mode] = [
                (a.status, challenges_of(a.headers), a.body)
                for a in [await call(client, gateway.url + "/orders/1", t) for t in tokens]
            ]
    # The refusals are the same bytes; the good token passes in both (the upstream's echo
    # of it names each gateway's own port).
    assert answers["auto"][:-1] == answers["jwt"][:-1]
    # `=` inside a credential is no b64token at all (RFC 6750 §2.1): 400, in either mode.
    assert [status for status, _, _ in answers["auto"]] == [401] * 3 + [400] + [401] * 6 + [200]
    assert answers["jwt"][-1][0] == 200
    assert server.calls == []


async def test_jwt_mode_never_sends_a_token_to_an_introspection_endpoint(
    issuer: TestIssuer, server, upstream, client
):
    issuer.metadata_overrides["introspection_endpoint"] = server.endpoint
    server.active("opaque-1", iss=issuer.url)
    async with running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway:
        answer = await call(client, gateway.url + "/orders/2", "opaque-1")
    assert_invalid_token(answer, "the token is not a signed JWT")
    assert server.calls == []


# ---------------------------------------------------------------------------- the authserver


async def test_an_authserver_token_passes_by_introspection_until_revoked(start_authserver, http):
    authserver = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        gateway_config = config(
            authserver.settings.issuer,
            upstream.url,
            client_id="resource-server",
            secret=SECRET,
            cache_ttl="300ms",
            inactive_cache_ttl="100ms",
        )
        clock = ManualClock()
        async with running_gateway(gateway_config, clock=clock.clock) as gateway:
            status, body = await client_credentials(http, authserver, scope="orders:read")
            assert status == 200, body
            token = body["access_token"]
            answer = await call(http, gateway.url + "/orders/1", token)
            assert answer.status == 200, answer.body
            assert header_values(upstream.requests[-1], "X-Auth-Subject") == ["machine"]
            assert header_values(upstream.requests[-1], "X-Auth-Scopes") == ["orders:read"]

            async with http.post(
                authserver.endpoint("/revoke"),
                data={"token": token},
                headers={"Authorization": basic_auth("machine", SECRET)},
            ) as revoked:
                assert revoked.status == 200
            # Still cached: the revocation shows only once the active answer's TTL is over.
            assert (await call(http, gateway.url + "/orders/1", token)).status == 200
            clock.advance(0.31)
            answer = await call(http, gateway.url + "/orders/1", token)
            assert_invalid_token(answer, "the token is not active")
    finally:
        await upstream.stop()
    assert len(upstream.requests) == 2


async def test_an_authserver_refresh_token_is_not_accepted_as_a_bearer_token(
    start_authserver, http
):
    authserver = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        gateway_config = config(
            authserver.settings.issuer, upstream.url, client_id="resource-server", secret=SECRET
        )
        async with running_gateway(gateway_config) as gateway:
            tokens = await tokens_for(http, authserver)
            refused = await call(http, gateway.url + "/orders/1", tokens["refresh_token"])
            accepted = await call(http, gateway.url + "/orders/1", tokens["access_token"])
    finally:
        await upstream.stop()
    # The authserver calls the refresh token active, with token_type refresh_token.
    assert_invalid_token(refused, "the token is not an access token")
    assert accepted.status == 200, accepted.body
    assert len(upstream.requests) == 1
