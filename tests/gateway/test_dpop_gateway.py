"""DPoP-bound tokens (RFC 9449) through a real gateway on 127.0.0.1: each check of §4.3 with
a request that breaks it, the binding of §6 and §7.2, the §7.1 challenges, the proof checked
on every request (a cached token too), htu against the configured public_url, the
introspection answer's cnf, and the replay cache in memory and in Redis, across replicas
and processes."""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from jwt.algorithms import get_default_algorithms

from tests.dpop_proofs import HTU_SPELLINGS, REMOVE, DpopKey, htu_spelling
from tests.support import (
    DPOP_ALGS,
    REDIS_URL,
    Answer,
    GatewayProcess,
    IntrospectionServer,
    ManualClock,
    RunningGateway,
    challenges_of,
    compact,
    ecdsa_twin,
    gateway_yaml,
    header_values,
    issuer_entry,
    redis_or_skip,
    running_gateway,
    sample,
    scrape,
)

PATH = "/orders/1"


async def send(
    client: aiohttp.ClientSession,
    gateway: RunningGateway | GatewayProcess,
    token: str,
    proofs: str | list[str] | None = None,
    *,
    scheme: str = "DPoP",
    method: str = "GET",
    path: str = PATH,
) -> Answer:
    """One request with `Authorization: <scheme> <token>` and each proof as a DPoP header."""
    headers = [("Authorization", f"{scheme} {token}")]
    if proofs is not None:
        for proof in [proofs] if isinstance(proofs, str) else proofs:
            headers.append(("DPoP", proof))
    async with client.request(method, gateway.url + path, headers=headers) as resp:
        body: Any = await resp.read()
        if resp.content_type == "application/json" and body:
            import json

            body = json.loads(body)
        return Answer(resp.status, resp.headers, body)


def assert_dpop_refused(
    answer: Answer, description: str, *, error: str = "invalid_dpop_proof", bearer: bool = True
) -> None:
    """401 with the DPoP challenge carrying the error (RFC 9449 §7.1), after a bare Bearer
    challenge where bearer tokens are taken, and the resource error body."""
    assert answer.status == 401, answer.body
    challenges = [
        f'DPoP realm="portcullis", error="{error}", error_description="{description}", '
        f'algs="{DPOP_ALGS}"'
    ]
    if bearer:
        challenges.insert(0, 'Bearer realm="portcullis"')
    assert challenges_of(answer.headers) == challenges
    prefix = "The access token" if error == "invalid_token" else "The DPoP proof"
    assert answer.body == {
        "error": {"code": error, "message": f"{prefix} was refused: {description}.", "details": []}
    }


@pytest.fixture(scope="module")
def key() -> DpopKey:
    return DpopKey("ES256")


def url(gateway: RunningGateway | GatewayProcess, path: str = PATH) -> str:
    return gateway.url + path


# ---------------------------------------------------------------------------- accepted


async def test_a_bound_token_with_a_fresh_proof_is_forwarded(
    gateway, issuer, upstream, client, key
):
    token = issuer.token("ES256", cnf=key.cnf, sub="dpop-user")
    answer = await send(client, gateway, token, key.proof("GET", url(gateway), token))
    assert answer.status == 200, answer.body
    assert header_values(answer.body, "X-Auth-Subject") == ["dpop-user"]


@pytest.mark.parametrize("alg", ["RS256", "PS256", "EdDSA", "ES384"])
async def test_proofs_of_other_algorithms_are_accepted(gateway, issuer, client, alg):
    holder = DpopKey(alg)
    token = issuer.token("ES256", cnf=holder.cnf)
    answer = await send(client, gateway, token, holder.proof("GET", url(gateway), token))
    assert answer.status == 200, answer.body


async def test_a_cached_token_still_needs_a_proof_on_every_request(gateway, issuer, client, key):
    cache = gateway.gateway.token_cache
    token = issuer.token("ES256", cnf=key.cnf)
    first = key.proof("GET", url(gateway), token)
    assert (await send(client, gateway, token, first)).status == 200
    assert (await send(client, gateway, token, key.proof("GET", url(gateway), token))).status == 200
    assert cache.hits == 1, "the second request took the token from the cache"

    # Cache hits all, and every one refused for its proof.
    assert_dpop_refused(await send(client, gateway, token, first), "the DPoP proof was used before")
    assert_dpop_refused(await send(client, gateway, token), "the request has no DPoP proof")
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("DELETE", url(gateway), token)),
        "the DPoP proof is for another method",
    )
    assert_dpop_refused(
        await send(client, gateway, token, DpopKey("ES256").proof("GET", url(gateway), token)),
        "the token is bound to another key than the DPoP proof's",
        error="invalid_token",
    )
    assert cache.hits == 5


