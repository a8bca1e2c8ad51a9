"""A connection's memory of the Authorization value it sent last (pipeline.LastToken) changes
no decision: over generated sequences of requests on one connection, `Pipeline.admit` given
the memory decides each request exactly as it does without it.

Two gateways are started from one configuration, trusting one issuer, on one ManualClock: A
is given every request of the sequence with the connection's one `LastToken`, B the same
request with none. Each has its own verified-token cache, DPoP replay cache, rate-limit
buckets and deny-set, fed the same inputs, so the same proof is shown to both. For each
request the two must agree on everything `admit` decides: admitted or answered, the status,
the reason recorded, the challenges and the body, the principal and the headers the answer
gets; and after each step, on the cache's entries in LRU order and its hits and misses.

The client holds a few tokens of different subjects and scopes, Bearer and DPoP-bound ones,
and sends them again and again, now and then in another spelling or with the wrong scheme,
with a proof made for the request, none, a replayed one or a foreign one; between its
requests come malformed values, two Authorization headers, values longer than
REMEMBERED_AUTHORIZATION_CHARS, the clock moving on (tokens expire, buckets refill), reloads
of the configuration (a route's scopes change, the token cache shrinks and evicts) and
revocations, which both gateways receive from the issuer's event stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.core.exchange import Exchange
from gateway.core.principal import Principal
from gateway.steps.pipeline import REMEMBERED_AUTHORIZATION_CHARS, Admitted, LastToken
from gateway.steps.revocations import SUBJECT_TOKENS_REVOKED, TOKENS_REVOKED
from tests.dpop_proofs import DpopKey
from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    UNBOUND_PORT,
    Background,
    ManualClock,
    RunningGateway,
    TestIssuer,
    issuer_entry,
    low_s_jws,
    start_gateway,
    start_site,
)

HOST = "gateway.test"  # the Host of every request, so a proof's htu is http://gateway.test/...

# ---------------------------------------------------------------------------- the issuer's events


@dataclass
class EventFeed:
    """An issuer's revocation event stream: Server-Sent Events whose data are the SETs the
    test publishes. A subscriber is sent the events after its Last-Event-ID first, then a
    comment line (it is synced), then each event as it is published."""

    url: str = ""
    runner: Any = None
    events: list[tuple[int, str]] = field(default_factory=list)
    queues: list[asyncio.Queue[tuple[int, str] | None]] = field(default_factory=list)

    async def start(self) -> EventFeed:
        app = web.Application()
        app.router.add_get("/events", self._stream)
        self.runner, self.url = await start_site(app)
        return self

    async def stop(self) -> None:
        self.reset()
        await self.runner.cleanup()

    def reset(self) -> None:
        """No events, and every open stream ended."""
        self.events.clear()
        for queue in self.queues:
            queue.put_nowait(None)

    def publish(self, token: str) -> None:
        published = (len(self.events) + 1, token)
        self.events.append(published)
        for queue in self.queues:
            queue.put_nowait(published)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        after = int(request.headers.get("Last-Event-ID", "0"))
        queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        # Subscribed and read with no await between: no event is missed or sent twice.
        self.queues.append(queue)
        earlier = [published for published in self.events if published[0] > after]
        try:
            for number, token in earlier:
                await response.write(f"id: {number}\ndata: {token}\n\n".encode())
            await response.write(b": synced\n\n")
            while (published := await queue.get()) is not None:
                number, token = published
                await response.write(f"id: {number}\ndata: {token}\n\n".encode())
        finally:
            self.queues.remove(queue)
        return response


def signed_set(issuer: TestIssuer, number: int, uri: str, payload: dict[str, Any]) -> str:
    """The Security Event Token of the issuer's event `number`, signed as its events are."""
    claims = {"iss": issuer.url, "iat": int(time.time()), "jti": str(number)}
    claims["events"] = {uri: payload}
    key = issuer.key("ES256")
    headers = {"typ": "secevent+jwt", "kid": key.kid}
    return low_s_jws(jwt.encode(claims, key.private, "ES256", headers))


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Variant:
    """What a reload changes: the scopes of routes, and the size of the token cache."""

    read: tuple[str, ...]  # orders-read: any of
    write: tuple[str, ...]  # orders-write: all of
    legacy: tuple[str, ...]  # legacy (mode: monitor): all of
    bound: tuple[str, ...]  # bound (dpop: required): any of
    cache: int  # token_cache_size


