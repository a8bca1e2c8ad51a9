"""CORS for browsers: preflights answered by the gateway without a token, CORS headers on
every answer to an allowed origin (refusals included), none for a disallowed origin, and
`Vary: Origin` wherever the answer depends on it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tests.support import challenges_of, gateway_yaml, running_gateway, start_site

APP = "https://app.example.com"
EVIL = "https://evil.example.net"

GLOBAL_CORS = """
cors:
  allow_origins: ["https://app.example.com", "https://admin.example.com"]
  allow_methods: [GET, POST, PUT]
  allow_headers: [Authorization, Content-Type, X-Trace]
  expose_headers: [X-Request-Id, RateLimit]
  allow_credentials: true
  max_age: 5m
"""
ROUTES = """
  - {name: no-cors, path: "/plain/**", auth: none, cors: false}
  - name: open
    path: "/open/**"
    auth: none
    cors: {allow_origins: ["*"], allow_methods: [GET]}
"""


def cors_config(issuer: str, upstream: str) -> str:
    return gateway_yaml(issuer, upstream, extra_routes=ROUTES, extra=GLOBAL_CORS)


async def send(client, method: str, url: str, **headers: str) -> tuple[int, Any, Any]:
    async with client.request(method, url, headers=headers) as response:
        body = await response.read()
        return response.status, response.headers, body


def cors_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower().startswith("access-control-")}


async def test_a_preflight_from_an_allowed_origin_is_answered_without_a_token(
    issuer, upstream, client
):
    async with running_gateway(cors_config(issuer.url, upstream.url)) as gateway:
        status, headers, body = await send(
            client,
            "OPTIONS",
            gateway.url + "/orders/7",
            Origin=APP,
            **{
                "Access-Control-Request-Method": "PUT",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
    assert (status, body) == (204, b"")
    assert cors_headers(headers) == {
        "Access-Control-Allow-Origin": APP,
        "Access-Control-Allow-Methods": "GET, POST, PUT",
        "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Trace",
        "Access-Control-Max-Age": "300",
        "Access-Control-Allow-Credentials": "true",
    }
    assert headers["Vary"] == (
        "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
    )
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("origin", "method", "asked_headers", "reason"),
    [
        (EVIL, "GET", "", "the origin is not allowed"),
        ("https://app.example.com.evil.net", "GET", "", "the origin is not allowed"),
        (APP, "DELETE", "", "the method DELETE is not allowed"),
        (APP, "GET", "authorization, x-admin", "the header x-admin is not allowed"),
    ],
    ids=["other-origin", "suffix-origin", "method", "header"],
)
async def test_a_preflight_the_policy_does_not_allow_gets_no_cors_headers(
    issuer, upstream, client, origin, method, asked_headers, reason
):
    asked = {"Access-Control-Request-Method": method}
    if asked_headers:
        asked["Access-Control-Request-Headers"] = asked_headers
    async with running_gateway(cors_config(issuer.url, upstream.url)) as gateway:
        status, headers, body = await send(
            client, "OPTIONS", gateway.url + "/orders/7", Origin=origin, **asked
        )
    assert status == 403
    assert cors_headers(headers) == {}
    assert headers["Vary"] == "Origin"
    assert headers["Content-Type"] == "application/json"
    assert body == (
        b'{"error":{"code":"cors_refused","message":"This cross-origin request is not '
        b"allowed: " + reason.encode() + b'.","details":[]}}'
    )
    assert upstream.requests == []


async def test_an_allowed_origin_gets_cors_headers_on_the_answer_and_on_a_refusal(
    issuer, upstream, client
):
    token = issuer.token("ES256")
    async with running_gateway(cors_config(issuer.url, upstream.url)) as gateway:
        ok_status, ok_headers, _ = await send(
            client, "GET", gateway.url + "/orders/7", Origin=APP, Authorization=f"Bearer {token}"
        )
        refused_status, refused_headers, _ = await send(
            client, "GET", gateway.url + "/orders/7", Origin=APP
        )
    expected = {
        "Access-Control-Allow-Origin": APP,
        "Access-Control-Allow-Credentials": "true",
        "Access-Control-Expose-Headers": "X-Request-Id, RateLimit",
    }
    assert ok_status == 200
    assert cors_headers(ok_headers) == expected
    assert ok_headers["Vary"] == "Origin"
    # A page must be able to read why it was refused.
    assert refused_status == 401
    assert cors_headers(refused_headers) == expected
    assert challenges_of(refused_headers)[0] == 'Bearer realm="portcullis"'
    assert len(upstream.requests) == 1


async def test_a_disallowed_origin_gets_no_cors_headers_but_the_request_still_runs(
    issuer, upstream, client
):
    token = issuer.token("ES256")
    async with running_gateway(cors_config(issuer.url, upstream.url)) as gateway:
        status, headers, _ = await send(
            client, "GET", gateway.url + "/orders/7", Origin=EVIL, Authorization=f"Bearer {token}"
        )
    # CORS only tells the browser what a page may read; the token decides what may run.
    assert status == 200
    assert cors_headers(headers) == {}
    assert headers["Vary"] == "Origin"
    assert len(upstream.requests) == 1


async def test_a_wildcard_policy_answers_any_origin_with_a_star(issuer, upstream, client):
    async with running_gateway(cors_config(issuer.url, upstream.url)) as gateway:
        pre_status, pre_headers, _ = await send(
            client,
            "OPTIONS",
            gateway.url + "/open/x",
            Origin=EVIL,
            **{"Access-Control-Request-Method": "GET"},
        )
        status, headers, _ = await send(client, "GET", gateway.url + "/open/x", Origin=EVIL)
    assert pre_status == 204
    assert pre_headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in pre_headers
    assert status == 200
    assert cors_headers(headers) == {"Access-Control-Allow-Origin": "*"}


async def test_a_route_without_cors_forwards_its_preflight_like_any_options_request(
    issuer, upstream, client
):
    async with running_gateway(cors_config(issuer.url, upstream.url)) as gateway:
        status, headers, _ = await send(
            client,
            "OPTIONS",
            gateway.url + "/plain/x",
            Origin=APP,
            **{"Access-Control-Request-Method": "GET"},
        )
    assert status == 200
    assert cors_headers(headers) == {}
    assert [r["method"] for r in upstream.requests] == ["OPTIONS"]


@pytest.fixture
async def cors_upstream() -> AsyncIterator[str]:
    """An upstream that answers with CORS headers of its own."""

    async def handle(_: web.BaseRequest) -> web.Response:
        return web.Response(
            text="ok",
            headers={
                "Access-Control-Allow-Origin": "*",
                "Access-Control-Allow-Methods": "DELETE",
            },
        )

    runner, url = await start_site(web.Server(handle))
    yield url
    await runner.cleanup()


async def test_the_upstreams_own_cors_headers_give_way_to_the_gateways_policy(
    issuer, cors_upstream, client
):
    async with running_gateway(cors_config(issuer.url, cors_upstream)) as gateway:
        handled = await send(client, "GET", gateway.url + "/public/x", Origin=EVIL)
        passed_through = await send(client, "GET", gateway.url + "/plain/x", Origin=EVIL)
    # Where the gateway answers CORS, a disallowed origin gets none, whatever the upstream said.
    assert cors_headers(handled[1]) == {}
    assert cors_headers(passed_through[1]) == {
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Methods": "DELETE",
    }