# ---------------------------------------------------------------------------- §4.3, one by one


async def test_a_proof_by_another_key_than_the_tokens_is_refused(gateway, issuer, client, key):
    thief = DpopKey("ES256")
    token = issuer.token("ES256", cnf=key.cnf)
    assert_dpop_refused(
        await send(client, gateway, token, thief.proof("GET", url(gateway), token)),
        "the token is bound to another key than the DPoP proof's",
        error="invalid_token",
    )


async def test_a_proof_for_another_method_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("POST", url(gateway), token)),
        "the DPoP proof is for another method",
    )


@pytest.mark.parametrize(
    "other", ["/orders/2", "/orders/1/", "/other", "https://{host}/orders/1", "http://x.test{path}"]
)
async def test_a_proof_for_another_uri_is_refused(gateway, issuer, client, key, other):
    token = issuer.token("ES256", cnf=key.cnf)
    host = gateway.url.split("://")[1]
    htu = other.format(host=host, path=PATH) if "://" in other else url(gateway, other)
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("GET", htu, token)),
        "the DPoP proof is for another URI",
    )


async def test_htu_ignores_the_query_and_is_compared_normalised(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    host = gateway.url.split("://")[1]
    htu = f"HTTP://{host.upper()}/orders/%31?page=1#x"
    answer = await send(client, gateway, token, key.proof("GET", htu, token), path=PATH + "?a=b")
    assert answer.status == 200, answer.body


@pytest.mark.parametrize("case", sorted(HTU_SPELLINGS))
async def test_htu_spellings_are_compared_after_normalisation(gateway, issuer, client, key, case):
    # The table the authorization server is held to as well (tests/dpop_proofs.py).
    token = issuer.token("ES256", cnf=key.cnf)
    htu, same = htu_spelling(case, url(gateway))
    answer = await send(client, gateway, token, key.proof("GET", htu, token))
    if same:
        assert answer.status == 200, answer.body
    else:
        assert_dpop_refused(answer, "the DPoP proof is for another URI")


@pytest.fixture
async def clocked(issuer, upstream) -> AsyncIterator[tuple[RunningGateway, ManualClock]]:
    clock = ManualClock()
    config = gateway_yaml(issuer.url, upstream.url, extra="dpop: {proof_max_age: 30s, leeway: 2s}")
    async with running_gateway(config, clock=clock.clock) as running:
        yield running, clock


async def test_a_stale_proof_is_refused(clocked, issuer, client, key):
    gateway, clock = clocked
    token = issuer.token("ES256", cnf=key.cnf)
    made = clock.wall
    clock.advance(32)
    answer = await send(client, gateway, token, key.proof("GET", url(gateway), token, iat=made))
    assert answer.status == 200, "30s of age and 2s of leeway"
    clock.advance(0.5)
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("GET", url(gateway), token, iat=made)),
        "the DPoP proof is too old",
    )


async def test_a_proof_from_the_future_is_refused(clocked, issuer, client, key):
    gateway, clock = clocked
    token = issuer.token("ES256", cnf=key.cnf)
    soon = key.proof("GET", url(gateway), token, iat=clock.wall + 2)
    assert (await send(client, gateway, token, soon)).status == 200
    assert_dpop_refused(
        await send(
            client, gateway, token, key.proof("GET", url(gateway), token, iat=clock.wall + 3)
        ),
        "the DPoP proof is dated in the future",
    )


async def test_a_replayed_proof_is_refused_until_it_would_be_too_old_anyway(
    clocked, issuer, client, key
):
    gateway, clock = clocked
    token = issuer.token("ES256", cnf=key.cnf)
    proof = key.proof("GET", url(gateway), token, iat=clock.wall)
    assert (await send(client, gateway, token, proof)).status == 200
    clock.advance(31)
    assert_dpop_refused(await send(client, gateway, token, proof), "the DPoP proof was used before")
    clock.advance(1.5)  # past iat + max_age + leeway: the iat check refuses it now
    assert_dpop_refused(await send(client, gateway, token, proof), "the DPoP proof is too old")
    # The next proof recorded finds the expired entry and drops it: one entry, its own.
    fresh = key.proof("GET", url(gateway), token, iat=clock.wall)
    assert (await send(client, gateway, token, fresh)).status == 200
    assert len(gateway.gateway.replay) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("alg", ["ES256", "ES384", "ES512"])
