"""Forwarding: what the upstream receives, and what the client gets back from it.

Every test runs a real gateway between a real client and a real upstream on 127.0.0.1.
Requests that ordinary clients would normalise or refuse to send go over raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import hashlib
import itertools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from yarl import URL

from gateway import forward
from gateway.forward import header_value, string_header_value
from tests.hypothesis_profiles import examples
from tests.support import (
    RawConnection,
    RunningGateway,
    TestIssuer,
    challenges_of,
    gateway_yaml,
    header_values,
    raw_exchange,
    raw_request,
    refused_exchange,
    running_gateway,
    start_site,
)

IDENTITY = ("X-Auth-Subject", "X-Auth-Client-Id", "X-Auth-Scopes", "X-Auth-Issuer")
HOP_BY_HOP = (
    "Connection",
    "Keep-Alive",
    "Proxy-Connection",
    "Proxy-Authenticate",
    "Proxy-Authorization",
    "TE",
    "Trailer",
    "Upgrade",
)


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    """One ES256 key is all these tests sign with; RSA key generation would only slow them."""
    server = TestIssuer()
    server.add_key("ES256")
    await server.start()
    yield server
    await server.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def normalised_names(seen: dict[str, Any]) -> list[str]:
    """Header names as a CGI/WSGI upstream folds them: case and `_`/`-` ignored."""
    return [name.lower().replace("_", "-") for name, _ in seen["headers"]]


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": []}}


@contextlib.asynccontextmanager
async def scripted_upstream(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """An upstream that answers with whatever `handler` builds."""
    runner, url = await start_site(web.Server(handler))
    try:
        yield url
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------------- identity


async def test_identity_headers_are_set_from_the_verified_token(gateway, issuer, upstream, client):
    token = issuer.token(sub="alice", client_id="cli-7", scope="orders:read orders:admin")
    async with client.get(gateway.url + "/orders/1", headers=bearer(token)) as resp:
        assert resp.status == 200
        seen = await resp.json()
    assert header_values(seen, "X-Auth-Subject") == ["alice"]
    assert header_values(seen, "X-Auth-Client-Id") == ["cli-7"]
    assert header_values(seen, "X-Auth-Scopes") == ["orders:admin orders:read"]
    assert header_values(seen, "X-Auth-Issuer") == [issuer.url]
    assert upstream.requests == [seen]


async def test_a_cached_tokens_identity_headers_are_its_own_on_every_request(
    gateway, issuer, upstream, client
):
    """A principal's identity headers are remembered after its first request: the same
    token gets the same ones again, requests with another token in between get theirs, and
    the client's copies are dropped every time."""
    alice = issuer.token(sub="alice", client_id="cli-a")
    bob = issuer.token(sub="bob", client_id="cli-b", scope="orders:read orders:admin")
    for token in (alice, bob, alice, bob, alice):
        headers = CIMultiDict([("X-Auth-Subject", "forged"), ("Authorization", f"Bearer {token}")])
        async with client.get(gateway.url + "/orders/1", headers=headers) as resp:
            assert resp.status == 200
    identities = [
        [header_values(seen, name)[0] for name in IDENTITY[:3]] for seen in upstream.requests
    ]
    alice_headers = ["alice", "cli-a", "orders:read"]
    bob_headers = ["bob", "cli-b", "orders:admin orders:read"]
    assert identities == [alice_headers, bob_headers, alice_headers, bob_headers, alice_headers]
    assert all(normalised_names(seen).count("x-auth-subject") == 1 for seen in upstream.requests)


async def test_identity_headers_stay_right_as_remembered_principals_make_room(
    issuer, upstream, client, monkeypatch
):
    """Past its bound the forwarder forgets the principal it remembered first; a forgotten
    principal's headers are computed again, and the memory never holds more than the bound."""
    monkeypatch.setattr(forward, "_IDENTITIES_REMEMBERED", 2)
    subjects = ["u0", "u1", "u2", "u0", "u3", "u1", "u0"]
    tokens = {sub: issuer.token(sub=sub, client_id=f"cli-{sub}") for sub in set(subjects)}
    async with running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway:
        for sub in subjects:
            async with client.get(gateway.url + "/orders/1", headers=bearer(tokens[sub])) as resp:
                assert resp.status == 200
        remembered = gateway.gateway.pipeline.forwarder._identities
        assert len(remembered) == 2
        # The two principals used last, the older first.
        assert [p.subject for p in remembered.principals()] == ["u1", "u0"]
    seen = [
        (header_values(r, "X-Auth-Subject"), header_values(r, "X-Auth-Client-Id"))
        for r in upstream.requests
    ]
    assert seen == [([sub], [f"cli-{sub}"]) for sub in subjects]


async def test_remembered_identity_headers_go_with_the_principals_the_token_cache_drops(
    issuer, upstream, client
):
    """The forwarder's memory of identity headers keeps no principal alive: once the token
    cache has let a principal go, so has the memory (it held up to 16,384 with their claims
    beyond a full cache, uncounted by the memory bound `check` prints)."""
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 10\n")
    async with running_gateway(config) as gateway:
        for n in range(120):
            token = issuer.token(sub=f"user-{n}", email=f"user-{n}@example.com" * 20)
            async with client.get(gateway.url + "/orders/1", headers=bearer(token)) as resp:
                assert resp.status == 200
        gc.collect()
        forwarder = gateway.gateway.pipeline.forwarder
        cached = len(gateway.gateway.token_cache)
        assert cached == 10
        # The cache's principals, and the one the last request's connection still holds.
        assert len(forwarder._identities) <= cached + 1


async def test_without_a_token_cache_each_principal_gets_its_own_headers_unremembered(
    issuer, upstream, client
):
    """With the verified-token cache off and no introspection, no principal serves a second
    request: its identity headers are made for its request and not remembered. Principals
    that share a client, scopes and issuer still each get their own subject and claims, in
    the usual order."""
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 0\n" + CLAIMS_YAML)
    async with running_gateway(config) as gateway:
        requests = [
            ("alice", "cli-a", "orders:read", {"email": "alice@example.com"}),
            ("bob", "cli-a", "orders:read", {"level": 2}),
            ("alice", "cli-b", "orders:read orders:admin", {}),
            ("carol", "cli-a", "orders:read", {"email": "carol@example.com", "level": 7}),
        ]
        for sub, client_id, scope, claims in requests:
            token = issuer.token(sub=sub, client_id=client_id, scope=scope, **claims)
            headers = CIMultiDict([("X-Auth-Subject", "forged"), *bearer(token).items()])
            async with client.get(gateway.url + "/orders/1", headers=headers) as resp:
                assert resp.status == 200
        assert len(gateway.gateway.pipeline.forwarder._identities) == 0
    names = ("x-auth-subject", "x-auth-client-id", "x-auth-scopes", "x-auth-issuer")
    seen = [
        [(k.lower(), v) for k, v in r["headers"] if k.lower().startswith("x-auth-")]
        for r in upstream.requests
    ]
    assert seen == [
        [
            *zip(names, ["alice", "cli-a", "orders:read", issuer.url], strict=True),
            ("x-auth-email", "alice@example.com"),
        ],
        [
            *zip(names, ["bob", "cli-a", "orders:read", issuer.url], strict=True),
            ("x-auth-level", "2"),
        ],
        [*zip(names, ["alice", "cli-b", "orders:admin orders:read", issuer.url], strict=True)],
        [
            *zip(names, ["carol", "cli-a", "orders:read", issuer.url], strict=True),
            ("x-auth-email", "carol@example.com"),
            ("x-auth-level", "7"),
        ],
    ]