VARIANTS = (
    Variant(
        read=("orders:read", "orders:admin"),
        write=("orders:write", "orders:read"),
        legacy=("admin",),
        bound=("orders:read",),
        cache=3,
    ),
    Variant(("orders:admin",), ("orders:write",), ("admin", "orders:read"), ("orders:read",), 3),
    Variant(("orders:read",), ("orders:write", "orders:read"), ("orders:read",), ("admin",), 1),
    Variant(("admin",), ("orders:read",), ("admin",), ("orders:read", "admin"), 2),
)


def config(issuer: str, feed: str, variant: Variant) -> str:
    def scopes(rule: str, names: Sequence[str]) -> str:
        return f"scopes: {{{rule}: [{', '.join(names)}]}}"

    events = f'{{client_id: gateway, client_secret: secret, url: "{feed}/events"}}'
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "http://127.0.0.1:{UNBOUND_PORT}"}}
reload: {{watch: false}}
token_cache_size: {variant.cache}
issuers:
{issuer_entry(issuer, algorithms=("ES256",), leeway="0s", revocation_events=events)}
routes:
  - {{name: public, path: "/public/**", auth: none}}
  - {{name: orders-read, path: "/orders/**", methods: [GET], {scopes("any", variant.read)}}}
  - {{name: orders-write, path: "/orders/{{id}}", methods: [PUT],
      {scopes("all", variant.write)}}}
  - {{name: legacy, path: "/legacy/**", mode: monitor, {scopes("all", variant.legacy)}}}
  - {{name: bound, path: "/bound/**", dpop: required, {scopes("any", variant.bound)}}}
  - {{name: limited, path: "/limited/**", rate_limit: {{rate: 1/m, burst: 2, key: subject}}}}
  - {{name: other, path: "/**"}}