async def test_the_ecdsa_twin_of_a_used_proof_is_refused_as_a_replay(gateway, issuer, client, alg):
    """(r, n - s) verifies as well as (r, s), and clients sign either spelling (WebCrypto: a
    high S half the time), so both pass the checks; but the replay cache keeps the key and
    the jti, never the signature: a proof's twin is that proof used again."""
    key = DpopKey(alg)
    token = issuer.token("ES256", cnf=key.cnf)
    proof = key.proof("GET", url(gateway), token)
    assert (await send(client, gateway, token, ecdsa_twin(proof))).status == 200
    assert_dpop_refused(await send(client, gateway, token, proof), "the DPoP proof was used before")
    other = key.proof("GET", url(gateway), token)
    assert (await send(client, gateway, token, other)).status == 200
    assert_dpop_refused(
        await send(client, gateway, token, ecdsa_twin(other)), "the DPoP proof was used before"
    )


async def test_a_proof_without_ath_or_for_another_token_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    other = issuer.token("ES256", cnf=key.cnf)
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("GET", url(gateway))),
        "the DPoP proof has no ath, the hash of the access token",
    )
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("GET", url(gateway), other)),
        "the DPoP proof is for another access token",
    )


@pytest.mark.parametrize("typ", ["JWT", REMOVE])
async def test_a_proof_of_another_type_is_refused(gateway, issuer, client, key, typ):
    token = issuer.token("ES256", cnf=key.cnf)
    assert_dpop_refused(
        await send(
            client, gateway, token, key.proof("GET", url(gateway), token, header={"typ": typ})
        ),
        "the DPoP proof's typ is not dpop+jwt",
    )


async def test_an_unsigned_proof_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    unsigned = key.proof("GET", url(gateway), token, header={"alg": "none"}, sign_alg="none")
    assert_dpop_refused(
        await send(client, gateway, token, unsigned + "AAAA"),
        "the DPoP proof's signing algorithm is not accepted",
    )


async def test_a_proof_with_a_mac_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    head = {"typ": "dpop+jwt", "alg": "HS256", "jwk": key.jwk}
    body = {"jti": "j", "htm": "GET", "htu": url(gateway), "iat": 0, "ath": "x"}
    secret = key.jwk["x"].encode()
    proof = compact(head, body, lambda data: hmac.new(secret, data, hashlib.sha256).digest())
    assert_dpop_refused(
        await send(client, gateway, token, proof),
        "the DPoP proof's signing algorithm is not accepted",
    )


async def test_a_proof_carrying_its_private_key_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    private_jwk = get_default_algorithms()["ES256"].to_jwk(key.private, as_dict=True)
    proof = key.proof("GET", url(gateway), token, header={"jwk": private_jwk})
    assert_dpop_refused(
        await send(client, gateway, token, proof), "the DPoP proof's jwk holds a private key"
    )


async def test_two_dpop_headers_are_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    proofs = [key.proof("GET", url(gateway), token), key.proof("GET", url(gateway), token)]
    assert_dpop_refused(
        await send(client, gateway, token, proofs), "the request has more than one DPoP header"
    )


async def test_a_proof_that_is_not_a_jwt_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    assert_dpop_refused(
        await send(client, gateway, token, "not-a-proof"), "the DPoP proof is not a signed JWT"
    )


# ---------------------------------------------------------------------------- binding, schemes


async def test_a_bound_token_sent_as_bearer_is_refused(gateway, issuer, upstream, client, key):
    token = issuer.token("ES256", cnf=key.cnf)
    for proof in (None, key.proof("GET", url(gateway), token)):
        answer = await send(client, gateway, token, proof, scheme="Bearer")
        assert_dpop_refused(
            answer,
            "the token is DPoP-bound: send it as Authorization: DPoP with a proof",
            error="invalid_token",
        )
    assert upstream.requests == []


async def test_an_unbound_token_sent_as_dpop_is_refused(gateway, issuer, client, key):
    token = issuer.token("ES256")
    assert_dpop_refused(
        await send(client, gateway, token, key.proof("GET", url(gateway), token)),
        "the token is not DPoP-bound",
        error="invalid_token",
    )


async def test_a_token_bound_otherwise_than_by_dpop_is_refused(gateway, issuer, client):
    token = issuer.token("ES256", cnf={"x5t#S256": "bwcK0esc3ACC3DB2Y5_lESsXE8o9ltc05O89jdN-dg2"})
    answer = await send(client, gateway, token, scheme="Bearer")
    assert answer.status == 401
    assert answer.body["error"]["message"] == (
        "The access token was refused: the token's cnf names no DPoP key (cnf.jkt)."
    )