async def test_long_shared_identity_lines_are_sent_right_and_not_kept(
    gateway, issuer, upstream, client
):
    """The client id, scopes and issuer lines principals share are kept only when short: a
    token with hundreds of scopes gets its full header every time, and leaves nothing kept."""
    scopes = sorted(["orders:read", *(f"extra:{n}" for n in range(300))])
    for n in range(2):
        token = issuer.token(sub=f"many-{n}", scope=" ".join(scopes))
        async with client.get(gateway.url + "/orders/1", headers=bearer(token)) as resp:
            assert resp.status == 200
    assert [header_values(r, "X-Auth-Scopes") for r in upstream.requests] == [
        [" ".join(scopes)]
    ] * 2
    shared = gateway.gateway.pipeline.forwarder._shared_identities
    assert not [key for key in shared if len(key[1]) > 1]


SPOOFED_SPELLINGS = [
    "X-Auth-Subject",
    "x-auth-subject",
    "X-AUTH-SUBJECT",
    "X_Auth_Subject",
    "x_auth_client_id",
    "X-Auth-Client-Id",
    "X-Auth_Scopes",
    "X-AUTH-SCOPES",
    "X-Auth-Issuer",
    "x_auth_issuer",
]


def spoofed_headers() -> list[tuple[str, str]]:
    return [(name, f"forged-{i}") for i, name in enumerate(SPOOFED_SPELLINGS)]


async def test_client_sent_identity_headers_are_replaced_on_protected_routes(
    gateway, issuer, client
):
    token = issuer.token(drop=("client_id",))
    headers = CIMultiDict([*spoofed_headers(), ("Authorization", f"Bearer {token}")])
    async with client.get(gateway.url + "/orders/1", headers=headers) as resp:
        assert resp.status == 200
        seen = await resp.json()
    names = normalised_names(seen)
    assert names.count("x-auth-subject") == 1
    assert names.count("x-auth-scopes") == 1
    assert names.count("x-auth-issuer") == 1
    # The token has no client_id: the forged one must not survive in its place.
    assert "x-auth-client-id" not in names
    assert header_values(seen, "X-Auth-Subject") == ["user-123"]
    assert header_values(seen, "X-Auth-Scopes") == ["orders:read"]
    assert not [v for _, v in seen["headers"] if v.startswith("forged-")]


async def test_public_routes_forward_no_identity_header_at_all(gateway, upstream, client):
    async with client.get(gateway.url + "/public/page", headers=spoofed_headers()) as resp:
        assert resp.status == 200
        seen = await resp.json()
    names = normalised_names(seen)
    assert not [n for n in names if n in {h.lower() for h in IDENTITY}]
    assert not [v for _, v in seen["headers"] if v.startswith("forged-")]
    assert len(upstream.requests) == 1


CLAIMS_YAML = """
identity_headers:
  claims: {X-Auth-Email: email, X-Auth-Groups: groups, X-Auth-Address: address,
           X-Auth-Level: level, X-Auth-Name: name}
"""


@pytest.fixture
async def claims_gateway(issuer, upstream) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, extra=CLAIMS_YAML)) as gw:
        yield gw


async def test_mapped_claims_are_forwarded_and_non_strings_are_json_encoded(
    claims_gateway, issuer, client
):
    token = issuer.token(
        email="alice@example.com",
        groups=["staff", "ops"],
        address={"country": "NL", "city": "Delft"},
        level=3,
    )
    spoofed = [("X-Auth-Name", "forged"), ("x_auth_email", "forged")]
    headers = CIMultiDict([*spoofed, *bearer(token).items()])
    async with client.get(claims_gateway.url + "/orders/1", headers=headers) as resp:
        assert resp.status == 200
        seen = await resp.json()
    assert header_values(seen, "X-Auth-Email") == ["alice@example.com"]
    assert json.loads(header_values(seen, "X-Auth-Groups")[0]) == ["staff", "ops"]
    assert header_values(seen, "X-Auth-Groups") == ['["staff","ops"]']
    assert json.loads(header_values(seen, "X-Auth-Address")[0]) == {
        "country": "NL",
        "city": "Delft",
    }
    assert header_values(seen, "X-Auth-Level") == ["3"]
    # The token has no `name`: the client's copy is removed and nothing is put in its place.
    assert "x-auth-name" not in normalised_names(seen)
    assert normalised_names(seen).count("x-auth-email") == 1


@pytest.mark.parametrize(
    "claims",
    [
        {"email": "a@example.com\r\nX-Injected: 1"},
        {"email": "a@example.com\n"},
        {"email": "a@example.com\rX-Injected: 1"},
        {"name": "Zoë Ünal"},
        {"name": "名前\r\nX-Injected: 1"},
        {"sub": "user-123\n"},
        {"groups": ["ok", "bad\r\nX-Injected: 1"]},
    ],
)
async def test_claims_with_line_breaks_or_non_ascii_cannot_inject_a_header(
    claims_gateway, issuer, upstream, client, claims
):
    token = issuer.token(**claims)
    async with client.get(claims_gateway.url + "/orders/1", headers=bearer(token)) as resp:
        assert resp.status == 200, await resp.text()
        seen = await resp.json()
    assert "x-injected" not in normalised_names(seen)
    headers = {"email": "X-Auth-Email", "name": "X-Auth-Name", "sub": "X-Auth-Subject"}
    headers["groups"] = "X-Auth-Groups"
    for claim, value in claims.items():
        [sent] = header_values(seen, headers[claim])
        assert all(0x20 <= ord(c) < 0x7F for c in sent)
        assert json.loads(sent) == value  # nothing lost: the upstream can decode it
    assert len(upstream.requests) == 1


# The reading the README gives upstreams for each kind of identity header.


def read_string_header(text: str) -> str:
    """X-Auth-Subject, -Client-Id, -Issuer: a JSON string when it starts with `"`, else as is."""
    if text.startswith('"'):
        value = json.loads(text)
        assert isinstance(value, str)
        return value
    return text


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def read_claim_header(text: str) -> Any:
    """A claim header: the JSON value when the text is JSON (RFC 8259), else the text."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except ValueError:
        return text


def canonical(value: Any) -> str:
    """One spelling per JSON value, types kept apart (1 vs 1.0 vs true)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=True)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("é", '"\\u00e9"'),  # é, and the 8 characters "\u00e9" in quotes
        ('"alice"', "alice"),
        ("alice ", "alice"),  # a server strips the trailing space of a field value
        (" alice", "alice"),
        ("a\tb", '"a\\tb"'),
    ],
    ids=["escaped-look-alike", "quoted", "trailing-space", "leading-space", "tab"],
)
async def test_distinct_subjects_never_reach_the_upstream_as_the_same_header(
    gateway, issuer, upstream, client, first, second
):
    received = []
    for subject in (first, second):
        async with client.get(
            gateway.url + "/orders/1", headers=bearer(issuer.token(sub=subject))
        ) as resp:
            assert resp.status == 200, await resp.text()
            [sent] = header_values(await resp.json(), "X-Auth-Subject")
        received.append(sent)
    assert received[0] != received[1]
    assert [read_string_header(r) for r in received] == [first, second]


async def test_distinct_claim_values_never_reach_the_upstream_as_the_same_header(
    claims_gateway, issuer, client
):
    values: list[Any] = [
        5, "5", 5.0, True, "true", False, "false", "null",
        [1], "[1]", {"a": 1}, '{"a":1}', "é", '"\\u00e9"', "", '""', "-1", -1, "1e3", 1000.0,
        "plain text", " padded ", "NaN", "\x7f",
    ]  # fmt: skip
    received = []
    for value in values:
        async with client.get(
            claims_gateway.url + "/orders/1", headers=bearer(issuer.token(level=value))
        ) as resp:
            assert resp.status == 200, await resp.text()
            [sent] = header_values(await resp.json(), "X-Auth-Level")
        received.append(sent)
        assert all(0x20 <= ord(c) < 0x7F for c in sent), sent
        assert canonical(read_claim_header(sent)) == canonical(value), (value, sent)
    assert len(set(received)) == len(values), list(zip(values, received, strict=True))
    # Strings that cannot be read as JSON go as they are; the others as they always did.
    assert received[values.index("plain text")] == "plain text"
    assert received[values.index(5)] == "5"
    assert received[values.index("5")] == '"5"'


