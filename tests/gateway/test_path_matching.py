"""Which rule a request meets, against a real gateway on 127.0.0.1: paths that upstream servers
read differently from a plain string compare (`;` parameters, letter case) and HEAD, which
frameworks serve with the GET handler. Requests go over raw sockets, so they reach the gateway
exactly as written.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import (
    EchoUpstream,
    TestIssuer,
    gateway_yaml,
    raw_exchange,
    raw_request,
    running_gateway,
)

# A protected corner inside a public tree: the shape every attack below aims at.
DOCS = (
    '  - {name: internal, path: "/docs/internal/**", scopes: {any: ["docs:internal"]}}\n'
    '  - {name: docs, path: "/docs/**", auth: none}\n'
)


def forwarded(upstream: EchoUpstream) -> list[str]:
    return [seen["raw_path"] for seen in upstream.requests]


def error_code(answer: Any) -> str:
    body = answer.json()
    assert body["error"]["details"] == []
    return str(body["error"]["code"])


# ---------------------------------------------------------------------------- ; parameters


@pytest.mark.parametrize(
    "target",
    [
        "/docs/internal;x=1/secret",
        "/docs/internal;/secret",
        "/docs/internal%3Bx=1/secret",
        "/docs/internal%3bx=1/secret",
        "/docs/;x/internal/secret",
        "/docs/readme;jsessionid=1",
    ],
)
async def test_path_parameters_are_refused_by_default_so_they_cannot_leave_a_protected_rule(
    issuer: TestIssuer, upstream: EchoUpstream, target: str
) -> None:
    # Tomcat, Jetty and Spring remove `;params` and serve /docs/internal/secret: a match on
    # the text as sent would take the public rule.
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, DOCS)) as gw:
        answer = await raw_exchange(gw.url, raw_request("GET", target))
    assert answer.status == 400
    assert error_code(answer) == "bad_request"
    assert "path parameters" in answer.json()["error"]["message"]
    assert forwarded(upstream) == []


ALLOWING = (
    '  - {name: internal, path: "/docs/internal/**", scopes: {any: ["docs:internal"]}}\n'
    '  - {name: docs, path: "/docs/**", auth: none, path_params: allow}\n'
    '  - {name: matrix, path: "/cars/{id}/**", path_params: allow}\n'
)


@pytest.mark.parametrize(
    "target",
    [
        "/docs/internal;x=1/secret",
        "/docs/internal%3Bx=1/secret",
        "/docs/internal/secret;v=2",
        "/docs/internal/;v=2",
    ],
)
async def test_with_a_route_allowing_parameters_the_rule_is_chosen_on_the_path_without_them(
    issuer: TestIssuer, upstream: EchoUpstream, target: str
) -> None:
    # The stripped path meets the protected rule, which does not take parameters: refused,
    # not sent on to the public rule that does.
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, ALLOWING)) as gw:
        answer = await raw_exchange(gw.url, raw_request("GET", target))
    assert answer.status == 400
    assert "path parameters" in answer.json()["error"]["message"]
    assert forwarded(upstream) == []


async def test_a_route_allowing_parameters_gets_them_forwarded_byte_for_byte(
    issuer: TestIssuer, upstream: EchoUpstream
) -> None:
    token = issuer.token()
    auth = [("Authorization", f"Bearer {token}")]
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, ALLOWING)) as gw:
        public = await raw_exchange(gw.url, raw_request("GET", "/docs/guide;v=2/intro"))
        anonymous = await raw_exchange(gw.url, raw_request("GET", "/cars/7;color=red/doors"))
        signed = await raw_exchange(gw.url, raw_request("GET", "/cars/7;color=red/doors", auth))
        encoded = await raw_exchange(gw.url, raw_request("GET", "/cars/7%3Bc=r%3Bb", auth))
        emptied = await raw_exchange(gw.url, raw_request("GET", "/cars/;x/doors", auth))
    assert (public.status, anonymous.status, signed.status) == (200, 401, 200)
    assert encoded.status == 200
    assert emptied.status == 400  # /cars//doors once stripped: an empty segment
    assert forwarded(upstream) == [
        "/docs/guide;v=2/intro",
        "/cars/7;color=red/doors",
        "/cars/7%3Bc=r%3Bb",
    ]


# ---------------------------------------------------------------------------- letter case


def case_config(issuer: str, upstream: str, path_case: str) -> str:
    config = gateway_yaml(issuer, upstream, DOCS)
    return config.replace("read_timeout: 2s}", f"read_timeout: 2s, path_case: {path_case}}}")


@pytest.mark.parametrize(
    "target",
    [
        "/docs/INTERNAL/secret",
        "/docs/Internal/secret",
        "/DOCS/internal/secret",
        "/Docs/%49nternal/secret",
    ],
)
async def test_case_insensitive_upstream_keeps_case_variants_on_the_protected_rule(
    issuer: TestIssuer, upstream: EchoUpstream, target: str
) -> None:
    config = case_config(issuer.url, upstream.url, "insensitive")
    async with running_gateway(config) as gw:
        anonymous = await raw_exchange(gw.url, raw_request("GET", target))
        auth = [("Authorization", f"Bearer {issuer.token(scope='docs:internal')}")]
        signed = await raw_exchange(gw.url, raw_request("GET", target, auth))
    assert anonymous.status == 401
    assert signed.status == 200
    assert forwarded(upstream) == [target]  # the case the client wrote, unchanged


async def test_case_insensitive_matching_applies_to_public_rules_too(
    issuer: TestIssuer, upstream: EchoUpstream
) -> None:
    config = case_config(issuer.url, upstream.url, "insensitive")
    async with running_gateway(config) as gw:
        answer = await raw_exchange(gw.url, raw_request("GET", "/DOCS/Readme"))
    assert answer.status == 200
    assert forwarded(upstream) == ["/DOCS/Readme"]


@pytest.mark.parametrize(
    "target",
    [
        "/docs/%C4%B1nternal/secret",  # U+0131 dotless i: upper-cases to I
        "/docs/%C5%BFecret",  # U+017F long s: upper-cases to S
        "/docs/interna%E2%84%AA",  # U+212A KELVIN SIGN: lower-cases to k
    ],
)
async def test_case_insensitive_refuses_letters_that_servers_fold_into_ascii_differently(
    issuer: TestIssuer, upstream: EchoUpstream, target: str
) -> None:
    config = case_config(issuer.url, upstream.url, "insensitive")
    async with running_gateway(config) as gw:
        answer = await raw_exchange(gw.url, raw_request("GET", target))
    assert answer.status == 400
    assert error_code(answer) == "bad_request"
    assert forwarded(upstream) == []


async def test_case_sensitive_matching_is_the_default_and_exact(
    issuer: TestIssuer, upstream: EchoUpstream
) -> None:
    # Documented: with the default, the upstream must treat paths case-sensitively too.
    async with running_gateway(case_config(issuer.url, upstream.url, "sensitive")) as gw:
        exact = await raw_exchange(gw.url, raw_request("GET", "/docs/internal/secret"))
        variant = await raw_exchange(gw.url, raw_request("GET", "/docs/INTERNAL/secret"))
    assert (exact.status, variant.status) == (401, 200)


# ---------------------------------------------------------------------------- HEAD


async def test_head_is_held_to_the_rule_that_names_get(
    issuer: TestIssuer, upstream: EchoUpstream
) -> None:
    routes = (
        '  - {name: reports, path: "/reports/**", methods: [GET], scopes: {any: ["reports"]}}\n'
        '  - {name: reports-drop, path: "/reports/**", auth: none}\n'
    )
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, routes)) as gw:
        head = await raw_exchange(gw.url, raw_request("HEAD", "/reports/q3"))
        auth = [("Authorization", f"Bearer {issuer.token(scope='reports')}")]
        signed = await raw_exchange(gw.url, raw_request("HEAD", "/reports/q3", auth))
        other = await raw_exchange(gw.url, raw_request("OPTIONS", "/reports/q3"))
    assert head.status == 401
    assert signed.status == 200
    assert other.status == 200  # methods the GET rule does not name still reach the next rule
    assert [seen["method"] for seen in upstream.requests] == ["HEAD", "OPTIONS"]