async def test_bearer_tokens_keep_working_and_401s_offer_both_schemes(gateway, issuer, client):
    token = issuer.token("ES256")
    assert (await send(client, gateway, token, scheme="Bearer")).status == 200
    async with client.get(url(gateway)) as resp:
        assert resp.status == 401
        assert challenges_of(resp.headers) == [
            'Bearer realm="portcullis"',
            f'DPoP realm="portcullis", algs="{DPOP_ALGS}"',
        ]


@pytest.fixture
async def required(issuer, upstream) -> AsyncIterator[RunningGateway]:
    routes = '  - {name: payments, path: "/payments/**", dpop: required}\n'
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, routes)) as running:
        yield running


async def test_a_route_with_dpop_required_refuses_bearer_tokens(required, issuer, client, key):
    token = issuer.token("ES256")
    answer = await send(client, required, token, scheme="Bearer", path="/payments/1")
    assert_dpop_refused(
        answer, "this route accepts DPoP-bound tokens only", error="invalid_token", bearer=False
    )
    # Its 401s offer DPoP alone; other routes still take bearer tokens.
    async with client.get(url(required, "/payments/1")) as resp:
        assert challenges_of(resp.headers) == [f'DPoP realm="portcullis", algs="{DPOP_ALGS}"']
        assert (await resp.json())["error"]["message"] == (
            "This API needs a DPoP-bound access token (Authorization: DPoP) and its proof "
            "(a DPoP header)."
        )
    assert (await send(client, required, token, scheme="Bearer")).status == 200

    bound = issuer.token("ES256", cnf=key.cnf)
    proof = key.proof("GET", url(required, "/payments/1"), bound)
    assert (await send(client, required, bound, proof, path="/payments/1")).status == 200


async def test_an_issuer_with_dpop_required_has_its_bearer_tokens_refused(issuer, upstream, client):
    config = gateway_yaml(
        issuer.url, upstream.url, issuers=[issuer_entry(issuer.url, dpop="required")]
    )
    async with running_gateway(config) as gateway:
        answer = await send(client, gateway, issuer.token("ES256"), scheme="Bearer")
    assert_dpop_refused(
        answer, "this issuer's tokens are accepted DPoP-bound only", error="invalid_token"
    )


async def test_insufficient_scope_is_told_on_the_dpop_challenge(gateway, issuer, client, key):
    token = issuer.token("ES256", cnf=key.cnf, scope="profile")
    answer = await send(client, gateway, token, key.proof("GET", url(gateway), token))
    assert answer.status == 403
    challenges = challenges_of(answer.headers, keep_scope=True)
    assert challenges[0] == 'Bearer realm="portcullis"'
    assert challenges[1].startswith('DPoP realm="portcullis", error="insufficient_scope"')


# ---------------------------------------------------------------------------- public_url


async def test_behind_a_tls_terminator_htu_is_checked_against_public_url(
    issuer, upstream, client, key
):
    routes = '  - {name: pay, path: "/pay/**", public_url: "https://pay.example.com:443/"}\n'
    config = gateway_yaml(
        issuer.url, upstream.url, routes, extra='public_url: "https://api.example.com"'
    )
    async with running_gateway(config) as gateway:
        token = issuer.token("ES256", cnf=key.cnf)
        external = key.proof("GET", "https://api.example.com" + PATH, token)
        assert (await send(client, gateway, token, external)).status == 200
        # The address the gateway itself is reached at is not the one clients use.
        assert_dpop_refused(
            await send(client, gateway, token, key.proof("GET", url(gateway), token)),
            "the DPoP proof is for another URI",
        )
        routed = key.proof("GET", "https://pay.example.com/pay/1", token)
        assert (await send(client, gateway, token, routed, path="/pay/1")).status == 200


# ---------------------------------------------------------------------------- introspection


@pytest.fixture
async def introspection() -> AsyncIterator[IntrospectionServer]:
    server = await IntrospectionServer().start()
    yield server
    await server.stop()