TRICKY_TEXT = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7F), max_size=12),
    st.sampled_from(
        ["", " ", "5", "-0", "1e5", "0.5", "true", "false", "null", "NaN", "Infinity", "-Infinity",
         '"', '""', '"x"', "[", "[1]", "{", "{}", " a", "a ", "\x7f", "é", '"\\u00e9"', "01"]
    ),
)  # fmt: skip
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY_TEXT, inner, max_size=3),
    max_leaves=6,
)


def _assert_field_value(sent: str) -> None:
    """Visible ASCII, inner spaces only (RFC 9110 §5.5): nothing a server would trim or refuse."""
    assert sent
    assert all(0x20 <= ord(c) < 0x7F for c in sent), sent
    assert sent == sent.strip(" \t"), sent


@settings(max_examples=examples(500), deadline=None)
@given(value=JSON_VALUES)
def test_every_claim_value_is_sent_as_a_field_value_the_upstream_reads_back_exactly(value):
    sent = header_value(value)
    _assert_field_value(sent)
    assert canonical(read_claim_header(sent)) == canonical(value)


@settings(max_examples=examples(500), deadline=None)
@given(
    first=JSON_VALUES,
    second=JSON_VALUES | JSON_VALUES.map(canonical) | JSON_VALUES.map(str),
)
def test_distinct_claim_values_never_give_the_same_header_value(first, second):
    if canonical(first) != canonical(second):
        assert header_value(first) != header_value(second)


@settings(max_examples=examples(500), deadline=None)
@given(first=TRICKY_TEXT, second=TRICKY_TEXT | TRICKY_TEXT.map(json.dumps))
def test_distinct_strings_never_give_the_same_subject_header(first, second):
    for text in (first, second):
        _assert_field_value(string_header_value(text))
        assert read_string_header(string_header_value(text)) == text
    if first != second:
        assert string_header_value(first) != string_header_value(second)


# ---------------------------------------------------------------------------- hop-by-hop


async def test_hop_by_hop_request_headers_and_those_named_in_connection_are_removed(
    gateway, upstream
):
    request = raw_request(
        "GET",
        "/public/x",
        [
            ("Connection", "keep-alive, X-Secret-Hop"),
            ("X-Secret-Hop", "1"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Connection", "keep-alive"),
            ("TE", "trailers"),
            ("Trailer", "X-Checksum"),
            ("Upgrade", "h2c"),
            ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
            ("X-End-To-End", "kept"),
        ],
    )
    answer = await raw_exchange(gateway.url, request)
    assert answer.status == 200
    seen = answer.json()
    names = {n.lower() for n, _ in seen["headers"]}
    assert names.isdisjoint({h.lower() for h in HOP_BY_HOP} | {"x-secret-hop"})
    assert header_values(seen, "X-End-To-End") == ["kept"]
    assert upstream.requests == [seen]


async def test_chunked_request_body_is_reframed_not_passed_with_the_clients_coding(
    gateway, upstream
):
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    request = raw_request(
        "POST", "/public/x", [("Transfer-Encoding", "chunked"), ("Connection", "close")], body
    )
    answer = await raw_exchange(gateway.url, request)
    assert answer.status == 200
    seen = answer.json()
    assert seen["body_size"] == len(b"hello world")
    assert seen["body_sha256"] == hashlib.sha256(b"hello world").hexdigest()
    # At most the gateway's own framing of the upstream request, never a second coding.
    assert header_values(seen, "Transfer-Encoding") in ([], ["chunked"])


async def test_hop_by_hop_response_headers_and_those_named_in_connection_are_removed(
    issuer, client
):
    async def handler(request: web.BaseRequest) -> web.Response:
        return web.Response(
            text="ok",
            headers={
                "Connection": "keep-alive, X-Secret-Hop, X-Other-Hop",
                "X-Secret-Hop": "1",
                "X-Other-Hop": "2",
                "Keep-Alive": "timeout=5",
                "Proxy-Authenticate": 'Basic realm="up"',
                "Proxy-Connection": "keep-alive",
                "Trailer": "X-Checksum",
                "Upgrade": "h2c",
                "X-End-To-End": "kept",
            },
        )

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
        client.get(gw.url + "/public/x") as resp,
    ):
        assert resp.status == 200
        assert await resp.text() == "ok"
        names = {n.lower() for n in resp.headers}
    removed = {h.lower() for h in HOP_BY_HOP if h != "Connection"} | {"x-secret-hop", "x-other-hop"}
    assert names.isdisjoint(removed)
    assert resp.headers.getall("Connection", []) in ([], ["keep-alive"])
    assert resp.headers["X-End-To-End"] == "kept"


async def test_echo_upstream_connection_named_header_never_reaches_the_client(gateway, client):
    async with client.get(gateway.url + "/public/x") as resp:
        assert resp.status == 200
        assert resp.headers["X-Upstream"] == "echo"  # the end-to-end header does pass
        assert "X-Secret-Hop" not in resp.headers


# ---------------------------------------------------------------------------- X-Forwarded-*

# RFC 7239 §4: forwarded-element = [ forwarded-pair ] *( ";" [ forwarded-pair ] )
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_PAIR = re.compile(rf'({_TOKEN})=({_TOKEN}|"(?:[^"\\]|\\.)*")')


def parse_forwarded(value: str) -> list[dict[str, str]]:
    """Forwarded elements as dicts; fails on anything outside the RFC 7239 grammar."""
    elements = []
    for element in value.split(","):
        pairs = {}
        for pair in element.strip().split(";"):
            match = _PAIR.fullmatch(pair)
            assert match, f"not RFC 7239: {pair!r} in {value!r}"
            name, raw = match.groups()
            assert name.lower() not in pairs, f"{name} twice in one element of {value!r}"
            pairs[name.lower()] = raw[1:-1] if raw.startswith('"') else raw
        elements.append(pairs)
    return elements


async def test_forwarding_headers_are_appended_to_or_replaced(gateway, client):
    headers = CIMultiDict(
        [
            ("X-Forwarded-For", "203.0.113.7"),
            ("X-Forwarded-For", "198.51.100.2"),
            ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", "evil.example"),
            ("Forwarded", 'for=192.0.2.60;proto=https;by="[2001:db8::1]"'),
            ("Via", "1.0 fred"),
        ]
    )
    async with client.get(gateway.url + "/public/x", headers=headers) as resp:
        assert resp.status == 200
        seen = await resp.json()
    host = gateway.url.split("://", 1)[1]
    assert header_values(seen, "X-Forwarded-For") == ["203.0.113.7, 198.51.100.2, 127.0.0.1"]
    assert header_values(seen, "X-Forwarded-Proto") == ["http"]
    assert header_values(seen, "X-Forwarded-Host") == [host]
    [forwarded] = header_values(seen, "Forwarded")
    assert parse_forwarded(forwarded) == [
        {"for": "192.0.2.60", "proto": "https", "by": "[2001:db8::1]"},
        {"for": "127.0.0.1", "proto": "http", "host": host},
    ]
    assert header_values(seen, "Via") == ["1.0 fred, 1.1 portcullis"]


async def test_forwarding_headers_are_added_when_the_client_sent_none(gateway, client):
    async with client.get(gateway.url + "/public/x") as resp:
        seen = await resp.json()
    host = gateway.url.split("://", 1)[1]
    assert header_values(seen, "X-Forwarded-For") == ["127.0.0.1"]
    assert parse_forwarded(header_values(seen, "Forwarded")[0]) == [
        {"for": "127.0.0.1", "proto": "http", "host": host}
    ]
    assert header_values(seen, "Via") == ["1.1 portcullis"]