"""


ROUTES = (
    ("GET", "/orders/1"),
    ("PUT", "/orders/1"),
    ("GET", "/public/x"),
    ("GET", "/legacy/1"),
    ("GET", "/bound/1"),
    ("POST", "/bound/1"),
    ("GET", "/limited/1"),
    ("DELETE", "/elsewhere"),
)

# ---------------------------------------------------------------------------- tokens

# name: (subject, scope, lifetime in seconds, bound to the holder's DPoP key)
TOKENS = {
    "reader": ("alice", "orders:read", 3600, False),
    "writer": ("bob", "orders:read orders:write", 3600, False),
    "admin": ("carol", "admin orders:admin", 3600, False),
    "bound": ("dave", "orders:read admin", 3600, True),
    "brief": ("erin", "orders:read admin", 30, True),
    "passing": ("heidi", "orders:read", 100, False),
    "long": ("frank", "orders:read", 3600, False),  # every value of it too long to remember
    "edge": ("grace", "orders:read", 3600, False),  # its DPoP value remembered, not its Bearer
    "forged": ("alice", "orders:read", 3600, False),  # the reader's, its signature broken
}


@dataclass
class Minted:
    token: str
    claims: dict[str, Any]


def mint(issuer: TestIssuer, holder: DpopKey, now: int, name: str) -> Minted:
    subject, scope, lifetime, bound = TOKENS[name]
    claims: dict[str, Any] = {"sub": subject, "scope": scope, "iat": now, "exp": now + lifetime}
    if bound:
        claims["cnf"] = holder.cnf
    if name == "long":
        claims["padding"] = "x" * REMEMBERED_AUTHORIZATION_CHARS
    if name == "edge":
        return edge(issuer, claims)
    payload = issuer.claims(**claims)
    token = issuer.token("ES256", **payload)
    if name == "forged":
        token = token[:-6] + ("AAAAAA" if not token.endswith("AAAAAA") else "BBBBBB")
    return Minted(token, payload)


def edge(issuer: TestIssuer, claims: dict[str, Any]) -> Minted:
    """A token whose `DPoP` value is as long as a remembered value may be and whose `Bearer`
    value is longer."""
    fits = range(REMEMBERED_AUTHORIZATION_CHARS - 6, REMEMBERED_AUTHORIZATION_CHARS - 4)
    padding = 2600
    for _ in range(40):
        payload = issuer.claims(**claims, padding="x" * padding)
        token = issuer.token("ES256", **payload)
        if len(token) in fits:
            assert len(f"DPoP {token}") <= REMEMBERED_AUTHORIZATION_CHARS < len(f"Bearer {token}")
            return Minted(token, payload)
        missing = fits.start - len(token)  # base64url: 4 characters for 3 bytes
        padding += missing * 3 // 4 or (1 if missing > 0 else -1)
    raise AssertionError("no padding gives a token of the edge's length")


# ---------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class Send:
    """One Authorization header: a token of the issuer, spelt as `spelling` says."""

    token: str
    spelling: str


@dataclass(frozen=True)
class Twice:
    """Two Authorization headers: one token as Bearer, another as DPoP."""

    first: str
    second: str


@dataclass(frozen=True)
class Raw:
    """An Authorization value as given: no token of the issuer in it."""

    value: str


@dataclass(frozen=True)
class Again:
    """The Authorization header(s) of the previous request."""


Authorization = Send | Twice | Raw | Again | None

# {own}: the scheme the token is meant for (DPoP if it is bound, else Bearer); {other}: the
# other one; then other spellings of the schemes, and values with more than a token in them.
SPELLINGS = (
    *["{own} {}"] * 6,
    "{other} {}",
    "bearer {}",
    "DPOP {}",
    "{own}  {}",
    "{own} {} ",
    " {own} {}",
    "{own} {} x",
)
RAW = (
    "",
    "Bearer",
    "Bearer ",
    "DPoP ",
    "Basic dXNlcjpwYXNzd29yZA==",
    "Bearer a,b",
    "Bearer \u00e9t\u00e9",
    "Bearer " + "A" * (REMEMBERED_AUTHORIZATION_CHARS + 10),
    "Bearer " + "A" * (REMEMBERED_AUTHORIZATION_CHARS - 7),
)
# The DPoP proof of a request: none; one made for it by the key bound tokens are bound to;
# the last one made for the same method, URI and token again (a fresh one when there is
# none); one by another key; one for another method, another URI; two.
PROOFS = ("none", *["fresh"] * 4, "replay", "thief", "method", "uri", "two")


@dataclass(frozen=True)
class Request:
    """A request, sent `times` times in a row (each time with a proof of its own)."""

    method: str
    path: str
    authorization: Authorization
    proof: str
    times: int = 1


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Reload:
    variant: int


@dataclass(frozen=True)
class Revoke:
    """The issuer revokes a token by its jti, or every token of its subject issued so far."""

    token: str
    by: str  # jti | subject


Step = Request | Advance | Reload | Revoke

names = st.sampled_from(sorted(TOKENS))


@st.composite
def sequences(draw: Any) -> list[Step]:
    """The steps of one connection, whose client mostly sends the few tokens it holds, and
    now and then anything else."""
    held = draw(st.lists(st.sampled_from([*TOKENS, "bound", "brief"]), min_size=1, max_size=3))
    tokens = st.one_of(st.sampled_from(held), st.sampled_from(held), names)
    authorizations: st.SearchStrategy[Authorization] = st.one_of(
        st.builds(Send, tokens, st.sampled_from(SPELLINGS)),
        st.builds(Send, tokens, st.sampled_from(SPELLINGS)),
        st.just(Again()),
        st.just(Again()),
        st.builds(Twice, tokens, names),
        st.builds(Raw, st.sampled_from(RAW)),
        st.none(),
    )
    step = st.one_of(
        # Six times as likely as each other step (one_of takes a strategy given twice once).
        *(requests(authorizations) for _ in range(6)),
        st.builds(Advance, st.sampled_from([1.0, 5.0, 29.0, 31.0, 61.0, 200.0])),
        st.builds(Reload, st.integers(0, len(VARIANTS) - 1)),
        st.builds(Revoke, tokens, st.sampled_from(["jti", "subject"])),
    )
    return draw(st.lists(step, min_size=10, max_size=40))


@st.composite
def requests(draw: Any, authorizations: st.SearchStrategy[Authorization]) -> Request:
    method, path = draw(st.sampled_from(ROUTES))
    proof = draw(st.sampled_from(PROOFS))
    return Request(method, path, draw(authorizations), proof, draw(st.integers(1, 3)))


# ---------------------------------------------------------------------------- running a sequence


@dataclass(repr=False)  # a falsifying example shows its steps, not the issuer's keys
class World:
    """What every sequence shares: the issuer, its event stream, the DPoP keys, a directory."""

    issuer: TestIssuer
    feed: EventFeed
    holder: DpopKey  # the key bound tokens are bound to
    thief: DpopKey
    directory: Path


@dataclass(frozen=True)
class Sent:
    """A request on the connection, as steps 1 to 8 read it (pipeline.Incoming)."""

    method: str
    raw_path: str
    headers: CIMultiDictProxy[str]
    remote: str = "127.0.0.1"
    scheme: str = "http"
    host: str = HOST
    transport: None = None  # plain HTTP: no client certificate


class Connection:
    """What the client sends on its one connection: the same requests to both gateways."""

    def __init__(self, world: World, clock: ManualClock, tokens: dict[str, Minted]) -> None:
        self.world = world
        self.clock = clock
        self.tokens = tokens
        self.previous: list[str] = []  # the Authorization values of the previous request
        self.made: dict[tuple[str, str, str], str] = {}  # the last proof for (method, URI, token)

    def headers(self, step: Request) -> CIMultiDict[str]:
        values = self.values(step.authorization)
        self.previous = values
        headers: CIMultiDict[str] = CIMultiDict([("Host", HOST)])
        for value in values:
            headers.add("Authorization", value)
        # Proofs are for the token of the first value, whatever its scheme.
        token = values[0].strip().partition(" ")[2].strip() if values else ""
        for proof in self.proofs(step, token):
            headers.add("DPoP", proof)
        return headers

    def values(self, authorization: Authorization) -> list[str]:
        if isinstance(authorization, Again):
            return self.previous
        if isinstance(authorization, Send):
            minted = self.tokens[authorization.token]
            own, other = ("DPoP", "Bearer") if "cnf" in minted.claims else ("Bearer", "DPoP")
            return [authorization.spelling.format(minted.token, own=own, other=other)]
        if isinstance(authorization, Twice):
            first, second = self.tokens[authorization.first], self.tokens[authorization.second]
            return [f"Bearer {first.token}", f"DPoP {second.token}"]
        if isinstance(authorization, Raw):
            return [authorization.value]
        return []

    def proofs(self, step: Request, token: str) -> list[str]:
        holder, iat = self.world.holder, int(self.clock.wall)
        method, uri, kind = step.method, f"http://{HOST}{step.path}", step.proof
        if kind == "none":
            return []
        if kind == "thief":
            return [self.world.thief.proof(method, uri, token, iat=iat)]
        if kind == "method":
            return [holder.proof("PATCH", uri, token, iat=iat)]
        if kind == "uri":
            return [holder.proof(method, uri + "/x", token, iat=iat)]
        made = self.made.get((method, uri, token))
        if kind == "replay" and made is not None:
            return [made]  # the proof last made for this very request
        made = self.made[(method, uri, token)] = holder.proof(method, uri, token, iat=iat)
        if kind == "two":
            return [made, holder.proof(method, uri, token, iat=iat)]
        return [made]


def principal_view(principal: Principal | None) -> Any:
    if principal is None:
        return None
    return (
        principal.issuer,
        principal.subject,
        principal.client_id,
        sorted(principal.scopes),
        principal.audiences,
        principal.expires_at,
        principal.jkt,
        dict(principal.claims),
    )


def decision(pipeline: Any, result: Any, exchange: Exchange) -> Any:
    """Everything `admit` decided about one request: what it was admitted with, or the
    answer that ends it (a refusal given as a value is rendered, as the listener would)."""
    recorded = (exchange.route, exchange.decision, exchange.reason)
    if isinstance(result, Admitted):
        rule = result.plan.rule
        return (
            "admitted",
            rule.name if rule is not None else None,
            principal_view(result.principal),
            result.extra,
            recorded,
            principal_view(exchange.principal),
        )
    answer = result if isinstance(result, web.Response) else pipeline.render(result)
    return (
        "answered",
        answer.status,
        answer.headers.getall("WWW-Authenticate", []),
        sorted(answer.headers.items()),
        answer.body,
        recorded,
        principal_view(getattr(result, "principal", None)),
    )


def state(gateway: RunningGateway) -> Any:
    """What later decisions depend on: the verified-token cache (its entries in LRU order,
    hits and misses) and the number of proofs the replay cache holds."""
    cache = gateway.gateway.token_cache
    return cache.keys(), cache.hits, cache.misses, len(gateway.gateway.replay)  # type: ignore[arg-type]


async def admit_both(
    remembering: RunningGateway,
    forgetting: RunningGateway,
    step: Request,
    headers: CIMultiDict[str],
    last: LastToken,
) -> str:
    """The request admitted by the gateway that remembers (given the connection's memory)
    and by the one that does not, the two decisions compared; what was decided, as a label
    for the statistics."""
    values = headers.getall("Authorization", [])
    remembered = len(values) == 1 and last.recall(values[0]) is not None
    decisions = []
    for gateway, memory in ((remembering, last), (forgetting, None)):
        request = Sent(step.method, step.path, CIMultiDictProxy(headers))
        exchange = Exchange(0.0, "id", step.method, step.path)
        pipeline = gateway.gateway.pipeline
        result = await pipeline.admit(request, exchange, memory)
        decisions.append(decision(pipeline, result, exchange))
    assert decisions[0] == decisions[1], step
    label = f"{exchange.route} {exchange.decision} {exchange.reason or ''}".rstrip()
    if exchange.principal is not None and exchange.principal.jkt is not None:
        label += ", DPoP-bound"
    return f"remembered: {label}" if remembered else label


def revoke(world: World, clock: ManualClock, minted: Minted, by: str) -> None:
    issuer, feed, claims = world.issuer, world.feed, minted.claims
    number = len(feed.events) + 1
    if by == "jti":
        revoked = {"tokens": [{"jti": claims["jti"], "exp": claims["exp"]}]}
        feed.publish(signed_set(issuer, number, TOKENS_REVOKED, revoked))
        return
    subject = {"format": "iss_sub", "iss": issuer.url, "sub": claims["sub"]}
    cut = {"subject": subject, "issued_before": clock.wall + 1, "exp": clock.wall + 3600}
    feed.publish(signed_set(issuer, number, SUBJECT_TOKENS_REVOKED, cut))


async def delivered(published: int, *gateways: RunningGateway) -> None:
    """Until every gateway has applied the events published: within milliseconds here, so
    polled more often than tests.support.wait_for does."""
    deadline = time.monotonic() + 5
    while any(
        sum(stream.applied for stream in gateway.gateway.revocations.streams.values()) < published
        for gateway in gateways
    ):
        assert time.monotonic() < deadline, "the revocation events were not applied"
        await asyncio.sleep(0.001)


async def scenario(world: World, sequence: list[Step]) -> set[str]:
    """The sequence on both gateways, each decision compared; what it met, as labels."""
    issuer, feed = world.issuer, world.feed
    feed.reset()
    clock = ManualClock()
    files = [world.directory / f"{side}.yaml" for side in ("remembering", "forgetting")]
    text = config(issuer.url, feed.url, VARIANTS[0])
    remembering, forgetting = await asyncio.gather(
        *(start_gateway(text, config_file=path, clock=clock.clock) for path in files)
    )
    seen: set[str] = set()
    try:
        now = int(clock.wall)
        tokens = {name: mint(issuer, world.holder, now, name) for name in TOKENS}
        connection = Connection(world, clock, tokens)
        last = LastToken()
        for step in sequence:
            if isinstance(step, Advance):
                clock.advance(step.seconds)
            elif isinstance(step, Reload):
                for path in files:
                    path.write_text(config(issuer.url, feed.url, VARIANTS[step.variant]))
                reloaded = await asyncio.gather(
                    remembering.gateway.reload(), forgetting.gateway.reload()
                )
                assert all(reloaded)
            elif isinstance(step, Revoke):
                revoke(world, clock, tokens[step.token], step.by)
                await delivered(len(feed.events), remembering, forgetting)
            else:
                for _ in range(step.times):
                    headers = connection.headers(step)
                    seen.add(await admit_both(remembering, forgetting, step, headers, last))
            assert state(remembering) == state(forgetting), step
    finally:
        await asyncio.gather(remembering.stop(), forgetting.stop())
    return seen


# ---------------------------------------------------------------------------- the property


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Background, World]]:
    runner = Background()

    async def start() -> World:
        issuer = TestIssuer()
        issuer.add_key("ES256")
        await issuer.start()
        feed = await EventFeed().start()
        directory = tmp_path_factory.mktemp("connection-memory")
        return World(issuer, feed, DpopKey("ES256"), DpopKey("ES256"), directory)

    async def stop(shared: World) -> None:
        await shared.feed.stop()
        await shared.issuer.stop()

    shared = runner.run(start())
    try:
        yield runner, shared
    finally:
        runner.run(stop(shared))
        runner.close()


def connection_memory_property(world: tuple[Background, World], sequence: list[Step]) -> None:
    runner, shared = world
    for label in sorted(runner.run(scenario(shared, sequence))):
        event(label)  # shown by --hypothesis-show-statistics


PROPERTY_SETTINGS: Any = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=60, **PROPERTY_SETTINGS)
@given(sequence=sequences())
def test_a_connection_that_remembers_its_last_token_is_decided_as_one_that_does_not(
    world: tuple[Background, World], sequence: list[Step]
) -> None:
    connection_memory_property(world, sequence)


@pytest.mark.long
@settings(max_examples=1000, **PROPERTY_SETTINGS)
@given(sequence=sequences())
def test_connection_memory_over_many_more_sequences(
    world: tuple[Background, World], sequence: list[Step]
) -> None:
    connection_memory_property(world, sequence)