async def test_the_introspection_answers_cnf_binds_the_token(introspection, upstream, client, key):
    section = '{client_id: gateway, client_secret: "gateway-secret"}'
    entry = issuer_entry(introspection.url, mode="introspection", introspection=section)
    config = gateway_yaml(introspection.url, upstream.url, issuers=[entry])
    async with running_gateway(config) as gateway:
        introspection.active("bound-opaque", token_type="DPoP", cnf=key.cnf)
        proof = key.proof("GET", url(gateway), "bound-opaque")
        assert (await send(client, gateway, "bound-opaque", proof)).status == 200
        assert_dpop_refused(
            await send(client, gateway, "bound-opaque", scheme="Bearer"),
            "the token is DPoP-bound: send it as Authorization: DPoP with a proof",
            error="invalid_token",
        )
        thief = DpopKey("ES256").proof("GET", url(gateway), "bound-opaque")
        assert_dpop_refused(
            await send(client, gateway, "bound-opaque", thief),
            "the token is bound to another key than the DPoP proof's",
            error="invalid_token",
        )
        # token_type DPoP without the key it is bound to cannot be checked: refused.
        introspection.active("keyless", token_type="DPoP")
        answer = await send(client, gateway, "keyless", key.proof("GET", url(gateway), "keyless"))
        assert answer.status == 401
        assert "no cnf.jkt" in answer.body["error"]["message"]


# ---------------------------------------------------------------------------- replay caches


async def test_a_full_memory_replay_cache_refuses_new_proofs_with_503(
    issuer, upstream, client, key
):
    config = gateway_yaml(issuer.url, upstream.url, extra="dpop: {replay_cache_size: 2}")
    async with running_gateway(config) as gateway:
        token = issuer.token("ES256", cnf=key.cnf)
        for _ in range(2):
            assert (
                await send(client, gateway, token, key.proof("GET", url(gateway), token))
            ).status == 200
        answer = await send(client, gateway, token, key.proof("GET", url(gateway), token))
    assert answer.status == 503
    assert answer.headers["Retry-After"] == "1"
    assert answer.body["error"]["code"] == "unavailable"


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    redis = await redis_or_skip()
    chosen = f"portcullis-test:{uuid.uuid4().hex}:"
    yield chosen
    keys = await redis.keys(chosen + "*")
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


def redis_config(issuer: str, upstream: str, prefix: str, backend: str = REDIS_URL) -> str:
    return gateway_yaml(
        issuer,
        upstream,
        extra=(
            f'rate_limits: {{backend: "{backend}", timeout: 500ms}}\n'
            f'dpop: {{replay_key_prefix: "{prefix}"}}\n'
            'public_url: "https://api.example.com"'
        ),
    )


async def test_a_proof_used_at_one_replica_is_refused_at_another(
    issuer, upstream, client, key, prefix
):
    config = redis_config(issuer.url, upstream.url, prefix)
    async with running_gateway(config) as first, running_gateway(config) as second:
        token = issuer.token("ES256", cnf=key.cnf)
        proof = key.proof("GET", "https://api.example.com" + PATH, token)
        assert (await send(client, first, token, proof)).status == 200
        assert_dpop_refused(
            await send(client, second, token, proof), "the DPoP proof was used before"
        )
        assert_dpop_refused(
            await send(client, first, token, proof), "the DPoP proof was used before"
        )
    redis = await redis_or_skip()
    try:
        keys = await redis.keys(prefix + "*")
        assert len(keys) == 1
        assert 0 < await redis.pttl(keys[0]) <= 65_000
    finally:
        await redis.aclose()


async def test_a_proof_used_at_one_gateway_process_is_refused_at_another(
    issuer, upstream, client, key, prefix, tmp_path: Path
):
    config = redis_config(issuer.url, upstream.url, prefix)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = GatewayProcess(config, tmp_path / "a")
    second = GatewayProcess(config, tmp_path / "b")
    try:
        await first.wait_ready()
        await second.wait_ready()
        token = issuer.token("ES256", cnf=key.cnf)
        proof = key.proof("GET", "https://api.example.com" + PATH, token)
        assert (await send(client, second, token, proof)).status == 200
        assert_dpop_refused(
            await send(client, first, token, proof), "the DPoP proof was used before"
        )
        fresh = key.proof("GET", "https://api.example.com" + PATH, token)
        assert (await send(client, first, token, fresh)).status == 200
    finally:
        await first.stop()
        await second.stop()