@pytest.mark.parametrize(
    "host", ['a";for=6.6.6.6;by="x', "a,for=1.2.3.4", "ex\\ample", "a b", 'x"']
)
async def test_a_host_that_would_forge_a_forwarded_element_is_left_out(gateway, host):
    answer = await raw_exchange(gateway.url, raw_request("GET", "/public/x", [("Host", host)]))
    assert answer.status == 200
    seen = answer.json()
    [forwarded] = header_values(seen, "Forwarded")
    assert parse_forwarded(forwarded) == [{"for": "127.0.0.1", "proto": "http"}]
    assert header_values(seen, "X-Forwarded-Host") == []


async def test_a_bracketed_ipv6_host_is_kept_in_forwarded(gateway):
    answer = await raw_exchange(
        gateway.url, raw_request("GET", "/public/x", [("Host", "[2001:db8::5]:8443")])
    )
    seen = answer.json()
    assert parse_forwarded(header_values(seen, "Forwarded")[0]) == [
        {"for": "127.0.0.1", "proto": "http", "host": "[2001:db8::5]:8443"}
    ]
    assert header_values(seen, "X-Forwarded-Host") == ["[2001:db8::5]:8443"]


# ---------------------------------------------------------------------------- the head on the wire


@dataclass
class HeadUpstream:
    """An upstream that keeps each request head as the bytes it read, reads the body its
    Content-Length announces, and answers 204 with `Connection: close`."""

    url: str = ""
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = re.search(rb"\r\ncontent-length: *([0-9]+)\r\n", head, re.IGNORECASE)
            self.bodies.append(await reader.readexactly(int(length[1])) if length else b"")
            writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def head_upstream() -> AsyncIterator[HeadUpstream]:
    upstream = HeadUpstream()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()


def head_lines(head: bytes) -> list[bytes]:
    """A head's lines, the random parent id of a continued traceparent replaced by `P`s."""
    head = re.sub(
        rb"(\r\ntraceparent: 00-[0-9a-f]{32}-)[0-9a-f]{16}(-01\r\n)",
        rb"\1" + b"P" * 16 + rb"\2",
        head,
    )
    return head.split(b"\r\n")


async def test_the_upstream_gets_the_request_head_byte_for_byte(issuer):
    """Every field in the order the client sent it, bytes that are not ASCII unchanged, then
    the gateway's own fields in a fixed order, then the identity headers."""
    token = issuer.token(email="alice@example.com")
    async with head_upstream() as upstream:
        extra = "identity_headers: {claims: {X-Auth-Email: email, X-Auth-Name: name}}"
        async with running_gateway(gateway_yaml(issuer.url, upstream.url, extra=extra)) as gw:
            request = (
                b"GET /orders/1?q=%C3%A9&r HTTP/1.1\r\n"
                b"Host: api.example:8443\r\n"
                b"User-Agent: probe/1.0\r\n"
                b"X-Latin: caf\xe9\r\n"
                b"X-Utf8: caf\xc3\xa9\r\n"
                b'x-lower: a:b, "c"\t d\r\n'
                b"X-Empty:\r\n"
                b"Authorization: Bearer " + token.encode() + b"\r\n"
                b"X-Auth-Subject: forged\r\n"
                b"x_auth_email: forged\r\n"
                b"X-Forwarded-For: 203.0.113.7\r\n"
                b"X-Forwarded-For: 198.51.100.2 \xe9\r\n"
                b"Forwarded: for=192.0.2.60\r\n"
                b"Via: 1.0 fred\r\n"
                b"X-Request-Id: req-42\r\n"
                b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
                b"tracestate: vendor=1\r\n"
                b"Connection: keep-alive, X-Hop\r\n"
                b"X-Hop: dropped\r\n"
                b"Keep-Alive: timeout=5\r\n"
                b"Accept: */*\r\n"
                b"\r\n"
            )
            answer = await raw_exchange(gw.url, request)
    assert answer.status == 204
    port = upstream.url.rsplit(":", 1)[1]
    assert head_lines(upstream.heads[0]) == [
        b"GET /orders/1?q=%C3%A9&r HTTP/1.1",
        b"Host: 127.0.0.1:" + port.encode(),
        b"User-Agent: probe/1.0",
        b"X-Latin: caf\xe9",
        b"X-Utf8: caf\xc3\xa9",
        b'x-lower: a:b, "c"\t d',
        b"X-Empty: ",
        b"Authorization: Bearer " + token.encode(),
        b"tracestate: vendor=1",
        b"Accept: */*",
        b"X-Forwarded-For: 203.0.113.7, 198.51.100.2 \xe9, 127.0.0.1",
        b"X-Forwarded-Proto: http",
        b"X-Forwarded-Host: api.example:8443",
        b'Forwarded: for=192.0.2.60, for=127.0.0.1;proto=http;host="api.example:8443"',
        b"Via: 1.0 fred, 1.1 portcullis",
        b"X-Request-Id: req-42",
        b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-PPPPPPPPPPPPPPPP-01",
        b"X-Auth-Subject: user-123",
        b"X-Auth-Client-Id: webapp",
        b"X-Auth-Scopes: orders:read",
        b"X-Auth-Issuer: " + issuer.url.encode(),
        b"X-Auth-Email: alice@example.com",
        b"",
        b"",
    ]


async def test_a_new_trace_a_kept_host_and_a_body_on_get_shape_the_upstream_head(issuer):
    """A new trace drops the client's tracestate; `preserve_host` sends the client's Host;
    the body is framed by the gateway's own Content-Length, last, in place of the client's;
    a body on GET adds `Connection: close` (RFC 9112 §9.6)."""
    async with head_upstream() as upstream:
        config = gateway_yaml(issuer.url, upstream.url, extra_routes=BODY_ON_GET_ROUTE).replace(
            "read_timeout: 2s", "read_timeout: 2s, preserve_host: true"
        )
        async with running_gateway(config) as gw:
            fields = [
                ("Content-Length", "5"),
                ("traceparent", "00-00000000000000000000000000000000-b7ad6b7169203331-01"),
                ("TraceState", "vendor=1"),
                ("X-Request-Id", "bad id"),
            ]
            for target in ("/search/x", "/public/x"):
                request = raw_request(
                    "GET" if target == "/search/x" else "POST",
                    target,
                    fields,
                    b"hello",
                    host="api.example",
                )
                assert (await raw_exchange(gw.url, request)).status == 204
    assert upstream.bodies == [b"hello", b"hello"]
    for head, method in zip(upstream.heads, ("GET /search/x", "POST /public/x"), strict=True):
        lines = head.decode("latin-1").split("\r\n")
        sent = dict(line.split(": ", 1) for line in lines[1:-2])
        request_id, traceparent = sent["X-Request-Id"], sent["traceparent"]
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", traceparent)
        assert traceparent[3:35] != "0" * 32
        expected = [
            f"{method} HTTP/1.1",
            "Host: api.example",
            "X-Forwarded-For: 127.0.0.1",
            "X-Forwarded-Proto: http",
            "X-Forwarded-Host: api.example",
            'Forwarded: for=127.0.0.1;proto=http;host="api.example"',
            "Via: 1.1 portcullis",
            f"X-Request-Id: {request_id}",
            f"traceparent: {traceparent}",
        ]
        if method.startswith("GET"):
            expected.append("Connection: close")
        expected.append("Content-Length: 5")
        assert lines == [*expected, "", ""]


@pytest.mark.parametrize(
    "field",
    [
        b"X-A: a\rX-Injected: 1",
        b"X-A: a\nX-Injected: 1",
        b"X-A: a\x00X-Injected: 1",
        b"X-A: a\r\n X-Injected: 1",
        b"X\rInjected: 1",
        b"X\x00Injected: 1",
        b"X-Forwarded-For: 1.2.3.4\rX-Injected: 1",
        b"Forwarded: for=1.2.3.4\nX-Injected: 1",
        b"Via: 1.0 fred\x00X-Injected: 1",
        b"Host: a\rX-Injected: 1",
    ],
    ids=[
        "cr-in-value",
        "lf-in-value",
        "nul-in-value",
        "folded-line",
        "cr-in-name",
        "nul-in-name",
        "cr-in-x-forwarded-for",
        "lf-in-forwarded",
        "nul-in-via",
        "cr-in-host",
    ],
)
async def test_a_client_field_holding_cr_lf_or_nul_is_refused_and_never_forwarded(issuer, field):
    """The listener's parser refuses these (400): no client name or value that reaches the
    forwarder holds CR, LF or NUL, so none can add a field to the upstream request."""
    request = b"GET /public/x HTTP/1.1\r\n" + field + b"\r\nX-B: b\r\n\r\n"
    if not field.startswith(b"Host"):
        request = request.replace(b"\r\n", b"\r\nHost: gateway.test\r\n", 1)
    async with (
        head_upstream() as upstream,
        running_gateway(gateway_yaml(issuer.url, upstream.url)) as gw,
    ):
        answer = await raw_exchange(gw.url, request)
    assert answer.status == 400
    assert upstream.heads == []


# ---------------------------------------------------------------------------- request id


async def test_underscore_spellings_of_the_gateways_own_headers_are_removed(gateway, client):
    # A CGI/WSGI upstream folds `X_Forwarded_Host` into the same variable as the gateway's
    # `X-Forwarded-Host`: the client's copy would stand beside (or instead of) the real one.
    forged = [
        ("X_Forwarded_Host", "evil.example"),
        ("x_forwarded_proto", "https"),
        ("X_Forwarded_For", "6.6.6.6"),
        ("X_FORWARDED-HOST", "evil.example"),
        ("X_Request_Id", "forged-id"),
    ]
    async with client.get(
        gateway.url + "/public/x", headers=CIMultiDict([*forged, ("X-Request-Id", "real-id")])
    ) as resp:
        assert resp.status == 200
        seen = await resp.json()
    names = normalised_names(seen)
    for name in ("x-forwarded-host", "x-forwarded-proto", "x-forwarded-for", "x-request-id"):
        assert names.count(name) == 1, name
    values = {v for _, v in seen["headers"]}
    assert values.isdisjoint({"evil.example", "6.6.6.6", "forged-id"})
    assert header_values(seen, "X-Request-Id") == ["real-id"]
    assert header_values(seen, "X-Forwarded-Proto") == ["http"]


async def test_well_formed_request_id_is_kept_and_returned(gateway, client):
    headers = {"X-Request-Id": "req-42.a:b@c/d+e=f"}
    async with client.get(gateway.url + "/public/x", headers=headers) as resp:
        seen = await resp.json()
        assert resp.headers.getall("X-Request-Id") == ["req-42.a:b@c/d+e=f"]
    assert header_values(seen, "X-Request-Id") == ["req-42.a:b@c/d+e=f"]


@pytest.mark.parametrize("given", [None, "bad id", "x" * 129, "<script>", "", "a;b"])
async def test_missing_or_malformed_request_id_is_replaced_by_a_generated_one(
    gateway, client, given
):
    headers = {"X-Request-Id": given} if given is not None else {}
    async with client.get(gateway.url + "/public/x", headers=headers) as resp:
        seen = await resp.json()
        returned = resp.headers.getall("X-Request-Id")
    assert header_values(seen, "X-Request-Id") == returned
    assert len(returned) == 1
    assert re.fullmatch(r"[0-9a-f]{32}", returned[0])


async def test_two_requests_without_id_get_different_ids(gateway, client):
    ids = []
    for _ in range(2):
        async with client.get(gateway.url + "/public/x") as resp:
            ids.append(resp.headers["X-Request-Id"])
    assert ids[0] != ids[1]


@pytest.mark.parametrize(
    ("method", "target", "status"),
    [("GET", "/orders/1", 401), ("GET", "/public/a/../b", 400)],
)
async def test_request_id_is_returned_on_error_responses(gateway, upstream, method, target, status):
    given = raw_request(method, target, [("X-Request-Id", "trace-1")])
    answer = await raw_exchange(gateway.url, given)
    assert answer.status == status
    assert answer.headers.getall("X-Request-Id") == ["trace-1"]
    generated = await raw_exchange(gateway.url, raw_request(method, target))
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["X-Request-Id"])
    assert upstream.requests == []


async def test_request_id_is_returned_on_404(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url).replace('  - {name: other, path: "/**"}\n', "")
    async with (
        running_gateway(config) as gw,
        client.get(gw.url + "/nowhere", headers={"X-Request-Id": "t-404"}) as resp,
    ):
        assert resp.status == 404
        assert resp.headers["X-Request-Id"] == "t-404"
        assert await resp.json() == error_body(
            "not_found", "No route of this gateway serves this request."
        )
    assert upstream.requests == []


# ---------------------------------------------------------------------------- Authorization


async def test_authorization_is_forwarded_by_default(gateway, issuer, client):
    token = issuer.token()
    async with client.get(gateway.url + "/orders/1", headers=bearer(token)) as resp:
        seen = await resp.json()
    assert header_values(seen, "Authorization") == [f"Bearer {token}"]


async def test_strip_authorization_removes_the_token_upstream(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, extra="forward: {strip_authorization: true}")
    async with running_gateway(config) as gw:
        async with client.get(gw.url + "/orders/1", headers=bearer(issuer.token())) as resp:
            assert resp.status == 200
            seen = await resp.json()
        # On a public route too: a token the route did not check is not passed on either.
        async with client.get(gw.url + "/public/x", headers=bearer("opaque-token")) as resp:
            public_seen = await resp.json()
    assert "authorization" not in normalised_names(seen)
    assert header_values(seen, "X-Auth-Subject") == ["user-123"]
    assert "authorization" not in normalised_names(public_seen)


# ---------------------------------------------------------------------------- method, path, query

TARGETS = [
    "/orders/a%20b?q=%2F&x=1&x=2&empty=&flag",
    "/orders/a+b?q=a+b&q=c%2Bd",
    "/orders/%E2%82%AC%20%C3%A9t%C3%A9?name=%e2%82%ac&name=%E2%82%AC",
    "/orders/~user/(1)!$&'*,=:@?k=%7e&k=~&&=&%3D=%26",
    "/orders/7?a=1&a=1&a=2&A=3",
]


@pytest.mark.parametrize("target", TARGETS)
async def test_path_and_query_reach_the_upstream_byte_for_byte(gateway, issuer, target):
    token = issuer.token()
    answer = await raw_exchange(
        gateway.url, raw_request("GET", target, [("Authorization", f"Bearer {token}")])
    )
    assert answer.status == 200, answer.body
    assert answer.json()["raw_path"] == target
    assert answer.json()["method"] == "GET"


@pytest.mark.parametrize("method", ["PUT", "DELETE", "POST"])
async def test_method_reaches_the_upstream_unchanged(gateway, issuer, client, method):
    token = issuer.token(scope="orders:read orders:write")
    url = URL(gateway.url + "/orders/9?v=%2F", encoded=True)
    async with client.request(method, url, headers=bearer(token)) as r:
        assert r.status == 200
        seen = await r.json()
    assert seen["method"] == method
    assert seen["raw_path"] == "/orders/9?v=%2F"


@pytest.mark.parametrize("method", ["PATCH", "OPTIONS", "PROPFIND", "PURGE"])
async def test_uncommon_methods_reach_the_upstream_unchanged(gateway, issuer, method):
    token = issuer.token()
    answer = await raw_exchange(
        gateway.url, raw_request(method, "/anything/x?y", [("Authorization", f"Bearer {token}")])
    )
    assert answer.status == 200
    assert answer.json()["method"] == method
    assert answer.json()["raw_path"] == "/anything/x?y"


# ---------------------------------------------------------------------------- method override

METHOD_OVERRIDES = [
    ("X-HTTP-Method-Override", "DELETE"),
    ("X-Method-Override", "DELETE"),
    ("X-HTTP-Method", "DELETE"),
    ("x_http_method_override", "DELETE"),
    ("X-Http-Method_Override", "DELETE"),
]