async def test_when_redis_cannot_answer_proofs_are_refused_with_503(
    issuer, upstream, client, key, refused_port
):
    config = redis_config(
        issuer.url, upstream.url, "unused:", backend=f"redis://127.0.0.1:{refused_port}/0"
    )
    async with running_gateway(config) as gateway:
        token = issuer.token("ES256", cnf=key.cnf)
        answer = await send(
            client, gateway, token, key.proof("GET", "https://api.example.com" + PATH, token)
        )
        bearer = await send(client, gateway, issuer.token("ES256"), scheme="Bearer")
    assert answer.status == 503
    assert answer.body["error"]["message"] == (
        "The gateway cannot check DPoP proofs right now; try again shortly."
    )
    assert bearer.status == 200, "bearer tokens need no replay cache"


# ---------------------------------------------------------------------------- reload, monitor


async def test_a_reload_keeps_the_proofs_already_seen(issuer, upstream, client, key, tmp_path):
    path = tmp_path / "gateway.yaml"
    text = gateway_yaml(issuer.url, upstream.url)
    async with running_gateway(text, config_file=path) as gateway:
        token = issuer.token("ES256", cnf=key.cnf)
        proof = key.proof("GET", url(gateway), token)
        assert (await send(client, gateway, token, proof)).status == 200
        path.write_text(text + "dpop: {replay_cache_size: 1000}\n")
        assert await gateway.gateway.reload()
        assert gateway.gateway.replay.max_entries == 1000  # type: ignore[attr-defined]
        assert_dpop_refused(
            await send(client, gateway, token, proof), "the DPoP proof was used before"
        )


async def test_refusals_are_counted_by_reason_and_monitor_mode_only_notes_them(
    issuer, upstream, client, key
):
    routes = '  - {name: legacy, path: "/legacy/**", mode: monitor}\n'
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, routes)) as gateway:
        token = issuer.token("ES256", cnf=key.cnf)
        enforced = await send(client, gateway, token, scheme="Bearer")
        monitored = await send(client, gateway, token, scheme="Bearer", path="/legacy/1")
        replayed = key.proof("GET", url(gateway, "/legacy/2"), token)
        await send(client, gateway, token, replayed, path="/legacy/2")
        again = await send(client, gateway, token, replayed, path="/legacy/2")
        samples = await scrape(gateway.admin_url)
    assert enforced.status == 401
    assert (monitored.status, again.status) == (200, 200)
    # Forwarded without identity: the token was not used as its binding requires.
    assert header_values(monitored.body, "X-Auth-Subject") == []
    denial = "portcullis_gateway_denials_total"
    assert (
        sample(samples, denial, route="orders-read", decision="deny", reason="dpop_bound_as_bearer")
        == 1
    )
    assert (
        sample(
            samples, denial, route="legacy", decision="would_deny", reason="dpop_bound_as_bearer"
        )
        == 1
    )
    assert (
        sample(samples, denial, route="legacy", decision="would_deny", reason="dpop_proof_replayed")
        == 1
    )


# ---------------------------------------------------------------------------- nonces

NONCES = 'dpop: {nonce: true, nonce_lifetime: 60s, nonce_key: "a shared nonce key"}'


async def test_with_nonces_a_proof_without_one_gets_use_dpop_nonce_and_a_nonce(
    issuer, upstream, client, key
):
    clock = ManualClock()
    config = gateway_yaml(issuer.url, upstream.url, extra=NONCES)
    async with running_gateway(config, clock=clock.clock) as gateway:
        token = issuer.token("ES256", cnf=key.cnf)
        first = await send(client, gateway, token, key.proof("GET", url(gateway), token))
        assert_dpop_refused(
            first,
            "the DPoP proof must carry a current nonce from DPoP-Nonce",
            error="use_dpop_nonce",
        )
        nonce = first.headers["DPoP-Nonce"]
        proof = key.proof("GET", url(gateway), token, nonce=nonce, iat=clock.wall)
        second = await send(client, gateway, token, proof)
        assert second.status == 200, second.body
        assert second.headers.getall("DPoP-Nonce") == [nonce]

        # A replica with the same nonce_key takes it; past its lifetime nobody does.
        async with running_gateway(config, clock=clock.clock) as replica:
            proof = key.proof("GET", url(replica), token, nonce=nonce, iat=clock.wall)
            assert (await send(client, replica, token, proof)).status == 200
        clock.advance(61)
        late = key.proof("GET", url(gateway), token, nonce=nonce, iat=clock.wall)
        refused = await send(client, gateway, token, late)
        assert refused.status == 401
        assert refused.headers["DPoP-Nonce"] != nonce
        # Bearer tokens need no nonce, and get none.
        bearer = await send(client, gateway, issuer.token("ES256"), scheme="Bearer")
        assert bearer.status == 200
        assert "DPoP-Nonce" not in bearer.headers