async def test_method_override_headers_are_dropped_so_a_read_token_cannot_delete(
    gateway, issuer, upstream, client
):
    # A GET with a read-only token passes the route for reading; an upstream that honours an
    # override header would run it as a DELETE.
    headers = CIMultiDict([*METHOD_OVERRIDES, *bearer(issuer.token()).items()])
    async with client.get(gateway.url + "/orders/1", headers=headers) as resp:
        assert resp.status == 200
        seen = await resp.json()
    names = normalised_names(seen)
    assert not {"x-http-method-override", "x-method-override", "x-http-method"} & set(names)
    assert seen["method"] == "GET"


async def test_strip_method_override_false_passes_the_headers_on(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url, extra="forward: {strip_method_override: false}")
    async with running_gateway(config) as gw:
        headers = CIMultiDict([("X-HTTP-Method-Override", "PATCH"), ("X-HTTP-Method", "PUT")])
        async with client.post(gw.url + "/public/x", headers=headers) as resp:
            seen = await resp.json()
    assert header_values(seen, "X-HTTP-Method-Override") == ["PATCH"]
    assert header_values(seen, "X-HTTP-Method") == ["PUT"]


async def test_upstream_url_path_prefix_is_prepended(issuer, upstream):
    config = gateway_yaml(issuer.url, upstream.url + "/api/v1/")
    async with running_gateway(config) as gw:
        answer = await raw_exchange(gw.url, raw_request("GET", "/public/a%20b?q=%2F&q"))
    assert answer.status == 200
    assert answer.json()["raw_path"] == "/api/v1/public/a%20b?q=%2F&q"


# ---------------------------------------------------------------------------- refused requests


async def test_unmatched_path_is_404_with_error_body_and_not_forwarded(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url).replace('  - {name: other, path: "/**"}\n', "")
    async with running_gateway(config) as gw:
        token = issuer.token()
        async with client.get(gw.url + "/elsewhere/1", headers=bearer(token)) as resp:
            assert resp.status == 404
            assert resp.content_type == "application/json"
            assert "WWW-Authenticate" not in resp.headers
            assert await resp.json() == error_body(
                "not_found", "No route of this gateway serves this request."
            )
    assert upstream.requests == []


@pytest.mark.parametrize(
    "target",
    [
        "/public/a/../b",
        "/public/a/./b",
        "/public/a/%2e%2e/b",
        "/public/a/%2E%2E/b",
        "/public/a%2Fb",
        "/public/a%2fb",
        "/public/a%5Cb",
        "/public//b",
        "/public/..",
        "/public/x#/../../orders/1",
        "/public/x?q=1#frag",
    ],
)
async def test_ambiguous_paths_are_refused_with_400_and_never_forwarded(gateway, upstream, target):
    answer = await raw_exchange(gateway.url, raw_request("GET", target))
    assert answer.status == 400
    assert answer.headers["Content-Type"] == "application/json"
    body = answer.json()
    assert body["error"]["code"] == "bad_request"
    assert body["error"]["details"] == []
    assert body["error"]["message"].startswith("The request")
    assert upstream.requests == []


async def test_a_fragment_cannot_carry_a_public_request_to_a_protected_path(issuer, upstream):
    routes = (
        '  - {name: secret, path: "/docs/secret"}\n  - {name: docs, path: "/docs/**", auth: none}'
    )
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, routes)) as gw:
        public = await raw_exchange(gw.url, raw_request("GET", "/docs/readme"))
        protected = await raw_exchange(gw.url, raw_request("GET", "/docs/secret"))
        smuggled = await raw_exchange(gw.url, raw_request("GET", "/docs/secret#"))
    assert public.status == 200
    assert protected.status == 401
    assert smuggled.status == 400
    assert smuggled.json() == error_body("bad_request", "The request target must not contain '#'.")
    assert [seen["raw_path"] for seen in upstream.requests] == ["/docs/readme"]


# ---------------------------------------------------------------------------- responses


@pytest.mark.parametrize("size", [11, 300_000], ids=["buffered", "streamed"])
async def test_status_reason_and_end_to_end_headers_come_back_unchanged(issuer, client, size):
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)

    async def handler(request: web.BaseRequest) -> web.Response:
        headers = CIMultiDict(
            [
                ("Set-Cookie", "a=1; Path=/; HttpOnly"),
                ("Set-Cookie", "b=2; Path=/; Secure"),
                ("Cache-Control", "private, max-age=60"),
                ("ETag", '"v1"'),
                ("X-Request-Id", "upstream-chose-this"),
                ("X-Custom", "value"),
            ]
        )
        return web.Response(
            status=201, reason="Made It", body=body, headers=headers, content_type="text/x-test"
        )

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
        client.post(gw.url + "/public/x", headers={"X-Request-Id": "mine"}) as resp,
    ):
        assert resp.status == 201
        assert resp.reason == "Made It"
        assert resp.headers.getall("Set-Cookie") == ["a=1; Path=/; HttpOnly", "b=2; Path=/; Secure"]
        assert resp.headers["Cache-Control"] == "private, max-age=60"
        assert resp.headers["ETag"] == '"v1"'
        assert resp.headers["X-Custom"] == "value"
        assert resp.headers["Content-Type"] == "text/x-test"
        assert resp.headers.getall("X-Request-Id") == ["mine"]
        assert await resp.read() == body


@pytest.mark.parametrize("size", [2_000, 400_000], ids=["buffered", "streamed"])
async def test_gzip_encoded_upstream_body_is_passed_through_without_decompression(
    issuer, client, size
):
    plain = b"".join(b"line %d of the document\n" % i for i in range(size // 20))
    compressed = gzip.compress(plain)

    async def handler(request: web.BaseRequest) -> web.Response:
        assert request.headers.get("Accept-Encoding") == "gzip"
        return web.Response(
            body=compressed,
            headers={"Content-Encoding": "gzip", "Content-Type": "text/plain", "Vary": "Accept"},
        )

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
        client.get(gw.url + "/public/doc", headers={"Accept-Encoding": "gzip"}) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Encoding"] == "gzip"
        assert resp.headers["Vary"] == "Accept"
        received = await resp.read()
    assert received == compressed
    assert gzip.decompress(received) == plain


async def test_head_keeps_content_length_and_sends_no_body(issuer):
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = 300_000 if request.method == "HEAD" else 1000
        await response.prepare(request)
        if request.method != "HEAD":
            await response.write(b"x" * 1000)
        await response.write_eof()
        return response

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
    ):
        connection = await RawConnection.open(gw.url)
        try:
            await connection.send(raw_request("HEAD", "/public/big"))
            head = await connection.response(head=True)
            # The same connection must carry on at the next response: no stray body bytes.
            await connection.send(raw_request("GET", "/public/small"))
            after = await connection.response()
        finally:
            connection.close()
    assert head.status == 200
    assert head.headers["Content-Length"] == "300000"
    assert head.headers["Content-Type"] == "application/octet-stream"
    assert after.status == 200
    assert after.body == b"x" * 1000


async def test_head_on_an_echo_route_passes_the_upstream_length(gateway, issuer):
    token = issuer.token()
    same = [("Authorization", f"Bearer {token}"), ("X-Request-Id", "same-id")]
    get = await raw_exchange(gateway.url, raw_request("GET", "/orders/1", same))
    head = await raw_exchange(gateway.url, raw_request("HEAD", "/orders/1", same))
    assert head.status == 200
    assert head.body == b""
    # The echo differs only in the method it reports: "HEAD" is one byte longer than "GET".
    assert int(head.headers["Content-Length"]) == len(get.body) + 1


@pytest.mark.parametrize("status", [204, 304])
async def test_no_content_and_not_modified_pass_back_without_a_body(issuer, status):
    async def handler(request: web.BaseRequest) -> web.Response:
        return web.Response(status=status, headers={"ETag": '"v2"', "X-Seen": request.method})

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
    ):
        connection = await RawConnection.open(gw.url)
        try:
            await connection.send(raw_request("GET", "/public/x", [("If-None-Match", '"v1"')]))
            first = await connection.response()
            await connection.send(raw_request("GET", "/public/y"))
            second = await connection.response()
        finally:
            connection.close()
    for answer in (first, second):
        assert answer.status == status
        assert answer.body == b""
        assert answer.headers["ETag"] == '"v2"'
        assert "Transfer-Encoding" not in answer.headers


@contextlib.asynccontextmanager
async def byte_upstream(answer: Callable[[str, str], bytes]) -> AsyncIterator[str]:
    """An upstream that writes, for each request head it reads, exactly the bytes
    `answer(method, target)` gives: no server library adds a field of its own."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                method, target, _ = head.split("\r\n", 1)[0].split(" ", 2)
                writer.write(answer(method, target))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def upstream_answer(status: str, fields: list[tuple[str, str]], body: bytes = b"") -> bytes:
    head = "".join(f"{name}: {value}\r\n" for name, value in fields)
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode() + body


@pytest.mark.parametrize(
    ("framing", "size"),
    [("length", 11), ("length", 300_000), ("chunked", 11), ("no-content", 0)],
    ids=["buffered", "streamed", "chunked", "204"],
)
async def test_no_content_type_is_added_when_the_upstream_sent_none(issuer, framing, size):
    """RFC 9110 §8.3: a sender that does not know the media type leaves Content-Type out,
    and the client may then look at the data itself; the gateway does not know it either."""
    body = b"x" * size

    def answer(method: str, target: str) -> bytes:
        if framing == "no-content":
            return upstream_answer("204 No Content", [("X-Kind", "none")])
        if framing == "chunked":
            chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            return upstream_answer("200 OK", [("Transfer-Encoding", "chunked")], chunked)
        return upstream_answer("200 OK", [("Content-Length", str(len(body)))], body)

    async with (
        byte_upstream(answer) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
    ):
        got = await raw_exchange(gw.url, raw_request("GET", "/public/data"))
    assert got.status == (204 if framing == "no-content" else 200)
    assert "Content-Type" not in got.headers
    assert got.body == body


async def test_the_upstreams_server_field_passes_unchanged_and_none_is_made_up(issuer):
    def answer(method: str, target: str) -> bytes:
        fields = [("Content-Type", "text/plain"), ("Content-Length", "2")]
        if target == "/public/named":
            fields.append(("Server", "legacy-orders/2.3 (internal)"))
        return upstream_answer("200 OK", fields, b"ok")

    async with (
        byte_upstream(answer) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
    ):
        named = await raw_exchange(gw.url, raw_request("GET", "/public/named"))
        anonymous = await raw_exchange(gw.url, raw_request("GET", "/public/anonymous"))
    assert named.headers.getall("Server") == ["legacy-orders/2.3 (internal)"]
    assert "Server" not in anonymous.headers
    assert (named.body, anonymous.body) == (b"ok", b"ok")


@pytest.mark.parametrize("server_header", [None, "portcullis"], ids=["default", "configured"])
async def test_the_gateways_own_answers_name_no_software_version(issuer, client, server_header):
    extra = "" if server_header is None else f"server_header: {server_header}\n"

    def answer(method: str, target: str) -> bytes:
        fields = [("Content-Type", "text/plain"), ("Content-Length", "2")]
        return upstream_answer("200 OK", [*fields, ("Server", "upstream/1")], b"ok")

    async with (
        byte_upstream(answer) as up,
        running_gateway(gateway_yaml(issuer.url, up, extra=extra)) as gw,
    ):
        own = [
            await raw_exchange(gw.url, raw_request("GET", "/orders/1")),  # 401
            await raw_exchange(gw.url, raw_request("GET", "/public/" + "p" * 9000)),  # 414
            await raw_exchange(gw.url, b"NOT HTTP\r\n\r\n"),  # 400
        ]
        async with client.get(gw.admin_url + "/healthz") as resp:
            admin_server = resp.headers.getall("Server", [])
        # A request the admin listener's parser refuses: answered under the same field.
        admin_refused = await refused_exchange(gw.admin_url, b"NOT HTTP\r\n\r\n")
        relayed = await raw_exchange(gw.url, raw_request("GET", "/public/x"))
    assert [answer.status for answer in own] == [401, 414, 400]
    expected = [] if server_header is None else [server_header]
    for answer in own:
        assert answer.headers.getall("Server", []) == expected, answer.status
    assert admin_server == expected
    assert (admin_refused.version, admin_refused.status) == ("HTTP/1.1", 400)
    assert admin_refused.headers.getall("Server", []) == expected
    # An upstream's answer keeps the upstream's own Server field, whatever the setting.
    assert relayed.headers.getall("Server") == ["upstream/1"]


# ---------------------------------------------------------------------------- bodies on GET

BODY_ON_GET_ROUTE = """
  - {name: search, path: "/search/**", methods: [GET, HEAD], auth: none, allow_body_on_get: true}
"""


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(
    ("framing", "body"),
    [("Content-Length", b"hello"), ("Transfer-Encoding", b"5\r\nhello\r\n0\r\n\r\n")],
    ids=["content-length", "chunked"],
)
async def test_a_body_on_get_or_head_is_refused_with_400_and_never_forwarded(
    gateway, upstream, method, framing, body
):
    value = str(len(body)) if framing == "Content-Length" else "chunked"
    connection = await RawConnection.open(gateway.url)
    try:
        await connection.send(raw_request(method, "/public/x", [(framing, value)], body))
        answer = await connection.response(head=method == "HEAD")
        assert await connection.closed_by_peer()
    finally:
        connection.close()
    assert answer.status == 400
    assert answer.headers["Connection"] == "close"
    if method == "GET":
        assert answer.json() == error_body(
            "bad_request", "A GET request may not carry a body on this route."
        )
    assert upstream.requests == []


async def test_a_get_with_an_empty_body_is_forwarded(gateway, upstream):
    answer = await raw_exchange(
        gateway.url, raw_request("GET", "/public/x", [("Content-Length", "0")])
    )
    assert answer.status == 200
    assert answer.json()["body_size"] == 0


async def test_a_route_may_allow_a_body_on_get_and_the_upstream_connection_is_not_reused(
    issuer, upstream
):
    config = gateway_yaml(issuer.url, upstream.url, extra_routes=BODY_ON_GET_ROUTE)
    async with running_gateway(config) as gw:
        request = raw_request("GET", "/search/x", [("Content-Length", "5")], b"hello")
        answer = await raw_exchange(gw.url, request)
    assert answer.status == 200
    seen = answer.json()
    assert seen["body_size"] == 5
    # RFC 9112 §9.6: the upstream handles no further request on this connection, so a body
    # it did not read as one cannot become the next request.
    assert header_values(seen, "Connection") == ["close"]


SMUGGLED = b"GET /public/smuggled HTTP/1.1\r\nHost: up\r\nX-Auth-Subject: admin\r\n\r\n"


@dataclass
class BodyIgnoringUpstream:
    """An upstream that reads a body only for POST, PUT and PATCH, as some servers do: the
    body of any other request is read as the next request on the connection. It answers
    each request with `<connection number> <method> <target>`, takes a moment over every
    request after the first on a connection, and honours `Connection: close` (RFC 9112 §9.6)
    unless told not to."""

    honours_close: bool = True
    seen: list[str] = field(default_factory=list)
    connections: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            for count in itertools.count():
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *lines = head.split("\r\n")
                method, target, _ = request_line.split(" ", 2)
                headers = {
                    n.strip().lower(): v.strip()
                    for n, _, v in (line.partition(":") for line in lines if line)
                }
                if method in ("POST", "PUT", "PATCH"):
                    await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append(f"{method} {target}")
                if count:
                    # Late enough that a gateway reusing the connection has sent its next
                    # request by now, and would take this answer for that request's.
                    await asyncio.sleep(0.2)
                body = f"{number} {method} {target}".encode()
                close = self.honours_close and headers.get("connection", "").lower() == "close"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                    + f"Content-Length: {len(body)}\r\n".encode()
                    + (b"Connection: close\r\n" if close else b"")
                    + b"\r\n"
                    + body
                )
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("honours_close", [True, False], ids=["honours-close", "ignores-close"])
@pytest.mark.parametrize(
    ("method", "target"),
    [("OPTIONS", "/public/x"), ("DELETE", "/public/x"), ("GET", "/search/x")],
)
async def test_a_body_the_upstream_may_ignore_never_desynchronises_a_pooled_connection(
    issuer, client, honours_close, method, target
):
    upstream = BodyIgnoringUpstream(honours_close)
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = gateway_yaml(
        issuer.url, f"http://127.0.0.1:{port}", extra_routes=BODY_ON_GET_ROUTE
    ).replace("read_timeout: 2s", "read_timeout: 2s, max_connections: 1")
    try:
        async with running_gateway(config) as gw:
            request = raw_request(
                method, target, [("Content-Length", str(len(SMUGGLED)))], SMUGGLED
            )
            first = await raw_exchange(gw.url, request)
            assert first.status == 200
            assert first.body.endswith(f"{method} {target}".encode())
            # The next client must get the answer to its own request, never the answer the
            # upstream gave to the smuggled one.
            async with client.get(gw.url + "/public/next") as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"GET /public/next")
    finally:
        server.close()
        await server.wait_closed()
    if honours_close:
        assert "GET /public/smuggled" not in upstream.seen
    assert upstream.connections == 2


async def test_an_upstream_answering_before_the_body_is_sent_gets_a_new_connection_next(
    issuer, client
):
    connections: list[int] = []

    async def answer_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(connections)
        connections.append(number)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = f"{number} {head.split(b' ')[1].decode()}".encode()
                # Keep-alive, and the body (if any) left unread: the next bytes on this
                # connection are not a request the gateway sent as one.
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()

    async def upload() -> AsyncIterator[bytes]:
        yield SMUGGLED
        for _ in range(8):
            yield b"z" * 65536
            await asyncio.sleep(0.01)

    server = await asyncio.start_server(answer_early, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = gateway_yaml(issuer.url, f"http://127.0.0.1:{port}").replace(
        "read_timeout: 2s", "read_timeout: 2s, max_connections: 1"
    )
    try:
        async with running_gateway(config) as gw:
            async with client.post(gw.url + "/public/up", data=upload()) as resp:
                assert resp.status == 200
                assert await resp.read() == b"0 /public/up"
            async with client.get(gw.url + "/public/next") as resp:
                assert resp.status == 200
                assert await resp.read() == b"1 /public/next"
    finally:
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------------------- upstream failures


async def test_upstream_refusing_connections_gives_502_bad_gateway(issuer, client, refused_port):
    nobody = f"http://127.0.0.1:{refused_port}"
    async with running_gateway(gateway_yaml(issuer.url, nobody)) as gw:
        async with client.get(gw.url + "/public/x", headers={"X-Request-Id": "r-502"}) as resp:
            assert resp.status == 502
            assert resp.headers["X-Request-Id"] == "r-502"
            assert await resp.json() == error_body(
                "bad_gateway", "The upstream service could not be reached."
            )
        async with client.get(gw.url + "/orders/1", headers=bearer(issuer.token())) as resp:
            assert resp.status == 502


async def test_slow_upstream_gives_504_gateway_timeout(issuer, upstream, client):
    config = gateway_yaml(issuer.url, upstream.url).replace("read_timeout: 2s", "read_timeout: 1s")
    async with running_gateway(config) as gw:
        async with client.get(gw.url + "/_slow/5", headers=bearer(issuer.token())) as resp:
            assert resp.status == 504
            assert await resp.json() == error_body(
                "gateway_timeout", "The upstream service did not answer in time."
            )
        async with client.get(gw.url + "/public/fine") as resp:
            assert resp.status == 200


async def test_upstream_failing_mid_body_cuts_the_client_connection(issuer, client):
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = 1_000_000
        await response.prepare(request)
        await response.write(b"y" * 100_000)
        assert request.transport is not None
        request.transport.abort()
        return response

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
    ):
        async with client.get(gw.url + "/public/x") as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        async with client.get(gw.url + "/public/x") as resp:  # and the gateway carries on
            assert resp.status == 200


async def test_an_early_upstream_answer_is_relayed_while_the_body_is_still_coming(issuer, client):
    async def answer_before_reading(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 8\r\nConnection: close\r\n\r\ntoo much"
        )
        await writer.drain()
        writer.close()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b"z" * 65536
            await asyncio.sleep(0)

    server = await asyncio.start_server(answer_before_reading, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_gateway(gateway_yaml(issuer.url, f"http://127.0.0.1:{port}")) as gw:
            async with client.post(gw.url + "/public/up", data=body()) as resp:
                assert resp.status == 413
                assert await resp.read() == b"too much"
            async with client.post(gw.url + "/public/up", data=b"q" * 300_000) as resp:
                assert resp.status == 413
    finally:
        server.close()
        await server.wait_closed()


async def test_client_leaving_mid_download_releases_the_upstream(issuer):
    written = {"bytes": 0, "cut": False}
    total = 200 * 1024 * 1024

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/public/big":
            return web.Response(text="small")
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = total
        await response.prepare(request)
        block = b"d" * 65536
        try:
            while written["bytes"] < total:
                await response.write(block)
                written["bytes"] += len(block)
        except ConnectionError:
            written["cut"] = True
        return response

    async with (
        scripted_upstream(handler) as up,
        running_gateway(gateway_yaml(issuer.url, up)) as gw,
    ):
        connection = await RawConnection.open(gw.url)
        await connection.send(raw_request("GET", "/public/big"))
        await connection.reader.readexactly(256 * 1024)
        connection.close()
        for _ in range(500):
            if written["cut"]:
                break
            await asyncio.sleep(0.01)
        assert written["cut"], "the gateway kept pulling the body for a client that left"
        assert written["bytes"] < total
        follow_up = await raw_exchange(gw.url, raw_request("GET", "/public/small"))
        assert follow_up.status == 200
        assert follow_up.body == b"small"


# ---------------------------------------------------------------------------- Expect


async def test_expect_100_continue_is_answered_once_the_request_is_allowed(gateway, issuer):
    token = issuer.token()
    body = b"e" * 200_000
    connection = await RawConnection.open(gateway.url)
    try:
        head = raw_request(
            "POST",
            "/upload/file",
            [
                ("Authorization", f"Bearer {token}"),
                ("Content-Length", str(len(body))),
                ("Expect", "100-continue"),
            ],
        )
        await connection.send(head)
        interim = await connection.reader.readuntil(b"\r\n\r\n")
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        await connection.send(body)
        answer = await connection.response()
    finally:
        connection.close()
    assert answer.status == 200
    assert answer.json()["body_size"] == len(body)
    assert "expect" not in normalised_names(answer.json())


async def test_expect_100_continue_gets_the_final_refusal_instead_when_not_allowed(
    gateway, upstream
):
    head = raw_request(
        "POST", "/upload/file", [("Content-Length", "5000"), ("Expect", "100-continue")]
    )
    answer = await raw_exchange(gateway.url, head)  # no body sent: none was asked for
    assert answer.status == 401
    assert challenges_of(answer.headers)[0] == 'Bearer realm="portcullis"'
    assert upstream.requests == []


async def test_aiohttp_client_waiting_for_100_continue_uploads(gateway, issuer, client):
    body = b"c" * 100_000
    async with client.post(
        gateway.url + "/upload/x",
        data=body,
        expect100=True,
        headers=bearer(issuer.token()),
        timeout=aiohttp.ClientTimeout(total=10),
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["body_size"] == len(body)
